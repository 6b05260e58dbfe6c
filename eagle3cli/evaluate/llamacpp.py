"""llama.cpp as an evaluation engine: plain vs speculative decoding (EAGLE-3 or DFlash) in ``llama-server``.

``eagle3 eval --engine llama.cpp`` starts ``llama-server`` on a target GGUF, once plain and once
per setting with the draft GGUF (``-md DRAFT --spec-type draft-eagle3 --spec-draft-n-max K``, or
``--spec-type draft-dflash`` for a DFlash draft, whose GGUF llama.cpp's own converter writes with
the target's folder; which settings: llamacpp_sweep.py), sends the same prompts as token ids (our tokenizer and chat
template, so both engines see the same tokens) to ``POST /completion`` greedily, and reads the
engine's own counts. This module is one server and one pass over the prompts.

What the server reports (llama-cpp-python 0.3.36, vendor/llama.cpp/tools/server/): every
``/completion`` answer carries ``tokens`` (with ``return_tokens``) and ``timings`` =
``server_slot_stats::to_json`` (server-common.cpp): ``prompt_n``, ``prompt_ms``, ``predicted_n``,
``predicted_ms``, ``predicted_per_second`` and, when something was drafted, ``draft_n`` and
``draft_n_accepted``. ``GET /metrics`` (with ``--metrics``; server-task.cpp) adds the counters
``llamacpp:spec_decode_num_drafts_total`` (verification steps), ``..._num_draft_tokens_total`` and
``..._num_accepted_tokens_total``.

Mean acceptance length, as ``eagle3 eval``'s tau (tokens per target forward after prefill): the
first token of an answer comes from the prompt pass, each later target step gives one token plus
the drafts it accepted, so steps = predicted_n - 1 - draft_n_accepted and
tau = (predicted_n - 1) / steps, summed over answers. From /metrics: 1 + accepted / drafts
(counting only steps that verified a draft).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import Eagle3Error
from ..publish.gguf_export import llama_cpp_roots
from .replay import prompt_counter, replay_plain

SERVER = "llama-server"
BUILD_HINT = ("build it with `bash benchmarks/build_llamacpp.sh` (tools from the llama-cpp-python sdist on PyPI) "
              "or pass --llama-cpp DIR (the folder with llama-server, or a llama.cpp tree with build/bin)")


EXTRA = 'pip install "eagle3[llamacpp]"'
# What llama.cpp's convert_hf_to_gguf.py (with its vendored gguf-py) imports, as (module, PyPI
# name): numpy and yaml at import, sentencepiece (+ protobuf for its model files) for many
# tokenizers, safetensors for the weights. Writing a draft without the converter needs the gguf
# package. The [llamacpp] extra in pyproject.toml installs them all.
CONVERTER_MODULES = (("numpy", "numpy"), ("yaml", "pyyaml"), ("sentencepiece", "sentencepiece"),
                     ("google.protobuf", "protobuf"), ("safetensors", "safetensors"))
GGUF_MODULES = (("gguf", "gguf"), ("numpy", "numpy"))


class LlamaCppError(Eagle3Error, RuntimeError):
    """One line that says what to do."""


def missing_modules(modules=CONVERTER_MODULES) -> list[str]:
    """The PyPI names of ``modules`` this Python cannot import."""
    import importlib.util

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a missing parent package ("google" of google.protobuf)
            return True

    return [pip for mod, pip in modules if absent(mod)]


def check_conversion(target: str, target_gguf=None, draft_gguf=None, llama_cpp=None, dflash: bool = False) -> None:
    """Before any model is loaded: that the GGUFs not given can be made here (the converter and
    the modules it imports; for a DFlash draft the converter and the target's folder, which it reads
    for the tokenizer and the MASK id), else one line that says what to install or pass."""
    from ..publish.gguf_export import _no_converter, find_converter

    if target_gguf is not None and draft_gguf is not None:
        return
    local = Path(target).is_dir()
    if target_gguf is None and not local:
        raise LlamaCppError(f"--target-gguf FILE is needed: {target} is not a local HF folder to convert")
    conv = find_converter(llama_cpp) if local else None
    if target_gguf is None and conv is None:
        raise LlamaCppError(str(_no_converter(llama_cpp)))
    if dflash and draft_gguf is None and conv is None:  # no gguf-package fallback for DFlash (gguf_export)
        if not local:
            raise LlamaCppError(f"a DFlash draft's GGUF is written by llama.cpp's converter from the target's HF "
                                f"folder, and {target} is not one: pass --model DIR or --draft-gguf FILE")
        raise LlamaCppError(f"{_no_converter(llama_cpp)}; it writes a DFlash draft's GGUF (or pass --draft-gguf FILE)")
    missing = missing_modules(CONVERTER_MODULES if conv is not None else GGUF_MODULES)
    if missing:
        raise LlamaCppError(f"writing GGUF files needs {', '.join(missing)}, which this Python lacks: {EXTRA} "
                            "(or pass --target-gguf and --draft-gguf)")


def find_binary(name: str = SERVER, llama_cpp: str | Path | None = None) -> Path:
    """``name`` in DIR, DIR/bin or DIR/build/bin (DIR = --llama-cpp, else $EAGLE3_LLAMA_CPP), else PATH."""
    looked = []
    for root in llama_cpp_roots(llama_cpp):
        for d in (root, root / "bin", root / "build" / "bin"):
            looked.append(str(d))
            p = d / name
            if p.is_file() and os.access(p, os.X_OK):
                return p
    if llama_cpp is None:
        on_path = shutil.which(name)
        if on_path:
            return Path(on_path)
        looked.append("PATH")
    raise LlamaCppError(f"{name} not found (looked in {', '.join(looked)}): {BUILD_HINT}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One llama-server process; ``with Server(...) as s:`` starts it and waits until it is healthy."""

    binary: Path
    model: Path
    draft: Path | None = None
    spec_type: str = "draft-eagle3"  # llama.cpp's name of the draft family: draft-dflash for a DFlash draft
    n_max: int = 3
    p_min: float = 0.0
    threads: int | None = None
    threads_draft: int | None = None
    ctx: int = 4096
    extra: list[str] = field(default_factory=list)
    log_path: Path | None = None
    start_timeout_s: float = 300.0
    port: int = 0
    proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        a = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
             "-c", str(self.ctx), "-np", "1", "--metrics", "--no-webui"]
        if self.threads:
            a += ["-t", str(self.threads)]
        if self.draft is not None:
            a += ["-md", str(self.draft), "--spec-type", self.spec_type, "--spec-draft-n-max", str(self.n_max),
                  "--spec-draft-p-min", str(self.p_min)]
            if self.threads_draft:
                a += ["-td", str(self.threads_draft)]
        return a + list(self.extra)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.port = self.port or _free_port()
        self._log = open(self.log_path, "w") if self.log_path else None
        self.proc = subprocess.Popen(self.args(), stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaCppError(f"{self.binary.name} exited with code {self.proc.returncode} while loading "
                                    f"{self.model}: {self._last_log_line()}")
            try:
                if self._get("/health", timeout=2).get("status") == "ok":
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        self.__exit__()
        raise LlamaCppError(f"{self.binary.name} did not become ready in {self.start_timeout_s:.0f} s; "
                            f"see {self.log_path or 'its log'}")

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None
        return False

    def _last_log_line(self) -> str:
        if self.log_path and Path(self.log_path).is_file():
            lines = [ln for ln in Path(self.log_path).read_text(errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1].strip()
        return "no output"

    def _get(self, path: str, timeout: float = 30) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def complete(self, tokens: list[int], n_predict: int, seed: int = 0, timeout: float = 600, **more) -> dict:
        """Greedy ``/completion`` of token ids; ``more``: further request fields (``ignore_eos``)."""
        body = {"prompt": list(tokens), "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": seed,
                "cache_prompt": False, "return_tokens": True, "stream": False, **more}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaCppError(f"{self.binary.name} /completion: HTTP {e.code}: "
                                f"{e.read().decode(errors='replace')[:200]}") from None

    def metrics(self) -> dict[str, float]:
        """Prometheus counters of /metrics, ``llamacpp:`` prefix dropped; {} if the server has none."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
        except (OSError, urllib.error.HTTPError):
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name.split("{")[0].removeprefix("llamacpp:")] = float(value)
            except ValueError:
                pass
        return out


def version(binary: Path) -> str | None:
    try:
        p = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else None


# ---------------------------------------------------------------- the evaluation

@dataclass
class Tally:
    answers: int = 0
    tokens: int = 0
    ms: float = 0.0
    wall_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # target decode steps after the prompt pass

    def add(self, r: dict, wall_s: float):
        t = r.get("timings") or {}
        n = int(t.get("predicted_n", r.get("tokens_predicted", 0)))
        acc = int(t.get("draft_n_accepted", 0))
        self.answers += 1
        self.tokens += n
        self.ms += float(t.get("predicted_ms", 0.0))
        self.wall_s += wall_s
        self.drafted += int(t.get("draft_n", 0))
        self.accepted += acc
        self.steps += max(0, n - 1 - acc)

    @classmethod
    def total(cls, tallies) -> "Tally":
        """The sum of ``tallies``, field by field."""
        out = cls()
        for t in tallies:
            for f in dataclasses.fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(t, f.name))
        return out

    def tokens_per_s(self) -> float | None:
        return 1000.0 * self.tokens / self.ms if self.ms else None


METRIC_KEYS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
               "spec_decode_num_accepted_tokens_total")


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in METRIC_KEYS if k in after}


def plain_pass(s, loaded, tokenizer, max_new_tokens, warmup_tokens, log, progress):
    """Every turn decoded plainly by server ``s``: ({task: Tally}, the replay whose contexts both runs see)."""
    plain = {task: Tally() for task, _ in loaded}

    def decode(task, ids):
        t0 = time.perf_counter()
        r = s.complete(ids, max_new_tokens)
        plain[task].add(r, time.perf_counter() - t0)
        return list(r.get("tokens") or []), r.get("content")

    replay = replay_plain(loaded, tokenizer, decode, lambda ids: s.complete(ids, warmup_tokens),
                          prompt_counter(log, "llama.cpp plain", progress))
    if replay.first is None:
        raise LlamaCppError("no prompts to run")
    return plain, replay


def spec_pass(s, loaded, replay, max_new_tokens, warmup_tokens, log, progress):
    """The replay's contexts decoded speculatively by server ``s``: ({task: Tally}, {task: [prompt ids
    that differ from plain]}, {task: server metrics}, the whole run's server metrics)."""
    spec = {task: Tally() for task, _ in loaded}
    mismatches: dict[str, list[str]] = {task: [] for task, _ in loaded}
    s.complete(replay.first, warmup_tokens)
    before = s.metrics()
    per_task_metrics = {}
    done, after = 0, prompt_counter(log, "llama.cpp speculative", progress)
    for task, prompts in loaded:
        m0 = s.metrics()
        for p in prompts:
            for i, ids in enumerate(replay.contexts[(task, p.id)]):
                t0 = time.perf_counter()
                r = s.complete(ids, max_new_tokens)
                spec[task].add(r, time.perf_counter() - t0)
                if replay.mismatch(task, p.id, i, r.get("tokens") or []) and p.id not in mismatches[task]:
                    mismatches[task].append(p.id)
            done += 1
            after(done, len(replay.contexts))
        per_task_metrics[task] = _delta(s.metrics(), m0)
    return spec, mismatches, per_task_metrics, _delta(s.metrics(), before)


