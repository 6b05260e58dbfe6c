"""Which llama.cpp setting makes a draft pay: ``eval --engine llama.cpp`` over target types, draft
types, draft lengths and p-mins (``eval_config.EngineGrid``).

A llama.cpp user chooses a target type (f32, bf16, q8_0, or a quantized file such as q4_K_M), a
draft type and the server's ``--spec-draft-n-max`` / ``--spec-draft-p-min``, and whether a draft
pays depends on all four: a q8_0 target's plain step is cheap, so the draft's own forward weighs
more there. So eval measures them instead of guessing. Per target type, one plain llama-server
run decodes every prompt (its answers are the context of later turns, replay.py); then one
speculative run per (draft type, draft length, p-min) decodes the same contexts. llama-server
takes these settings at start-up only, so each setting is a server of its own.

Lossless is llama.cpp's own: every speculative answer equals the plain answer of the SAME target
type token for token (a quantized target is held to itself, not to f32). The fastest lossless
setting (speculative tokens/s) is ``best``; the section's top-level fields are that setting's, in
the layout a single setting has always had, so readers of older results keep working, and
``sweep`` keeps every setting measured. ``tau_vs_f32`` is a setting's tau over the f32 target's
with the same draft settings: the acceptance a quantized target keeps.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from .llamacpp import LlamaCppError, Server, Tally, engine_files, plain_pass, spec_pass, task_summary, version


def gguf_type(path) -> str | None:
    """The weight type a GGUF file declares (``general.file_type``: f32, q8_0, q4_k_m ...), or None
    where the gguf package is missing or the file says none."""
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
        name = gguf.LlamaFileType(int(field.contents())).name
    except Exception:  # noqa: BLE001 - an unreadable header only costs the label
        return None
    return name.removeprefix("ALL_").removeprefix("MOSTLY_").lower()


def _given(path, taken: dict) -> str:
    """The label of a GGUF file given as it is: its type, else its name; never one already taken."""
    label = gguf_type(path) or Path(path).stem
    return label if label not in taken else f"{label} ({Path(path).name})"


def grid_files(grid, draft_dir, target: str, out_dir: Path, llama_cpp=None,
               log=print) -> tuple[dict[str, Path], dict[str, Path]]:
    """The target GGUFs and the draft GGUFs of ``grid`` (label -> file): each target type converted
    once by llama.cpp's converter and kept in the eagle3 cache (the file eval's plain llama.cpp
    baseline serves), each draft type exported into ``out_dir``, given files as they are."""
    from .llamacpp_baseline import cached_target_gguf

    targets: dict[str, Path] = {}
    for t in grid.target_types:
        if not Path(target).is_dir():
            raise LlamaCppError(f"--target-gguf FILE is needed: {target} is not a local HF folder to convert")
        targets[t] = cached_target_gguf(target, t, llama_cpp, log)  # logs the converter's run, if it runs
        log(f"llama.cpp: target {t}: {targets[t]}")
    if grid.target_gguf:
        targets[_given(grid.target_gguf, targets)] = Path(grid.target_gguf)
    drafts: dict[str, Path] = {}
    first = next(iter(targets.values()))  # the tokenizer a draft written without the converter copies
    for d in grid.draft_types:
        drafts[d] = engine_files(draft_dir, target, out_dir, target_gguf=first, llama_cpp=llama_cpp, outtype=d,
                                 log=log)[1]
    if grid.draft_gguf:
        drafts[_given(grid.draft_gguf, drafts)] = Path(grid.draft_gguf)
    for p in [*targets.values(), *drafts.values()]:
        if not Path(p).is_file():
            raise LlamaCppError(f"{p}: no such GGUF file")
    return targets, drafts


@dataclass
class _Servers:
    """The llama-server of one plain run or one setting, logging into ``log_dir``: one setting keeps
    the log names a single run has always had."""

    binary: Path
    threads: int | None
    threads_draft: int | None
    ctx: int
    log_dir: Path | None
    single: bool
    spec_type: str = "draft-eagle3"

    def _log(self, name: str) -> Path | None:
        return self.log_dir / f"llama-server-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.log" if self.log_dir else None

    def plain(self, t: str, model: Path) -> Server:
        return Server(self.binary, model, threads=self.threads, ctx=self.ctx,
                      log_path=self._log("plain" if self.single else f"plain-{t}"))

    def spec(self, t: str, model: Path, d: str, draft: Path, n: int, p: float) -> Server:
        return Server(self.binary, model, draft=draft, spec_type=self.spec_type, n_max=n, p_min=p,
                      threads=self.threads, threads_draft=self.threads_draft, ctx=self.ctx,
                      log_path=self._log("spec" if self.single else f"spec-{t}-{d}-n{n}-p{p:g}"))


def sweep(loaded, tokenizer, binary: Path, targets: dict[str, Path], drafts: dict[str, Path], n_max=(3,),
          p_min=(0.0,), *, max_new_tokens: int = 512, threads: int | None = None, threads_draft: int | None = None,
          ctx: int = 4096, warmup_tokens: int = 16, log_dir: Path | None = None, log=print, progress=None,
          spec_type: str = "draft-eagle3") -> dict:
    """Every setting of (target, draft, draft length, p-min) on the same prompts; the ``engine``
    section of results.json. ``loaded``: [(task, [Prompt])] as tasks.load_task returns;
    ``spec_type``: llama.cpp's ``--spec-type`` of the draft (draft-dflash for a DFlash draft)."""
    log_dir = Path(log_dir) if log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(targets, key=lambda t: t != "f32")  # f32 first: the others' tau is read against it
    rest = list(product(drafts, n_max, p_min))
    total = len(order) * len(rest)
    srv = _Servers(Path(binary), threads, threads_draft, ctx, log_dir, single=total == 1, spec_type=spec_type)
    if total > 1:
        answers = sum(len(p.turns) for _, ps in loaded for p in ps)
        log(f"llama.cpp sweep: {total} settings ({len(order)} targets x {len(drafts)} drafts x {len(n_max)} "
            f"chain lengths x {len(p_min)} p-min): {len(order) + total} llama-server runs of {answers} answers each")
    records: list[dict] = []
    clock = _Clock(len(order) + total)
    for t in order:
        log(f"llama.cpp: plain decoding ({binary})" if total == 1 else f"llama.cpp: plain decoding, target {t}")
        with srv.plain(t, targets[t]) as s:
            plain, replay = plain_pass(s, loaded, tokenizer, max_new_tokens, warmup_tokens, log, progress)
        clock.tick()
        if total > 1 and not records:
            log(f"llama.cpp sweep: about {clock.left_min():.1f} min for the other runs, if each takes as long as "
                f"this plain one ({clock.spent:.0f} s)")
        for d, n, p in rest:
            log(f"llama.cpp: speculative decoding, draft {drafts[d]}, chain of {n}, p-min {p}")
            with srv.spec(t, targets[t], d, drafts[d], n, p) as s:
                spec, mismatches, per_task, metrics = spec_pass(s, loaded, replay, max_new_tokens, warmup_tokens,
                                                                 log, progress)
            records.append(_record(t, targets[t], d, drafts[d], n, p, loaded, plain, spec, mismatches, per_task,
                                   metrics))
            _relative_tau(records)
            clock.tick()
            left = f" (about {clock.left_min():.1f} min left)" if total > 1 and clock.runs < clock.of else ""
            log(setting_line(len(records), total, records[-1]) + left)
    return _section(binary, records, best_setting(records), threads, threads_draft, max_new_tokens, spec_type)


