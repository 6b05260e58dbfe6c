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
from enum import Enum
from pathlib import Path
from typing import Any, Callable, List, Literal

from ..core.errors import OptionError, check_out_dir

REQUIRED = dataclasses.MISSING  # option(REQUIRED, ...): a field, and flag, without a default
DTYPES = ("auto", "bfloat16", "float16", "float32")  # --dtype, --regen-dtype
ROW_FORMATS = ("sharegpt", "messages", "alpaca", "turns", "prompt")  # data/sources.py FORMATS
CONVERT_TARGETS = ("ours", "vllm", "sglang", "speculators", "zlab")  # publish/formats/common.py TARGETS
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # publish/gguf_export.py OUTTYPES
# A repeatable choice (--outtype, --gguf) parses as an Enum: typer takes no list of a Literal.
GGUFType = Enum("GGUFType", {t: t for t in GGUF_TYPES}, type=str)


def option(default: Any, help: str, *, short: str | None = None, envvar: str | list[str] | None = None,
           metavar: str | None = None, cli_type: type | None = None,
           parse: Callable[[Any], Any] | None = None, choices: tuple[str, ...] | None = None,
           flag: str | None = None, aliases: tuple[Alias, ...] = (), cli_default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is also a CLI flag ``--name-with-dashes``.

    ``cli_type`` is what the command line gives when it is not the field's type, and ``parse``
    turns it into the field's value (``--layers 2,15,27`` -> ``(2, 15, 27)``; ``cli_default`` is
    then the flag's default). ``choices``: the values the field takes; the flag's type is their
    ``Literal``, so ``--help`` lists them and the parser refuses any other, and :func:`check_choices`
    refuses them for library callers and recipes. ``flag``: the flag's name where it is not the
    field's (the field keeps the library's and the recipes' name; the flag takes the word of the
    vocabulary table in docs/cli.md). ``aliases``: old spellings that still work, hidden, with a
    deprecation line.
    """
    meta = {"help": help, "short": short, "envvar": envvar, "metavar": metavar, "cli_type": cli_type,
            "parse": parse, "choices": tuple(choices) if choices else None, "flag": flag, "aliases": tuple(aliases),
            "cli_default": cli_default}
    if isinstance(default, list):  # a mutable default needs a factory
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Alias:
    """An old spelling of a flag, kept working (hidden) for one minor version.

    ``old`` is the spelling (``--data``, ``-d``); ``cli_type`` the type it parses when it is not the
    new flag's (``--features offline|none`` -> ``--online``), and ``value`` maps its value to the
    new flag's."""

    old: str
    cli_type: Any = None
    value: Callable[[Any], Any] | None = None


def flag_of(cls, name: str) -> str:
    """``--flag`` of field ``name`` of ``cls``: the name users type, for messages."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}.get(name, {})
    return "--" + (meta.get("flag") or name).replace("_", "-")


def check_choices(opts, error: type[Exception] = OptionError) -> None:
    """Refuse a field whose value is not one of its ``choices`` (the CLI's parser already refuses
    them; library callers and recipes get the same words)."""
    for f in dataclasses.fields(opts):
        choices = f.metadata.get("choices")
        value = getattr(opts, f.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:  # a repeatable choice: each value
            if choices and v is not None and v not in choices:
                raise error(f"{flag_of(type(opts), f.name)} must be one of {', '.join(choices)}, got {v!r}")


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
    dtype: str = option("auto", "What the target computes in (auto: bf16 on GPU, fp32 on CPU; for eval's greedy "
                                "fast path bf16 on a CPU with AMX, checked exact at start-up).", choices=DTYPES)
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

FEATURES = ("offline", "none")  # what a store holds: target features, or tokens and masks only


def parse_layer_ids(text: str | None) -> tuple[int, ...] | None:
    """Parse a ``--layers 2,15,27`` override (None or empty -> None)."""
    if text is None or not str(text).strip():
        return None
    try:
        return tuple(int(x) for x in str(text).replace(" ", "").split(","))
    except ValueError:
        raise OptionError(f"--layers must be comma-separated integers, got {text!r}") from None


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


def parse_duration(text, flag: str) -> float:
    """``90s``, ``10m``, ``10min``, ``1h`` or a bare number of seconds -> seconds (a float: library
    callers and recipes may give the seconds themselves)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        raw = str(text).strip().lower()
        units = (("min", 60.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0))
        scale = next((f for u, f in units if raw.endswith(u)), 1.0)
        number = next((raw[: -len(u)] for u, _ in units if raw.endswith(u)), raw).strip()
        try:
            seconds = float(number) * scale
        except ValueError:
            raise OptionError(f"{flag} takes a duration such as 90s, 10m or 1h, got {text!r}") from None
    if not 0 <= seconds < float("inf"):
        raise OptionError(f"{flag} must be a duration of 0 or more (90s, 10m, 1h), got {text!r}")
    return seconds


