"""`eagle3 gen-data`: chat prompts -> the target's own answers -> masks -> features on disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from . import common


def gen_data(
    model: str = common.Model,
    data: str = typer.Option(..., "--data", "-d", help="Hub dataset id, a preset (sharegpt, ultrachat, gsm8k, alpaca, "
                             "openhermes, ...) or a local .json/.jsonl/.parquet file."),
    out: Path = typer.Option(Path("eagle3-data"), "--out", "-o", help="Output folder (the feature store)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="Force the row format: sharegpt|messages|alpaca|turns|"
                                      "prompt (default: detected)."),
    split: Optional[str] = typer.Option(None, "--split", help="Dataset split (Hub sources)."),
    subset: Optional[str] = typer.Option(None, "--subset", help="Dataset config/subset (Hub sources)."),
    streaming: bool = typer.Option(False, "--streaming", help="Stream a Hub dataset instead of downloading it."),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", "-n", help="Use at most this many conversations."),
    shuffle: bool = typer.Option(False, "--shuffle", help="Shuffle conversations (with --seed) before --max-samples."),
    seed: int = typer.Option(0, "--seed", help="Seed for shuffling and sampled generation."),
    regenerate: bool = typer.Option(True, "--regenerate/--no-regenerate", help="Answer the prompts with the target "
                                    "(default) or keep the dataset's own answers."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="OpenAI-compatible server serving the target "
                                           "(e.g. http://localhost:8000/v1) to regenerate with."),
    endpoint_model: Optional[str] = typer.Option(None, "--endpoint-model", help="Model name on the server "
                                                 "(default: the first one it lists)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Key for --endpoint."),
    concurrency: int = typer.Option(16, "--concurrency", help="Conversations in flight at once with --endpoint."),
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts per local generation batch."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Longest regenerated answer (tokens)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (with --temperature > 0)."),
    system: Optional[str] = typer.Option(None, "--system", help="Set this system prompt on every conversation "
                                         "(\"\" removes them)."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template", help="Jinja chat template file, for "
                                                 "tokenizers without one (or to override it)."),
    features: str = typer.Option("offline", "--features", help="offline: store target features; none: tokens "
                                 "and masks only (online training)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Override the three layer ids j (hidden_states[j]), "
                                         "e.g. 2,15,27."),
    max_length: int = typer.Option(2048, "--max-length", help="Truncate conversations to this many tokens (counted)."),
    shard_size: int = typer.Option(128, "--shard-size", help="Conversations per shard file."),
    shard: Optional[str] = typer.Option(None, "--shard", help="Process only part i of n (e.g. 0/4), for manual "
                                        "multi-node splits; accelerate launch splits by rank by itself."),
    feature_dtype: str = typer.Option("bfloat16", "--feature-dtype", help="bfloat16|float16 for stored features."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output instead of refusing."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Load and check the data, print the disk estimate, write "
                                 "nothing."),
    strict: bool = typer.Option(False, "--strict", help="Fail on the first bad row instead of skipping it."),
    show_mask: int = typer.Option(0, "--show-mask", help="Print N samples with the learned tokens highlighted."),
    skip_disk_check: bool = typer.Option(False, "--skip-disk-check", help="Run even when the disk estimate "
                                         "exceeds the free space (the estimate is an upper bound with "
                                         "regeneration)."),
    engine: str = typer.Option("hf", "--engine", help="What captures the features: hf (a forward in this process) "
                               "or vllm (vLLM's extract_hidden_states, run by --vllm-python; docs/data.md)."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", envvar="EAGLE3_VLLM_PYTHON", help="Python of "
                                              "the environment with vLLM (default: this one)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="--engine vllm: vLLM's tensor "
                                             "parallelism."),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", help="--engine vllm: vLLM's pipeline "
                                               "parallelism."),
    vllm_kv_cache_gib: Optional[float] = typer.Option(None, "--vllm-kv-cache-gib", help="--engine vllm: explicit KV "
                                                      "cache size (vLLM's kv_cache_memory_bytes)."),
    vllm_args: Optional[str] = typer.Option(None, "--vllm-args", help="--engine vllm: more vllm.LLM keyword "
                                            "arguments as JSON, e.g. '{\"gpu_memory_utilization\": 0.8}'."),
    revision: Optional[str] = common.Revision,
    dtype: str = common.Dtype,
    device: Optional[str] = common.Device,
    load_in_8bit: bool = common.Load8,
    load_in_4bit: bool = common.Load4,
    adapter: Optional[str] = common.Adapter,
    trust_remote_code: bool = common.TrustRemoteCode,
):
    """Build training data: the target answers chat prompts, masks cover its answers, features go to disk."""
    from ..gen_data import GenDataError, GenDataOptions, human_bytes, run
    from ..layers import parse_layer_ids

    try:
        layer_ids = parse_layer_ids(layers)
    except ValueError as e:
        common.fail(str(e))
    extra_vllm = None
    if vllm_args:
        import json

        try:
            extra_vllm = json.loads(vllm_args)
        except ValueError as e:
            common.fail(f"--vllm-args is not JSON ({e})")
        if not isinstance(extra_vllm, dict):
            common.fail("--vllm-args must be a JSON object of vllm.LLM keyword arguments")
    spec = common.target_spec(model, revision, dtype, device, load_in_8bit, load_in_4bit, adapter, trust_remote_code)
    opts = GenDataOptions(
        out=out, data=data, format=fmt, split=split, subset=subset, streaming=streaming, max_samples=max_samples,
        shuffle=shuffle, seed=seed, regenerate=regenerate, endpoint=endpoint, endpoint_model=endpoint_model,
        api_key=api_key or os.environ.get("EAGLE3_API_KEY"), concurrency=concurrency, batch_size=batch_size,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, system=system,
        chat_template=str(chat_template) if chat_template else None, features=features, layers=layer_ids,
        max_length=max_length, shard_size=shard_size, shard=shard, feature_dtype=feature_dtype, overwrite=overwrite,
        dry_run=dry_run, strict=strict, show_mask=show_mask, skip_disk_check=skip_disk_check,
        engine=engine, vllm_python=vllm_python, tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size, vllm_kv_cache_gib=vllm_kv_cache_gib, vllm_args=extra_vllm,
    )
    try:
        man = run(opts, spec, common.console)
    except GenDataError as e:
        common.fail(str(e))
    except KeyboardInterrupt:
        from ..errors import Interrupted

        raise Interrupted(f"interrupted: finished shards in {out} are kept; run the same command again "
                          "to resume") from None
    if man is None:
        return
    state = "complete" if man["complete"] else f"{man['shards_done']}/{man['shards_planned']} shards (other ranks pending)"
    common.console.print(
        f"[green]wrote[/] {out}: {man['num_samples']} samples, {man['num_tokens']:,} tokens "
        f"({man['num_masked_tokens']:,} learned), {human_bytes(man['bytes'])}, {man['truncated']} truncated, "
        f"skipped {sum(man['skipped'].values())}; {state}", highlight=False)