def task_summary(num_prompts: int, b: Tally, sp: Tally, m: dict, mismatches: list[str]) -> dict:
    """One task's row of the engine section: tau (from the answers, and from the server's metrics),
    acceptance, tokens/s of both runs and the lossless verdict."""
    drafts = m.get("spec_decode_num_drafts_total")
    tps_b, tps_s = b.tokens_per_s(), sp.tokens_per_s()
    return {
        "num_prompts": num_prompts,
        "answers": sp.answers,
        "tau": (sp.tokens - sp.answers) / sp.steps if sp.steps else None,
        "tau_metrics": 1 + m["spec_decode_num_accepted_tokens_total"] / drafts if drafts else None,
        "drafted": sp.drafted,
        "accepted": sp.accepted,
        "verify_steps": int(drafts) if drafts is not None else None,
        "decode_steps": sp.steps,
        "acceptance_rate": sp.accepted / sp.drafted if sp.drafted else None,
        "tokens": {"baseline": b.tokens, "speculative": sp.tokens},
        "tokens_per_s": {"baseline": tps_b, "speculative": tps_s},
        "wall_tokens_per_s": {"baseline": b.tokens / b.wall_s if b.wall_s else None,
                              "speculative": sp.tokens / sp.wall_s if sp.wall_s else None},
        "speedup": tps_s / tps_b if tps_b and tps_s else None,
        "lossless": not mismatches,
        "mismatches": mismatches,
    }


