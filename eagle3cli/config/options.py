"""The options of the commands that load a target: one dataclass field per CLI flag.

A field made with :func:`option` carries its flag's help text (and, where it has one, a short
alias, an environment variable, a metavar, the type the command line gives and the parser that
turns it into the field's type); ``commands/common.py`` builds a command's typer flags from
those fields, so an option is spelled out once, here, and the library and the CLI cannot drift.

:class:`TargetOptions` holds the eight options that say how to load the target. Every command
that loads one shares them: ``TargetSpec`` (target.py), ``TrainConfig`` (train_config.py),
:class:`GenDataOptions` and :class:`EvalOptions` are its subclasses, so the target's flags come
first in each command and read the same everywhere.

This module imports neither torch nor transformers (the CLI builds its flags from it), and no
pipeline module: they import it (target.py, train_config.py, gen_data.py), not the other way.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..core.errors import OptionError, check_out_dir

REQUIRED = dataclasses.MISSING  # option(REQUIRED, ...): a field, and flag, without a default


def option(default: Any, help: str, *, short: str | None = None, envvar: str | list[str] | None = None,
           metavar: str | None = None, cli_type: type | None = None,
           parse: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field that is also a CLI flag ``--name-with-dashes``.

    ``cli_type`` is what the command line gives when it is not the field's type, and ``parse``
    turns it into the field's value (``--layers 2,15,27`` -> ``(2, 15, 27)``).
    """
    meta = {"help": help, "short": short, "envvar": envvar, "metavar": metavar, "cli_type": cli_type,
            "parse": parse}
    if isinstance(default, list):  # a mutable default needs a factory
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def internal(default: Any) -> Any:
    """A field the library reads but no flag sets."""
    return dataclasses.field(default=default, metadata={"cli": False})


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags, in declaration order (inherited ones first)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def from_flags(cls, values: dict):
    """An instance of ``cls`` from the values the CLI parsed, each passed through its parser."""
    kw = {}
    for f in flag_fields(cls):
        value = values[f.name]
        parse = f.metadata.get("parse")
        kw[f.name] = parse(value) if parse is not None and value is not None else value
    return cls(**kw)


# ---------------------------------------------------------------------------------- the target


@dataclass
class TargetOptions:
    """How to load the target model: the options every command that loads one shares."""

    model: str | None = option(None, "Target model: a Hub id or a local folder.", short="-m")
    revision: str | None = option(None, "Hub revision (branch, tag or commit) of the target.")
    dtype: str = option("auto", "auto|bfloat16|float16|float32 (auto: bf16 on GPU, fp32 on CPU; for eval's greedy "
                                "fast path bf16 on a CPU with AMX, checked exact at start-up).")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available; under accelerate "
                                      "launch, each process's own).")
    load_in_8bit: bool = option(False, "Load the target 8-bit with bitsandbytes.")
    load_in_4bit: bool = option(False, "Load the target 4-bit with bitsandbytes.")
    adapter: str | None = option(None, "A PEFT adapter (folder or Hub id) applied on top of the target.")
    trust_remote_code: bool = option(False, "Run the model repo's own code (off by default).")


TARGET_FIELDS = tuple(f.name for f in dataclasses.fields(TargetOptions))


def target_options(opts: TargetOptions) -> dict:
    """The target-loading fields of ``opts`` (any TargetOptions subclass) as keyword arguments."""
    return {name: getattr(opts, name) for name in TARGET_FIELDS}


# ---------------------------------------------------------------------------------- gen-data


def parse_layer_ids(text: str | None) -> tuple[int, ...] | None:
    """Parse a ``--layers 2,15,27`` override (None or empty -> None)."""
    if text is None or not str(text).strip():
        return None
    try:
        return tuple(int(x) for x in str(text).replace(" ", "").split(","))
    except ValueError:
        raise OptionError(f"--layers must be three comma-separated integers, got {text!r}") from None


def _layer_ids(text: str):
    return parse_layer_ids(text)


