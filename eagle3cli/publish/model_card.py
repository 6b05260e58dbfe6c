"""The Hub model card of a draft: metadata, how to serve it, how well it does, how it was made.

The card is rendered by ``huggingface_hub.ModelCard.from_template`` from ``templates/model_card.md``
(shipped as package data ``eagle3cli.templates``). This module only gathers the values: the
draft's ``config.json`` (with its ``eagle3_training`` block, see export.METADATA_KEY) and zero or
more ``results.json`` files written by ``eagle3 eval``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..engines import engine_support
from .export import METADATA_KEY, options_from_json
from .gguf_export import OUTTYPES

TEMPLATE = "model_card.md"
LIBRARY_NAME = "eagle3"  # the library that trains, evaluates and loads these drafts
TAGS = ["eagle3", "eagle", "speculative-decoding"]
PAPER = "arXiv:2503.01840"


# ---------------------------------------------------------------- serving commands (docs/design.md §5)

def sglang_command(target: str, draft: str) -> str:
    return (f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 \\\n"
            f"  --speculative-draft-model-path {draft} --speculative-num-steps 3 \\\n"
            f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


def vllm_command(target: str, draft: str) -> str:
    spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 3}, separators=(",", ":"))
    return f"vllm serve {target} --speculative-config '{spec}'"


def _llamacpp_candidates(res) -> list[dict]:
    """The lossless llama.cpp settings of one results.json: a sweep's best (``engine.sweep``,
    ``engine.best``), or the one setting of an older file, lossless on every task."""
    eng = (res.get("engine") or {}) if isinstance(res, dict) else {}
    if eng.get("name") != "llama.cpp":
        return []
    base = {"hardware": res.get("hardware"), "settings": eng.get("settings") or {}}
    sweep, best = eng.get("sweep"), eng.get("best")
    if isinstance(sweep, list) and sweep:
        if not isinstance(best, int) or not 0 <= best < len(sweep) or not sweep[best].get("speedup"):
            return []
        r = sweep[best]
        return [{**base, "speedup": r["speedup"], "tokens_per_s": (r.get("tokens_per_s") or {}).get("speculative"),
                 "draft": Path(r["draft_gguf"]).name, "target_type": r.get("target_type"),
                 "draft_type": r.get("draft_type"), "tau": r.get("tau"), "settings_measured": len(sweep),
                 "settings": {**base["settings"], "spec_draft_n_max": r["spec_draft_n_max"],
                              "spec_draft_p_min": r["spec_draft_p_min"]}}]
    tasks = list((eng.get("tasks") or {}).values())
    if not tasks or not all(t.get("lossless") and t.get("speedup") for t in tasks):
        return []
    tps = [(t.get("tokens_per_s") or {}).get("speculative") for t in tasks]
    return [{**base, "speedup": sum(t["speedup"] for t in tasks) / len(tasks),
             "tokens_per_s": sum(tps) / len(tps) if all(tps) else None,
             "draft": Path(eng["draft_gguf"]).name if eng.get("draft_gguf") else None}]


def best_llamacpp(results) -> dict | None:
    """The fastest lossless llama.cpp setting among eval results (``eval --engine llama.cpp`` runs:
    a sweep's best, or one setting each in older files): {"settings", "speedup" (against plain
    llama-server on the same target; an older file's: mean over its tasks), "tokens_per_s",
    "draft" (GGUF file name), "hardware"}, and from a sweep "target_type", "draft_type", "tau",
    "settings_measured". Fastest is speculative tokens/s (else the speedup); None where no run was
    lossless."""
    cands = [c for res in results for c in _llamacpp_candidates(res)]
    return max(cands, key=lambda c: (c["tokens_per_s"] or 0.0, c["speedup"])) if cands else None


def llamacpp_command(repo: str, gguf_files=(), best: dict | None = None) -> str:
    """llama-server with the draft as a GGUF (the repo's draft-TYPE.gguf, or one made by eagle3 export-gguf),
    with the settings of ``best`` (``best_llamacpp``) where eval measured some (its target type too),
    and what they gave."""
    files = sorted(gguf_files)
    best = best or {}
    measured = best.get("draft") or (f"draft-{best['draft_type']}.gguf" if best.get("draft_type") else None)
    outtype = best.get("draft_type") if best.get("draft_type") in OUTTYPES else "f32"  # what export-gguf writes
    name = measured if measured in files else files[0] if files else f"draft-{outtype}.gguf"
    get = (f"hf download {repo} {name} --local-dir .\n" if gguf_files else
           f"hf download {repo} --local-dir draft && eagle3 export-gguf draft --model TARGET_DIR "
           "--llama-cpp LLAMA_CPP_DIR" + (f" --outtype {outtype}" if outtype != "f32" else "") + " -o .\n")
    s = best.get("settings") or {}
    p_min = s.get("spec_draft_p_min") or 0
    target = f"TARGET-{best['target_type']}.gguf" if best.get("target_type") else "TARGET.gguf"
    cmd = (get + f"llama-server -m {target} -md {name} --spec-type draft-eagle3 --spec-draft-n-max "
           f"{s.get('spec_draft_n_max') or 3}" + (f" --spec-draft-p-min {p_min:g}" if p_min else ""))
    if best and best.get("target_type"):
        n = best.get("settings_measured", 1)
        cmd += (f"\n# {f'the fastest lossless of the {n} settings' if n > 1 else 'the setting'} eagle3 eval --engine "
                f"llama.cpp measured: target {best['target_type']}, draft {best.get('draft_type')}, "
                + (f"{best['tokens_per_s']:.1f} tokens/s, " if best.get("tokens_per_s") else "")
                + f"{best['speedup']:.2f}x plain llama-server on the same target"
                + (f", tau {best['tau']:.2f}" if best.get("tau") else "")
                + (f" ({best['hardware']})" if best.get("hardware") else ""))
        if best["speedup"] < 1:
            cmd += "\n# slower than the target alone there: serve it without the draft on such a machine"
        if measured and measured != name:
            cmd += f"\n# measured with {measured}, which this repo does not hold"
    elif best:
        cmd += (f"\n# the fastest lossless setting eagle3 eval --engine llama.cpp measured: {best['speedup']:.2f}x "
                f"plain llama-server" + (f" ({best['hardware']})" if best.get("hardware") else ""))
    return cmd


def architecture_label(config: dict) -> str:
    """'EAGLE-3' or 'EAGLE-3.1', plus the architecture options that are on (docs/design.md §3)."""
    opts = [k for k, v in options_from_json(config).items() if v]
    name = "EAGLE-3.1" if {"fc_norm", "norm_output"} <= set(opts) else "EAGLE-3"
    return name + (f" ({', '.join(f'`{o}`' for o in opts)})" if opts else "")


def serving_notes(config: dict, target_config=None) -> list[str]:
    """Which engine would refuse or misserve this draft: its options, and (given the target's
    config) the target's model class (engine_support, versions named)."""
    notes = []
    for engine, missing in engine_support.unsupported_options(options_from_json(config)).items():
        if missing:
            notes.append(f"{engine} does not implement {', '.join(f'`{m}`' for m in missing)}: do not serve this "
                         f"draft with it.")
    if target_config is not None:
        notes += [why + "." for ok, why in engine_support.target_support(target_config).values() if ok is False]
    else:
        refused = {e: sorted(a for a, ok in t.items() if not ok) for e, t in engine_support.TARGETS.items()}
        notes.append("Targets the engines refuse for EAGLE-3: " + "; ".join(
            f"{e}: {', '.join(f'`{a}`' for a in archs)}" for e, archs in refused.items()) + ".")
    return notes


# ---------------------------------------------------------------- eval results (eagle3 eval's results.json)

def load_results(path: str | Path) -> dict:
    """Read and sanity-check one results.json; ValueError with a one-line reason otherwise."""
    p = Path(path)
    try:
        res = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"eval results {p}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"eval results {p}: not valid JSON ({e})") from None
    tasks = res.get("tasks") if isinstance(res, dict) else None
    engine_tasks = ((res.get("engine") or {}).get("tasks") if isinstance(res, dict) else None) or {}
    if not isinstance(tasks, dict) or not (tasks or engine_tasks):
        raise ValueError(f"eval results {p}: no 'tasks' (expected the results.json written by `eagle3 eval`)")
    for name, t in tasks.items():
        # tau is null when a task produced no decode steps; the card then shows a dash
        if not isinstance(t, dict) or "tau" not in t or not isinstance(t["tau"], (int, float, type(None))):
            raise ValueError(f"eval results {p}: task {name!r} has no 'tau' (number or null)")
    return res


def _num(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "—"


def _settings(s: dict) -> str:
    parts = []
    mode = s.get("mode")
    if mode == "tree":
        parts.append(f"tree: depth {s.get('depth')}, top-k {s.get('top_k')}, {s.get('total_tokens')} tokens")
    elif mode == "chain":
        parts.append(f"chain: {s.get('steps')} steps")
    elif mode:
        parts.append(str(mode))
    if s.get("tree_auto"):
        parts[-1] += " (auto-tuned)"
    if s.get("temperature") is not None:
        parts.append(f"temperature {s['temperature']}")
        if s["temperature"] > 0 and s.get("top_p") not in (None, 1.0):
            parts.append(f"top-p {s['top_p']}")
    if s.get("max_new_tokens") is not None:
        parts.append(f"{s['max_new_tokens']} new tokens")
    return ", ".join(parts) or "—"


def _lossless(task: dict, sampled: bool) -> str:
    if task.get("lossless") is True:
        return "yes"
    if task.get("lossless") is False:
        return f"no ({len(task.get('mismatches') or [])} prompts differ)"
    return "n/a (T>0)" if sampled else "—"  # sampled output is checked in distribution, not token by token


def eval_rows(results: list[dict]) -> list[dict]:
    """One table row per (results file, task), already formatted for the card."""
    rows = []
    for res in results:
        settings = _settings(res.get("settings") or {})
        sampled = ((res.get("settings") or {}).get("temperature") or 0) > 0
        hardware = str(res.get("hardware") or "—").replace("|", "/")
        for task, t in res["tasks"].items():
            tps = t.get("tokens_per_s") or {}
            rows.append({
                "task": task,
                "num_prompts": t.get("num_prompts", "—"),
                "tau": _num(t.get("tau"), ".2f"),
                "speedup": _num(t.get("speedup"), ".2f") + ("×" if isinstance(t.get("speedup"), (int, float)) else ""),
                "tokens_per_s": f"{_num(tps.get('baseline'), '.1f')} → {_num(tps.get('speculative'), '.1f')}",
                "n_alpha": " ".join(_num(a, ".2f") for a in t["n_alpha"]) if t.get("n_alpha") else "—",
                "lossless": _lossless(t, sampled),
                "hardware": hardware,
                "settings": settings,
            })
        eng = res.get("engine") or {}
        for task, t in (eng.get("tasks") or {}).items():  # the same draft measured in a serving engine
            tps = t.get("tokens_per_s") or {}
            es = eng.get("settings") or {}
            rows.append({
                "task": f"{task} ({eng.get('name', 'engine')})",
                "num_prompts": t.get("num_prompts", "—"),
                "tau": _num(t.get("tau"), ".2f"),
                "speedup": _num(t.get("speedup"), ".2f") + ("×" if isinstance(t.get("speedup"), (int, float)) else ""),
                "tokens_per_s": f"{_num(tps.get('baseline'), '.1f')} → {_num(tps.get('speculative'), '.1f')}",
                "n_alpha": "—",
                "lossless": "yes" if t.get("lossless") is True else
                            (f"no ({len(t.get('mismatches') or [])} prompts differ)" if t.get("lossless") is False
                             else "—"),
                "hardware": hardware,
                "settings": f"{eng.get('name', 'engine')} {es.get('spec_type', '')}, "
                            f"chain {es.get('spec_draft_n_max')}, "
                            f"threads {es.get('threads') or 'default'}",
            })
    return rows


# ---------------------------------------------------------------- facts and training record

def _ids(xs) -> str:
    return ", ".join(str(x) for x in xs)


def facts(config: dict, target: str | None) -> list[tuple[str, str]]:
    meta = config.get(METADATA_KEY) or {}
    j = list(config.get("eagle_aux_hidden_state_layer_ids") or [])
    k = list((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [j_ - 1 for j_ in j])
    v, dv = config.get("vocab_size"), config.get("draft_vocab_size") or config.get("vocab_size")
    rows = [("Target", f"`{target}`" if target else "not recorded"), ("Draft architecture", architecture_label(config))]
    if meta.get("target_revision"):
        rows.append(("Target revision", f"`{meta['target_revision']}`"))
    rows += [
        ("Target layers read (j: input of decoder layer j; vLLM's `eagle_aux_hidden_state_layer_ids`)", _ids(j)),
        ("Same layers as k = j − 1 (output of layer k; SGLang's `eagle_config`)", _ids(k)),
        ("Draft vocabulary", f"{dv:,} of the target's {v:,} tokens" if isinstance(dv, int) and isinstance(v, int)
         else str(dv)),
        ("Hidden size", str(config.get("hidden_size"))
         + (f" (target {config['target_hidden_size']})" if config.get("target_hidden_size") else "")),
        ("Max positions",
         f"{config.get('max_position_embeddings'):,}" if config.get("max_position_embeddings") else "—"),
        ("Weights", f"`model.safetensors`, {config.get('torch_dtype') or config.get('dtype') or '?'}"),
    ]
    return rows


def training_rows(meta: dict) -> list[tuple[str, str]]:
    """The training record as (label, value) rows; keys that are absent are left out."""
    if not meta:
        return []
    rows = []

    def add(label, key, fmt=str):
        if meta.get(key) is not None:
            rows.append((label, fmt(meta[key])))

    data = meta.get("data")
    if data is not None:
        rows.append(("Data", json.dumps(data) if isinstance(data, (dict, list)) else str(data)))
    if meta.get("datasets"):
        rows.append(("Datasets", ", ".join(f"[{d}](https://huggingface.co/datasets/{d})" for d in meta["datasets"])))
    add("Samples", "num_samples", lambda x: f"{x:,}")
    add("Tokens", "num_tokens", lambda x: f"{x:,}")
    add("Steps", "steps", lambda x: f"{x:,}")
    add("Epochs", "epochs")
    if meta.get("ttt_steps") is not None:
        decay = f", step decay {meta['step_decay']}" if meta.get("step_decay") is not None else ""
        rows.append(("Training-time-test steps", f"{meta['ttt_steps']}{decay}"))
    add("Learning rate", "lr", lambda x: f"{x:g}" if isinstance(x, (int, float)) else str(x))
    add("Recipe", "recipe")
    add("Vocabulary coverage of training tokens", "vocab_coverage",
        lambda x: f"{100 * x:.2f}%" if isinstance(x, (int, float)) else str(x))
    add("Target features", "mode", lambda x: {"offline": "offline (precomputed)", "online": "online"}.get(x, x))
    add("Loss scored on", "loss_on", lambda x: {"answers": "the assistant's tokens",
                                                "all": "every token (prompts too)"}.get(x, x))
    if meta.get("accept_loss"):
        rows.append(("Loss", f"{1 - meta['accept_loss']:g} soft cross-entropy + {meta['accept_loss']:g} acceptance "
                             "(-log sum min(p, q))"))
    if meta.get("feature_noise"):
        rows.append(("Feature noise", f"{meta['feature_noise']:g} x each stream's RMS"))
    if meta.get("ttt_warmup"):
        rows.append(("TTT curriculum", f"one step for the first {meta['ttt_warmup']} optimizer steps"))
    add("Training compute", "mixed_precision", lambda x: {"bf16": "bf16 autocast", "no": "fp32"}.get(x, x))
    metrics = meta.get("metrics") or {}
    where = " (held-out)" if metrics.get("split") == "held-out" else ""
    if metrics.get("acc"):
        rows.append((f"Final top-1 agreement per TTT step{where}", ", ".join(_num(a, ".3f") for a in metrics["acc"])))
    if isinstance(metrics.get("tau_sim"), (int, float)):
        rows.append((f"Acceptance length simulated from those{where}", f"{metrics['tau_sim']:.2f}"))
    add("Note", "note")
    add("Chat template (sha256)", "chat_template_hash", lambda x: f"`{str(x)[:16]}…`")
    add("eagle3 version", "eagle3_version")
    add("Created", "created")
    return [(label, str(value).replace("|", "/").replace("\n", " ")) for label, value in rows]


# ---------------------------------------------------------------- the card

def template_text(name: str = TEMPLATE) -> str:
    try:
        return resources.files("eagle3cli.templates").joinpath(name).read_text(encoding="utf-8")
    except ModuleNotFoundError:
        # A source checkout used without `pip install`: templates/ sits beside the package.
        return (Path(__file__).resolve().parents[2] / "templates" / name).read_text(encoding="utf-8")


def render_card(config: dict, repo_id: str, target: str | None, results: list[dict] = (),
                license: str | None = None, gguf_files=(), target_config=None):
    """The ModelCard (huggingface_hub) for a draft published as ``repo_id`` (a DFlash draft's through
    ``dflash_card``: each engine's own count of its block)."""
    from huggingface_hub import ModelCard, ModelCardData

    from .dflash_layout import is_dflash

    meta = config.get(METADATA_KEY) or {}
    if is_dflash(config):
        return _render_dflash(config, repo_id, target, results, license, gguf_files)
    license = license or meta.get("target_license") or meta.get("license")
    data = ModelCardData(
        base_model=target,
        library_name=LIBRARY_NAME,
        tags=list(TAGS),
        license=license.lower() if license else None,
        datasets=list(meta["datasets"]) if meta.get("datasets") else None,
    )
    return ModelCard.from_template(
        data,
        template_str=template_text(),
        model_name=repo_id.split("/")[-1],
        target=target,
        target_revision=meta.get("target_revision"),
        facts=facts(config, target),
        sglang_command=sglang_command(target or "TARGET", repo_id),
        vllm_command=vllm_command(target or "TARGET", repo_id),
        llamacpp_command=llamacpp_command(repo_id, gguf_files, best_llamacpp(list(results))),
        serving_notes=serving_notes(config, target_config),
        eval_rows=eval_rows(list(results)),
        training=training_rows(meta),
    )


def _render_dflash(config: dict, repo_id: str, target: str | None, results, license, gguf_files):
    from huggingface_hub import ModelCard, ModelCardData

    from . import dflash_card

    v = dflash_card.card_values(config, repo_id, target, gguf_files)
    meta = v.pop("meta")
    license = license or meta.get("target_license") or meta.get("license")
    data = ModelCardData(base_model=target, library_name=LIBRARY_NAME, tags=list(dflash_card.TAGS),
                         license=license.lower() if license else None,
                         datasets=list(meta["datasets"]) if meta.get("datasets") else None)
    return ModelCard.from_template(
        data, template_str=template_text(dflash_card.TEMPLATE), model_name=repo_id.split("/")[-1], target=target,
        target_revision=meta.get("target_revision"), eval_rows=eval_rows(list(results)),
        training=dflash_card.training_rows(meta, training_rows(meta)), **v)