def engine_files(draft_dir, target: str, out_dir: Path, target_gguf=None, draft_gguf=None, llama_cpp=None,
                 outtype: str = "f32", log=print) -> tuple[Path, Path]:
    """The target and draft GGUFs to serve: as given, else converted into ``out_dir`` (gguf_export)."""
    from ..publish.gguf_export import GGUFExportError, convert_target, export_gguf

    try:
        if target_gguf is None:
            if not Path(target).is_dir():
                raise LlamaCppError(f"--target-gguf FILE is needed: {target} is not a local HF folder to convert")
            target_gguf, warnings = convert_target(target, out_dir / f"target-{outtype}.gguf", outtype, llama_cpp, log)
            for w in warnings:
                log(f"converter warning: {w}")
        if draft_gguf is None:
            files, warnings = export_gguf(draft_dir, out_dir, outtype,
                                          target_dir=target if Path(target).is_dir() else None,
                                          target_gguf=target_gguf, llama_cpp=llama_cpp, log=log)
            for w in warnings:
                log(f"converter warning: {w}")
            draft_gguf = files["draft"]
    except GGUFExportError as e:
        raise LlamaCppError(with_extra(str(e))) from None
    for p in (target_gguf, draft_gguf):
        if not Path(p).is_file():
            raise LlamaCppError(f"{p}: no such GGUF file")
    return Path(target_gguf), Path(draft_gguf)