def json_object(text: str) -> dict | None:
    """``--vllm-args`` JSON -> the vllm.LLM keyword arguments it holds (none for an empty flag)."""
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise OptionError(f"--vllm-args is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise OptionError("--vllm-args must be a JSON object of vllm.LLM keyword arguments")
    return value


@dataclass(kw_only=True)
class GenDataOptions(TargetOptions):
    """``eagle3 gen-data``'s settings (gen_data.run takes the target as a separate TargetSpec)."""

    data: str = option(REQUIRED, "Hub dataset id, a preset (sharegpt, ultrachat, gsm8k, alpaca, openhermes, ...) "
                                 "or a local .json/.jsonl/.parquet file.", short="-d")
    out: Path = option(Path("eagle3-data"), "Output folder (the feature store).", short="-o")
    format: str | None = option(None, "Force the row format: sharegpt|messages|alpaca|turns|prompt "
                                      "(default: detected).")
    split: str | None = option(None, "Dataset split (Hub sources).")
    subset: str | None = option(None, "Dataset config/subset (Hub sources).")
    streaming: bool = option(False, "Stream a Hub dataset instead of downloading it.")
    max_samples: int | None = option(None, "Use at most this many conversations.", short="-n")
    shuffle: bool = option(False, "Shuffle conversations (with --seed) before --max-samples.")
    seed: int = option(0, "Seed for shuffling and sampled generation.")
    regenerate: bool = option(True, "Answer the prompts with the target (default) or keep the dataset's own "
                                    "answers.")
    endpoint: str | None = option(None, "OpenAI-compatible server serving the target "
                                        "(e.g. http://localhost:8000/v1) to regenerate with.")
    endpoint_model: str | None = option(None, "Model name on the server (default: the first one it lists).")
    api_key: str | None = option(None, "Key for --endpoint.", envvar=["OPENAI_API_KEY", "EAGLE3_API_KEY"])
    concurrency: int = option(16, "Conversations in flight at once with --endpoint.")
    batch_size: int = option(16, "Prompts per local generation batch.")
    max_new_tokens: int = option(512, "Longest regenerated answer (tokens).")
    temperature: float = option(0.0, "0 = greedy.")
    top_p: float = option(1.0, "Nucleus sampling (with --temperature > 0).")
    regen_dtype: str = option("auto", "auto|bfloat16|float16|float32: what local regeneration computes in (auto: "
                                      "bfloat16 for an fp32 target on a CPU with AVX512-BF16 or AMX, 1.3-1.8x faster there; else "
                                      "--dtype's). Features are captured at --dtype.")
    system: str | None = option(None, "Set this system prompt on every conversation (\"\" removes them).")
    reasoning: str | None = option(None, "keep|drop: a reasoning target's conversations. The target regenerates with "
                                         "thinking on (enable_thinking=True to the template); keep: every turn's "
                                         "thinking is learned, one sample per turn in the context it was written "
                                         "in; drop: one sample as the template renders it, earlier turns' thinking "
                                         "dropped from history. Default: the template's own default.")
    last_turn_only: bool = option(False, "Learn only the last assistant turn of each conversation (earlier turns are "
                                         "context).")
    chat_template: str | None = option(None, "Jinja chat template file, for tokenizers without one (or to "
                                             "override it).", cli_type=Path, parse=str)
    features: str = option("offline", "offline: store target features; none: tokens and masks only (online "
                                      "training).")
    layers: tuple[int, ...] | None = option(None, "Override the three layer ids j (hidden_states[j]), e.g. "
                                                  "2,15,27.", cli_type=str, parse=_layer_ids)
    max_length: int = option(2048, "Truncate conversations to this many tokens (counted).")
    shard_size: int = option(128, "Conversations per shard file.")
    max_minutes: float | None = option(None, "Stop starting shards that would not finish within this many minutes "
                                             "of the start (judged by the shards done): the store keeps every "
                                             "finished shard and stays incomplete; rerun to finish it, or train on "
                                             "it with --allow-incomplete.")
    shard: str | None = option(None, "Process only part i of n (e.g. 0/4), for manual multi-node splits; "
                                     "accelerate launch splits by rank by itself.")
    feature_dtype: str = option("bfloat16", "bfloat16|float16 for stored features.")
    overwrite: bool = option(False, "Replace an existing output instead of refusing.")
    dry_run: bool = option(False, "Load and check the data, print the disk estimate, write nothing.")
    strict: bool = option(False, "Fail on the first bad row instead of skipping it.")
    show_mask: int = option(0, "Print N samples with the learned tokens highlighted.")
    skip_disk_check: bool = option(False, "Run even when the disk estimate exceeds the free space (the estimate "
                                          "is an upper bound with regeneration).")
    engine: str = option("hf", "What captures the features: hf (a forward in this process) or vllm (vLLM's "
                               "extract_hidden_states, run by --vllm-python; docs/data.md).")
    vllm_python: str | None = option(None, "Python of the environment with vLLM (default: this one).",
                                     envvar="EAGLE3_VLLM_PYTHON")
    tensor_parallel_size: int = option(1, "--engine vllm: vLLM's tensor parallelism.")
    pipeline_parallel_size: int = option(1, "--engine vllm: vLLM's pipeline parallelism.")
    vllm_kv_cache_gib: float | None = option(None, "--engine vllm: explicit KV cache size (vLLM's "
                                                   "kv_cache_memory_bytes).")
    vllm_args: dict | None = option(None, "--engine vllm: more vllm.LLM keyword arguments as JSON, e.g. "
                                          "'{\"gpu_memory_utilization\": 0.8}'.", cli_type=str, parse=json_object)
    capture_tokens: int = internal(16384)  # padded tokens per capture forward
    # Probe one thread against all between shards (core.threads), for runs on cores other jobs
    # share (the quickstart); off by default: a changed thread count can move a near-tie of the
    # regenerated answers, and a resumed store is otherwise bit-identical to an uninterrupted one.
    adapt_threads: bool = internal(False)


# ---------------------------------------------------------------------------------- eval

EVAL_ENGINES = ("eagle3", "llama.cpp", "vllm")
AUTO_TREE = (60, 8, 10)  # what --tree auto starts from before it measures (evaluate.choose_tree)
# A CPU verifies a big tree too slowly to gain from it, and how small a tree pays there depends on
# the draft and the CPU. With one SmolLM2 draft on mt_bench, a fixed 12,4,4 tree ran at 0.76x
# plain and the measured tree (2 nodes, depth 1) at 0.98x on 2 Xeon cores.
GPU_TREE, CPU_TREE = "60,8,10", "auto"


def parse_tree(text: str) -> tuple[bool, int, int, int]:
    """``auto`` or ``TOTAL,DEPTH[,TOPK]`` -> (auto, total_tokens, depth, top_k)."""
    if text.strip().lower() == "auto":
        return (True, *AUTO_TREE)
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise OptionError(f"--tree must be 'auto' or TOTAL,DEPTH[,TOPK] with positive integers, got {text!r}")
    return False, parts[0], parts[1], parts[2] if len(parts) == 3 else 10


@dataclass(kw_only=True)
class EvalOptions(TargetOptions):
    """``eagle3 eval``'s flags; :meth:`validate` refuses what cannot run, and
    ``evaluate.EvalConfig.from_options`` turns them into the library's settings."""

    draft: str = option(REQUIRED, "Draft directory (config.json + model.safetensors).", short="-d")
    task: list[str] = option(["mt_bench"], "mt_bench, gsm8k, humaneval, alpaca, sum, or a .jsonl turns file; "
                                           "repeatable.", short="-t")
    data: str | None = option(None, "Local turns file (JSONL with 'turns') for the task.")
    out: Path = option(Path("eval_out"), "Folder for results.json and results.png.", short="-o")
    limit: int | None = option(None, "Evaluate only the first N prompts of each task.")
    max_minutes: float | None = option(None, "Start no prompt that would end past this many minutes from the "
                                             "start (judged by the prompts measured; at least one is): the "
                                             "results cover the prompts done and say where they stopped.")
    max_new_tokens: int = option(512, "")
    temperature: float = option(0.0, "0 = greedy (checked token for token).")
    top_p: float = option(1.0, "")
    sampling_top_k: int = option(0, "Top-k filter of the sampling distribution (0 = off).")
    mode: str = option("tree", "tree (EAGLE-2 dynamic tree) or chain.")
    tree: str | None = option(None, f"auto (measured on this hardware) or TOTAL,DEPTH[,TOPK]; default "
                                    f"{GPU_TREE} on a GPU, {CPU_TREE} on a CPU.")
    steps: int = option(3, "Chain mode: drafted tokens per cycle.")
    baseline: str | None = option(None, "prompt-lookup: add HF prompt-lookup decoding.")
    seed: int = option(0, "")
    fast: str = option("auto", "auto|on|off: verify through the fast path (static cache, packed matmuls; "
                               "Llama/Mistral/Qwen2/Qwen3, greedy) where it applies, and measure plain decoding on "
                               "it too; speedup is against the faster plain decoding.")
    draft_weights: str = option("auto", "auto|full|int8|int4: store the drafter's matmul weights as integers "
                                        "(CPU weight-only kernels; only proposals change, decoding stays lossless). "
                                        "auto: int4 where the draft steps in bf16 beside a bf16 target, else full (with fp32 "
                                        "inputs the integer kernels are slower than full weights).")
    engine: str = option("eagle3", "eagle3 (our generator), llama.cpp or vllm: also measure the draft in "
                                   "llama-server or vLLM (chain of --steps, greedy), beside our numbers.")
    engine_only: bool = option(False, "With --engine llama.cpp|vllm: skip our generator.")
    llama_cpp: Path | None = option(None, "Where llama-server is (or a llama.cpp tree with build/bin); default: "
                                          "$EAGLE3_LLAMA_CPP, then PATH.", metavar="DIR")
    target_gguf: Path | None = option(None, "The target as GGUF (default: converted from --model into OUT/gguf).",
                                      metavar="FILE")
    draft_gguf: Path | None = option(None, "The draft as GGUF (default: exported into OUT/gguf).", metavar="FILE")
    engine_threads: int | None = option(None, "llama.cpp -t, vLLM's OMP_NUM_THREADS (default: their own).")
    engine_p_min: float = option(0.0, "llama.cpp --spec-draft-p-min (0: always draft --steps tokens, as chain "
                                      "mode).")
    # --engine vllm (eagle3cli/evaluate/vllm_eval.py): the interpreter of the environment that has vLLM.
    vllm_python: str | None = option(None, "--engine vllm: the python of the environment with vLLM (default: "
                                           "this one).", envvar="EAGLE3_VLLM_PYTHON")

    def validate(self):
        """Refuse flag values that cannot run, before any model is loaded."""
        self._check_engine()
        if self.mode not in ("tree", "chain"):
            raise OptionError(f"--mode must be tree or chain, got {self.mode!r}")
        if self.baseline not in (None, "prompt-lookup"):
            raise OptionError(f"--baseline must be prompt-lookup, got {self.baseline!r}")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:  # "not >=": NaN is refused too
            raise OptionError("--temperature must be >= 0 and --top-p in (0, 1]")
        if self.max_new_tokens < 1 or self.steps < 1:
            raise OptionError("--max-new-tokens and --steps must be at least 1")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise OptionError(f"--max-minutes must be a positive number of minutes, got {self.max_minutes}")
        if self.fast not in ("auto", "on", "off"):
            raise OptionError(f"--fast must be auto, on or off, got {self.fast!r}")
        if self.draft_weights not in ("auto", "full", "int8", "int4"):
            raise OptionError(f"--draft-weights must be auto, full, int8 or int4, got {self.draft_weights!r}")
        if self.data and len(self.task) != 1:
            raise OptionError("--data gives the prompts of one task; pass a single --task with it")
        check_out_dir(self.out, "--out")  # before any prompt is run: results are written last
        self.tree_shape()

    def _check_engine(self):
        if self.engine not in EVAL_ENGINES:
            raise OptionError(f"--engine must be {', '.join(EVAL_ENGINES[:-1])} or {EVAL_ENGINES[-1]}, got {self.engine!r}")
        if self.engine_only and self.engine == "eagle3":
            raise OptionError("--engine-only needs --engine llama.cpp or vllm")
        if self.engine != "eagle3" and self.temperature != 0:
            raise OptionError(f"--engine {self.engine} measures greedy decoding: drop --temperature")

    def tree_shape(self) -> tuple[bool, int, int, int]:
        """(auto, total_tokens, depth, top_k) of --tree, defaulting by where the target runs."""
        tree = self.tree
        if tree is None:
            import torch

            on_gpu = (self.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
            tree = GPU_TREE if on_gpu else CPU_TREE
        return parse_tree(tree)