class _Clock:
    """The time a sweep's runs took so far, and what the rest should take at that pace."""

    def __init__(self, of: int):
        self.of, self.runs, self.t0 = of, 0, time.monotonic()

    def tick(self):
        self.runs += 1

    @property
    def spent(self) -> float:
        return time.monotonic() - self.t0

    def left_min(self) -> float:
        return self.spent / max(self.runs, 1) * (self.of - self.runs) / 60


def _record(t, target_gguf, d, draft_gguf, n, p, loaded, plain, spec, mismatches, per_task, metrics) -> dict:
    """One setting of the sweep: its per-task rows (the layout of a single run's ``tasks``) and its
    totals over every task."""
    tasks = {task: task_summary(len(prompts), plain[task], spec[task], per_task.get(task) or {}, mismatches[task])
             for task, prompts in loaded}
    b, sp = Tally.total(plain.values()), Tally.total(spec.values())
    tps_b, tps_s = b.tokens_per_s(), sp.tokens_per_s()
    differ = sum(len(ids) for ids in mismatches.values())
    return {"target_type": t, "draft_type": d, "target_gguf": str(target_gguf), "draft_gguf": str(draft_gguf),
            "spec_draft_n_max": n, "spec_draft_p_min": p,
            "tokens_per_s": {"baseline": tps_b, "speculative": tps_s},
            "speedup": tps_s / tps_b if tps_b and tps_s else None,
            "tau": (sp.tokens - sp.answers) / sp.steps if sp.steps else None, "tau_vs_f32": None,
            "accepted": sp.accepted, "drafted": sp.drafted, "lossless": differ == 0, "prompts_differ": differ,
            "metrics": metrics, "tasks": tasks}


