"""What eval reports: numbers formatted for the result tables every evaluation prints
(ours, vLLM's and llama.cpp's), so that the engines below ``evaluate`` need not import it."""

from __future__ import annotations

import math


def fmt(x, spec=".2f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