@dataclass(kw_only=True)
class GenDataOptions(TargetOptions):
    """``eagle3 gen-data``'s settings (gen_data.run takes the target as a separate TargetSpec)."""

    data: str = option(REQUIRED, "Conversations: a Hub dataset id, a preset (sharegpt, ultrachat, gsm8k, alpaca, "
                                 "openhermes, ...) or a local .json/.jsonl/.parquet file.", flag="dataset",
                       aliases=(Alias("--data"), Alias("-d")))
    out: Path = option(Path("eagle3-data"), "Output folder (the feature store).", short="-o")
    format: str | None = option(None, "Force the row format (default: detected).", choices=ROW_FORMATS)
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
    concurrency: int = option(16, "Most conversations in flight at once with --endpoint (fewer while the server "
                                  "answers 429 or 503; back up as it recovers).")
    endpoint_patience: float = option(600.0, "How long --endpoint waits out a server that does not answer (down, "
                                             "restarting, failing) before the run stops: a duration such as 90s, "
                                             "10m or 1h (a bare number is seconds; 0: stop at the first fault). "
                                             "Every answer received is kept; a rerun resumes.",
                                      cli_type=str, parse=lambda text: parse_duration(text, "--endpoint-patience"),
                                      cli_default="10m", metavar="DURATION")
    batch_size: int = option(16, "Prompts per local generation batch.")
    max_new_tokens: int = option(512, "Longest regenerated answer (tokens).")
    temperature: float = option(0.0, "0 = greedy.")
    top_p: float = option(1.0, "Nucleus sampling (with --temperature > 0).")
    regen_dtype: str = option("auto", "What local regeneration computes in (auto: "
                                      "bfloat16 for an fp32 target on a CPU with AVX512-BF16 or AMX, "
                                      "1.3-1.8x faster there; else "
                                      "--dtype's).", choices=DTYPES)
    capture_dtype: str = option("auto", "What the target computes the stored features in, with --engine hf "
                                        "(auto: bfloat16 for an fp32 target on a CPU with AVX512-BF16 or AMX, "
                                        "where capture runs about 3x faster, as a bf16 serving engine computes "
                                        "them; else --dtype's). The target is loaded in it.", choices=DTYPES)
    system: str | None = option(None, "Set this system prompt on every conversation (\"\" removes them).")
    reasoning: str | None = option(None, "A reasoning target's conversations. The target regenerates with "
                                         "thinking on (enable_thinking=True to the template); keep: every turn's "
                                         "thinking is learned, one sample per turn in the context it was written "
                                         "in; drop: one sample as the template renders it, earlier turns' thinking "
                                         "dropped from history. Default: the template's own default.",
                                   choices=("keep", "drop"))
    last_turn_only: bool = option(False, "Learn only the last assistant turn of each conversation (earlier turns are "
                                         "context).")
    chat_template: str | None = option(None, "Jinja chat template file, for tokenizers without one (or to "
                                             "override it).", cli_type=Path, parse=str)
    features: str = option("offline", "Store tokens and masks only, no target features: `eagle3 train --online` "
                                      "runs the target each batch instead (default: features stored, offline "
                                      "training).", choices=FEATURES, flag="online", cli_type=bool,
                           cli_default=False, parse=lambda online: "none" if online else "offline",
                           aliases=(Alias("--features", cli_type=Literal[FEATURES], value=lambda v: v == "none"),))
    layers: tuple[int, ...] | None = option(None, "Override the layer ids j (hidden_states[j]) to capture: three "
                                                  "for EAGLE-3 (e.g. 2,15,27), any ascending set for DFlash.",
                                            cli_type=str, parse=_layer_ids)
    draft_type: str = option("eagle3", "The draft family the store is for, which sets the layers it captures: eagle3 "
                                       "(three streams), dflash (five spaced from 1 to N-3, docs/design.md §13) or "
                                       "eagle3,dflash (their union: one store trains either).")
    max_length: int = option(2048, "Truncate conversations to this many tokens (counted).")
    shard_size: int = option(128, "Conversations per shard file.")
    max_minutes: float | None = option(None, "Stop starting shards that would not finish within this many minutes "
                                             "of the start (judged by the shards done): the store keeps every "
                                             "finished shard and stays incomplete; rerun to finish it, or train on "
                                             "it with --allow-incomplete.")
    shard: str | None = option(None, "Process only part i of n (e.g. 0/4), for manual multi-node splits; "
                                     "accelerate launch splits by rank by itself.")
    feature_dtype: str = option("bfloat16", "What stored features are kept in.", choices=("bfloat16", "float16"))
    overwrite: bool = option(False, "Replace an existing output instead of refusing.")
    dry_run: bool = option(False, "Load and check the data, print the disk estimate, write nothing.")
    strict: bool = option(False, "Fail on the first bad row instead of skipping it.")
    show_mask: int = option(0, "Print N samples with the learned tokens highlighted.")
    skip_disk_check: bool = option(False, "Run even when the disk estimate exceeds the free space (the estimate "
                                          "is an upper bound with regeneration).")
    engine: str = option("hf", "What captures the features: hf (a forward in this process) or vllm (vLLM's "
                               "extract_hidden_states, run by --vllm-python; docs/data.md).", choices=("hf", "vllm"))
    vllm_python: str | None = option(None, "Python of the environment with vLLM (default: this one).",
                                     envvar="EAGLE3_VLLM_PYTHON")
    tensor_parallel_size: int = option(1, "--engine vllm: vLLM's tensor parallelism.")
    pipeline_parallel_size: int = option(1, "--engine vllm: vLLM's pipeline parallelism.")
    vllm_kv_cache_gib: float | None = option(None, "--engine vllm: explicit KV cache size (vLLM's "
                                                   "kv_cache_memory_bytes).")
    vllm_args: dict | None = option(None, "--engine vllm: more vllm.LLM keyword arguments as JSON, e.g. "
                                          "'{\"gpu_memory_utilization\": 0.8}'.", cli_type=str, parse=json_object)
    capture_tokens: int = internal(0)  # padded tokens per capture forward (0: samples.capture_budget)
    # Probe one thread against all between shards (core.threads), for runs on cores other jobs
    # share (the quickstart); off by default: a changed thread count can move a near-tie of the
    # regenerated answers, and a resumed store is otherwise bit-identical to an uninterrupted one.
    adapt_threads: bool = internal(False)

    def validate(self, error: type[Exception] = OptionError):
        """Refuse flag values that cannot run, before any model or data is loaded (the checks that
        need the target's own files, --engine vllm's, are gen_data.check_engine_options). ``error``: the
        class raised, for the library's callers (gen_data raises its GenDataError)."""
        check_choices(self, error)
        for name in ("batch_size", "max_new_tokens", "concurrency", "shard_size"):
            if getattr(self, name) < 1:
                raise error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.capture_tokens < 0:
            raise error(f"capture_tokens must be 0 (auto) or more, got {self.capture_tokens}")
        if self.capture_dtype != "auto" and (self.features != "offline" or self.engine != "hf"):
            raise error("--capture-dtype sets what the local target captures features in; it does nothing with "
                        + ("--engine vllm" if self.engine != "hf" else "--online"))
        if self.max_length < 2:
            raise error(f"--max-length must be at least 2, got {self.max_length}")
        if not (0 <= self.temperature < float("inf")):  # "not": NaN fails every comparison
            raise error(f"--temperature must be 0 (greedy) or positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise error(f"--top-p must lie in (0, 1], got {self.top_p}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise error(f"--max-minutes must be a positive number of minutes, got {self.max_minutes}")
        try:  # a recipe or a library caller may give "10m" as well as seconds
            self.endpoint_patience = parse_duration(self.endpoint_patience, "--endpoint-patience")
        except OptionError as e:
            raise error(str(e)) from None
        if self.endpoint and not self.regenerate:
            raise error("--endpoint regenerates answers; it cannot be combined with --no-regenerate")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise error("--tensor-parallel-size and --pipeline-parallel-size must be at least 1")
        if self.engine == "hf":
            # (--vllm-python is not refused here: $EAGLE3_VLLM_PYTHON may be set for every run)
            if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1 or self.vllm_args:
                raise error("--tensor-parallel-size, --pipeline-parallel-size and --vllm-args are options of "
                                  "--engine vllm")
        else:
            if self.features != "offline":
                raise error("--engine vllm captures features: --online stores tokens only and needs no engine")
            if self.regenerate and not self.endpoint:
                raise error("--engine vllm captures features; regenerate through --endpoint (e.g. `vllm serve` "
                                  "of the same target) or keep the dataset's answers with --no-regenerate")
        if not self.dry_run:
            check_out_dir(self.out, "--out")


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
    data: str | None = option(None, "Prompts file (JSONL with 'turns') for the one --task.", flag="prompts",
                              aliases=(Alias("--data"),))
    out: Path = option(Path("eval_out"), "Folder for results.json and results.png.", short="-o")
    limit: int | None = option(None, "Evaluate only the first N prompts of each task.", flag="num_prompts",
                               aliases=(Alias("--limit"),))
    max_minutes: float | None = option(None, "Start no prompt that would end past this many minutes from the "
                                             "start (judged by the prompts measured; at least one is): the "
                                             "results cover the prompts done and say where they stopped.")
    max_new_tokens: int = option(512, "Longest answer per turn (tokens), for both decodings.")
    temperature: float = option(0.0, "0 = greedy (checked token for token).")
    top_p: float = option(1.0, "Nucleus sampling (with --temperature > 0).")
    sampling_top_k: int = option(0, "Top-k filter of the sampling distribution (0 = off).")
    mode: str = option("tree", "tree (EAGLE-2 dynamic tree) or chain.", choices=("tree", "chain"))
    tree: str | None = option(None, f"auto (measured on this hardware) or TOTAL,DEPTH[,TOPK]; default "
                                    f"{GPU_TREE} on a GPU, {CPU_TREE} on a CPU.")
    steps: int = option(3, "Chain mode (and the engines): drafted tokens per cycle.", flag="chain_length",
                        aliases=(Alias("--steps"),))
    baseline: str | None = option(None, "prompt-lookup: add HF prompt-lookup decoding.", choices=("prompt-lookup",))
    seed: int = option(0, "Seed for sampled decoding (with --temperature > 0).")
    fast: str = option("auto", "Verify through the fast path (static cache, packed matmuls; "
                               "Llama/Mistral/Qwen2/Qwen3, greedy) where it applies, and measure plain decoding on "
                               "it too; speedup is against the faster plain decoding.", choices=("auto", "on", "off"))
    draft_weights: str = option("auto", "Store the drafter's matmul weights as integers "
                                        "(CPU weight-only kernels; only proposals change, decoding stays lossless). "
                                        "auto: int4 where the draft steps in bf16 "
                                        "(beside a bf16 target, or on bf16 hardware), "
                                        "else full (with fp32 "
                                        "inputs the integer kernels are slower than full weights).",
                                choices=("auto", "full", "int8", "int4"))
    engine: str = option("eagle3", "eagle3 (our generator), llama.cpp or vllm: also measure the draft in "
                                   "llama-server or vLLM (chain of --chain-length, greedy), beside our numbers.",
                         choices=EVAL_ENGINES)
    engine_only: bool = option(False, "With --engine llama.cpp|vllm: skip our generator.")
    llama_cpp: Path | None = option(None, "Where llama-server is (or a llama.cpp tree with build/bin); default: "
                                          "$EAGLE3_LLAMA_CPP, then PATH.", metavar="DIR")
    target_gguf: Path | None = option(None, "The target as GGUF (default: converted from --model once, kept in the "
                                            "eagle3 cache); with --engine-target-type, one more target.",
                                      metavar="FILE")
    draft_gguf: Path | None = option(None, "The draft as GGUF (default: exported into OUT/gguf); with "
                                           "--engine-draft-type, one more draft.", metavar="FILE")
    engine_threads: int | None = option(None, "llama.cpp -t, vLLM's OMP_NUM_THREADS (default: their own).")
    # --engine llama.cpp measures every combination of these (evaluate/llamacpp_sweep.py); one value
    # each, the default, is one setting.
    engine_target_types: list[str] = option([], "--engine llama.cpp: a target type to measure, converted from "
                                                "--model by llama.cpp's converter; repeat to sweep (default: "
                                                "f32, or --target-gguf alone, which is measured beside these).",
                                            flag="engine_target_type", choices=GGUF_TYPES, cli_type=List[GGUFType],
                                            parse=lambda ts: [GGUFType(t).value for t in ts])
    engine_draft_types: list[str] = option([], "--engine llama.cpp: a draft type to measure (eagle3 export-gguf "
                                               "--outtype); repeat to sweep (default: f32, or --draft-gguf alone, "
                                               "which is measured beside these).",
                                           flag="engine_draft_type", choices=GGUF_TYPES, cli_type=List[GGUFType],
                                           parse=lambda ts: [GGUFType(t).value for t in ts])
    engine_chain_length: list[int] = option([], "--engine llama.cpp: the chain it drafts at most (llama.cpp "
                                                "--spec-draft-n-max); repeat to sweep (default: --chain-length).",
                                            cli_type=List[int])
    engine_p_min: list[float] = option([0.0], "llama.cpp --spec-draft-p-min (0: always draft --spec-draft-n-max "
                                              "tokens, as chain mode); repeat to sweep.", cli_type=List[float])
    # --engine vllm (eagle3cli/evaluate/vllm_eval.py): the interpreter of the environment that has vLLM.
    vllm_python: str | None = option(None, "--engine vllm: the python of the environment with vLLM (default: "
                                           "this one).", envvar="EAGLE3_VLLM_PYTHON")

    def validate(self):
        """Refuse flag values that cannot run, before any model is loaded."""
        check_choices(self)
        self._check_engine()
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:  # "not >=": NaN is refused too
            raise OptionError("--temperature must be >= 0 and --top-p in (0, 1]")
        if self.max_new_tokens < 1 or self.steps < 1:
            raise OptionError("--max-new-tokens and --chain-length must be at least 1")
        if self.limit is not None and self.limit < 1:
            raise OptionError(f"--num-prompts must be at least 1, got {self.limit}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise OptionError(f"--max-minutes must be a positive number of minutes, got {self.max_minutes}")
        if self.data and len(self.task) != 1:
            raise OptionError("--prompts gives the prompts of one task; pass a single --task with it")
        check_out_dir(self.out, "--out")  # before any prompt is run: results are written last
        if self.tree is not None:  # (its default depends on the device: torch, imported later)
            parse_tree(self.tree)

    def _check_engine(self):
        if self.engine_only and self.engine == "eagle3":
            raise OptionError("--engine-only needs --engine llama.cpp or vllm")
        if self.engine != "eagle3" and self.temperature != 0:
            raise OptionError(f"--engine {self.engine} measures greedy decoding: drop --temperature")
        if isinstance(self.engine_p_min, (int, float)):  # a library caller's one value, as before the sweep
            self.engine_p_min = [float(self.engine_p_min)]
        swept = [flag_of(EvalOptions, name) for name in ("engine_target_types", "engine_draft_types",
                                                         "engine_chain_length") if getattr(self, name)]
        swept += ["--engine-p-min"] if list(self.engine_p_min) != [0.0] else []
        if swept and self.engine != "llama.cpp":
            raise OptionError(f"{', '.join(swept)} set llama-server's runs: add --engine llama.cpp")
        bad = [n for n in self.engine_chain_length if n < 1]
        if bad:
            raise OptionError(f"--engine-chain-length must be at least 1, got {bad[0]}")
        bad = [p for p in self.engine_p_min if not 0 <= p <= 1]  # NaN fails the test too
        if bad:
            raise OptionError(f"--engine-p-min must lie in [0, 1] (a probability), got {bad[0]}")

    def tree_shape(self) -> tuple[bool, int, int, int]:
        """(auto, total_tokens, depth, top_k) of --tree, defaulting by where the target runs."""
        tree = self.tree
        if tree is None:
            import torch

            on_gpu = (self.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
            tree = GPU_TREE if on_gpu else CPU_TREE
        return parse_tree(tree)
