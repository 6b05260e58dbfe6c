"""gen-data's error: its own module so that every piece of the pipeline (samples, store writer,
estimates, progress) raises it without importing the pipeline that uses them."""

from __future__ import annotations

from ..core.errors import Eagle3Error


class GenDataError(Eagle3Error, ValueError):
    """A problem the user must fix; the message is one line."""
