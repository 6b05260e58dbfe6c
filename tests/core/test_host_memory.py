"""glibc's mmap threshold on CPU training (eagle3cli.core.host_memory): freed tensors leave the
resident set. Each case runs in its own interpreter, since the setting is process-wide."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

# A 30 MB tensor freed (glibc then raises its threshold to 30 MB), then 60 tensors of 10 MB, each
# followed by a small one that outlives it (as a training step's small tensors do), the 60 freed:
# what stays resident?
PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from eagle3cli.core import host_memory
    done = host_memory.return_freed_tensors() if sys.argv[1] == "fixed" else None
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    a = torch.ones(30 << 18); del a
    base = rss()
    blocks, keep = [], []
    for _ in range(60):
        blocks.append(torch.ones(10 << 18))
        keep.append(torch.ones(1000))
    grown = rss() - base
    del blocks
    print(json.dumps({"done": done, "grown": grown, "kept": rss() - base}))
""")


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fixed_threshold_gives_freed_tensors_back():
    fixed = probe("fixed")
    assert fixed["done"] and "4 MB" in fixed["done"]
    assert fixed["grown"] > 500 << 20  # 600 MB were really touched
    assert fixed["kept"] < 100 << 20   # and went back to the OS when freed


def test_without_it_glibc_keeps_them():
    """Why the setting exists: glibc's default (adaptive threshold) keeps the freed 600 MB."""
    default = probe("default")
    assert default["done"] is None and default["kept"] > 400 << 20


def test_a_users_own_setting_is_left_alone(monkeypatch):
    from eagle3cli.core import host_memory

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.return_freed_tensors() is None


