"""Running CLI commands in a fresh interpreter, to check what a refusal costs: its exit code, its
stderr, its time, and which heavy libraries it imported (none, when the parser or an options'
validate() refuses before the library loads)."""

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "huggingface_hub", "safetensors")

_RUNNER = r"""
import contextlib, io, json, sys, time
from eagle3cli.cli import main
argvs, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = []
for argv in argvs:
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        sys.argv = ["eagle3", *argv]
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
    out.append({"argv": argv, "code": code, "stderr": err.getvalue(),
                "lines": [ln for ln in err.getvalue().splitlines() if ln.strip()], "s": time.perf_counter() - t0})
print(json.dumps({"runs": out, "heavy": sorted(m for m in heavy if m in sys.modules)}))
"""


def refuse(argvs: list[list[str]]) -> dict:
    """Run each argv through ``eagle3`` in one new interpreter (no Hub, a wide terminal):
    ``{"runs": [{argv, code, stderr, lines, s}], "heavy": [heavy modules imported]}``."""
    r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(argvs), json.dumps(HEAVY)], capture_output=True,
                       text=True, timeout=120, env={"COLUMNS": "1000", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
