"""Host memory of CPU training: hand freed tensors back to the OS (glibc's mmap threshold).

glibc's malloc serves a block below its mmap threshold from the heap, and raises that threshold
(up to 32 MB on 64-bit) each time a larger mmapped block is freed. PyTorch's CPU allocator has
no cache of its own, so after the first few frees every tensor of up to 32 MB (a training step
makes thousands: attention blocks, MLP activations, chunks of logits) comes from the heap, and
a freed one stays resident until the heap top happens to be free: the resident set of a
training run grows by gigabytes that hold nothing. Measured on a 0.5B target's CPU training
(docs/benchmarks.md, "Memory"): 1.1-1.4 GB of a step's peak, 1.4 GB resident
between steps. A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops the
adjustment) maps every block above it on its own and unmaps it when it is freed. The price is a
page fault per 4 KB each time such a tensor is made (about 8% more CPU time on that run, the
losses bit-identical), so the trainer fixes it for large steps only (``memory.large_step``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 4 << 20  # blocks of 4 MB and more: large tensors only, small ones stay in the heap
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own switch: a user who set it keeps their setting


def return_freed_tensors(threshold: int = MMAP_THRESHOLD) -> str | None:
    """Fix glibc's mmap threshold at ``threshold`` bytes; returns what was done (None: nothing,
    e.g. not Linux, not glibc, or the user set ``MALLOC_MMAP_THRESHOLD_`` themselves)."""
    if not sys.platform.startswith("linux") or ENV in os.environ:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt threshold)
        return None
    if mallopt(M_MMAP_THRESHOLD, int(threshold)) != 1:
        return None
    return f"glibc mmap threshold fixed at {threshold >> 20} MB (freed tensors go back to the OS)"