def with_extra(message: str) -> str:
    """A converter failure on a missing module names the extra that brings it."""
    return f"{message}: {EXTRA}" if "No module named" in message else message


def engine_table(section: dict):
    """The printed table of the engine section (rich Table)."""
    from rich.table import Table

    from .report import fmt

    s = section["settings"]
    t = Table(title=f"{section['name']}: {s['spec_type']}, chain {s['spec_draft_n_max']}, "
                    f"p-min {s['spec_draft_p_min']}, "
                    f"threads {s['threads'] or 'default'} ({section.get('version') or 'version unknown'})")
    for col in ["task", "prompts", "tau", "accepted/drafted", "plain tok/s", "spec tok/s", "speedup", "same output"]:
        t.add_column(col, justify="left" if col == "task" else "right")
    for name, r in section["tasks"].items():
        tps = r["tokens_per_s"]
        t.add_row(name, str(r["num_prompts"]), fmt(r["tau"]), f"{r['accepted']}/{r['drafted']}",
                  fmt(tps["baseline"], ".1f"), fmt(tps["speculative"], ".1f"),
                  fmt(r["speedup"]) + "x" if r["speedup"] else "-",
                  "[green]yes[/]" if r["lossless"] else f"[red]NO ({len(r['mismatches'])})[/]")
    return t