def _relative_tau(records: list[dict]) -> None:
    """``tau_vs_f32``: each setting's tau over the f32 target's with the same draft settings."""
    key = lambda r: (r["draft_type"], r["spec_draft_n_max"], r["spec_draft_p_min"])  # noqa: E731
    f32 = {key(r): r["tau"] for r in records if r["target_type"] == "f32"}
    for r in records:
        ref = f32.get(key(r))
        r["tau_vs_f32"] = r["tau"] / ref if ref and r["tau"] is not None else None


def best_setting(records: list[dict]) -> int | None:
    """The index of the fastest lossless setting (speculative tokens/s); None where none is lossless."""
    ok = [i for i, r in enumerate(records) if r["lossless"] and r["tokens_per_s"]["speculative"]]
    return max(ok, key=lambda i: records[i]["tokens_per_s"]["speculative"]) if ok else None


def setting_line(i: int, total: int, r: dict) -> str:
    """The progress line of one setting measured."""
    from .report import fmt

    tps = r["tokens_per_s"]
    rel = f" ({fmt(r['tau_vs_f32'])} of the f32 target's)" if r["tau_vs_f32"] and r["target_type"] != "f32" else ""
    return (f"llama.cpp setting {i}/{total}: target {r['target_type']}, draft {r['draft_type']}, chain "
            f"{r['spec_draft_n_max']}, p-min {r['spec_draft_p_min']:g}: {fmt(tps['speculative'], '.1f')} tok/s "
            f"against {fmt(tps['baseline'], '.1f')} plain ({fmt(r['speedup'])}x), tau {fmt(r['tau'])}{rel}, "
            + ("same output as plain" if r["lossless"] else f"NOT lossless ({r['prompts_differ']} prompts differ)"))


def _section(binary, records: list[dict], best: int | None, threads, threads_draft, max_new_tokens,
             spec_type: str = "draft-eagle3") -> dict:
    top = records[best if best is not None else 0]
    return {
        "name": "llama.cpp",
        "binary": str(binary),
        "version": version(Path(binary)),
        "target_gguf": top["target_gguf"],
        "draft_gguf": top["draft_gguf"],
        "settings": {"spec_type": spec_type, "spec_draft_n_max": top["spec_draft_n_max"],
                     "spec_draft_p_min": top["spec_draft_p_min"], "threads": threads, "threads_draft": threads_draft,
                     "temperature": 0.0, "max_new_tokens": max_new_tokens, "target_type": top["target_type"],
                     "draft_type": top["draft_type"]},
        "metrics": top["metrics"],
        "tasks": top["tasks"],
        "sweep": records,
        "best": best,
    }


def engine_table(section: dict):
    """The printed table of the engine section: one row per task for one setting (as it has always
    been), one row per setting for a sweep, the best marked."""
    from rich.table import Table

    from .llamacpp import engine_table as one_setting
    from .report import fmt

    records = section.get("sweep") or []
    if len(records) <= 1:
        return one_setting(section)
    s, best = section["settings"], section.get("best")
    t = Table(title=f"llama.cpp sweep: {len(records)} settings, {s['spec_type']}, threads {s['threads'] or 'default'} "
                    f"({section.get('version') or 'version unknown'})",
              caption=(f"best (fastest lossless): setting {best + 1}" if best is not None
                       else "[red]no setting was lossless[/]"))
    for col in ["#", "target", "draft", "chain", "p-min", "tau", "tau vs f32", "accepted/drafted",
                "plain tok/s", "spec tok/s", "speedup", "same output"]:
        t.add_column(col, justify="left" if col in ("target", "draft") else "right")
    for i, r in enumerate(records):
        tps = r["tokens_per_s"]
        t.add_row(f"{i + 1}" + (" *" if i == best else ""), r["target_type"], r["draft_type"],
                  str(r["spec_draft_n_max"]), f"{r['spec_draft_p_min']:g}", fmt(r["tau"]), fmt(r["tau_vs_f32"]),
                  f"{r['accepted']}/{r['drafted']}", fmt(tps["baseline"], ".1f"), fmt(tps["speculative"], ".1f"),
                  fmt(r["speedup"]) + "x" if r["speedup"] else "-",
                  "[green]yes[/]" if r["lossless"] else f"[red]NO ({r['prompts_differ']})[/]",
                  style="bold" if i == best else None)
    return t
