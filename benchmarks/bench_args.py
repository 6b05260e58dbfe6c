"""The command-line preamble of the benchmarks that time one target on the CPU: --model (default
the cached SmolLM2-135M-Instruct, built once from PyPI where the Hub is out of reach) and
--threads, applied once parsed."""

from __future__ import annotations

import argparse

import torch


def add_target_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="target folder (default: the SmolLM2 of eagle3cli.core.realmodels)")
    ap.add_argument("--threads", type=int, default=2)


def apply_target_args(args: argparse.Namespace) -> None:
    """Set torch's thread count and fill ``args.model`` with the cached SmolLM2 when not given."""
    torch.set_num_threads(args.threads)
    if args.model is None:
        from eagle3cli.core.realmodels import smollm2_dir

        args.model = str(smollm2_dir())
