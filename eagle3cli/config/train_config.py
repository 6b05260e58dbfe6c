"""Training configuration: one dataclass, YAML recipes per model family, and their precedence.

Every field of ``TrainConfig`` is at once a CLI flag of ``eagle3 train`` (``lr`` ->
``--lr``, ``ttt_steps`` -> ``--ttt-steps``) and a key a recipe may set. Values resolve as

    dataclass defaults  <  recipe (--recipe NAME|FILE|auto)  <  flags given on the command line

Recipes are YAML files in the repository's ``recipes/`` folder, shipped inside the package as
``eagle3cli.recipes`` (which is why this module is not called ``recipes.py``). ``auto`` picks the
recipe of the target's ``model_type`` family.
This module imports neither torch nor transformers (the CLI builds its flags from it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar

import yaml

from ..core.errors import Eagle3Error, OptionError
from .options import Alias, TargetOptions, check_choices, flag_of, option

# model_type (config.json) -> recipe name.
FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2", "qwen2_moe": "qwen2",
    "qwen3": "qwen3", "qwen3_moe": "qwen3",
    "mistral": "mistral", "mixtral": "mistral", "ministral": "mistral",
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma",
    "phi": "phi", "phi3": "phi", "phimoe": "phi",
}
META_KEYS = {"description"}  # recipe keys that are not settings
# Numbers that would only show up as a NaN loss (or an overflow) many steps later.
FLOAT_SETTINGS = ("lr", "init_std", "step_decay", "grad_clip", "warmup_ratio", "min_lr_ratio", "weight_decay",
                  "vocab_coverage", "val_fraction", "feature_noise", "accept_loss", "max_minutes", "loss_gamma",
                  "dpace_alpha", "soft_labels", "adam_beta2")
MIXED_PRECISION = ("auto", "bf16", "no")
LOSS_ON = ("answers", "all")
AT_LEAST_ONE = ("ttt_steps", "max_tokens", "grad_accum", "epochs", "max_length", "keep_checkpoints", "eval_samples",
                "eval_new_tokens", "draft_layers", "num_anchors")
OPTIMIZERS = ("adamw", "muon")
KEEP = ("last", "best")
VARIANTS = ("eagle3", "eagle3.1")
LR_SCHEDULES = ("cosine", "linear", "constant")
DRAFT_TYPES = ("eagle3", "dflash")
POSITION_WEIGHTS = ("decay", "dpace")
# Settings only one draft family reads: typed beside the other family they would change nothing,
# which is refused rather than trained without (a forgotten --draft-type costs a whole run).
FAMILY_ONLY = {
    "eagle3": ("ttt_steps", "step_decay", "eval_ttt_steps", "accept_loss", "variant", "norm_before_fc", "norm_output",
               "norm_before_residual", "draft_vocab_size", "vocab_coverage"),
    "dflash": ("block_size", "draft_layers", "num_anchors", "loss_gamma", "position_weights", "dpace_alpha",
               "mask_token_id", "soft_labels"),
}
# accelerate tracker name -> the packages that provide it.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",), "aim": ("aim",), "clearml": ("clearml",), "dvclive": ("dvclive",)}


class TrainError(Eagle3Error):
    """A user-facing problem, reported as one line."""


_f = option  # short name: every field below is one


@dataclass
class TrainConfig(TargetOptions):
    # The target-loading fields (model, revision, dtype, device, load_in_8bit/4bit, adapter,
    # trust_remote_code) come from TargetOptions, shared with gen-data and eval.
    # what train --help says for None
    SHOWN_DEFAULTS: ClassVar[dict] = {"model": "the store's target", "norm_before_fc": "on (off with eagle3.1)"}
    # --- what to train on ---
    data: str | None = _f(None, "Feature store written by `eagle3 gen-data`.", flag="store",
                          aliases=(Alias("--data"),))
    out: str = _f("eagle3-draft", "Output folder: the final draft, checkpoints/ and logs.")
    chat_template: str | None = _f(None, "Jinja file of the chat template gen-data used, if not the tokenizer's.")
    layers: str | None = _f(None, "Expected aux layer ids 'j,j,j'; the store must have been made with them.")
    online: bool = _f(False, "Run the target each batch (for stores made with gen-data --online).")
    allow_incomplete: bool = _f(False, "Train on a store whose gen-data run has not finished (shards missing).")
    init_from: str | None = _f(None, "Start from an existing draft (any format `eagle3 inspect` reads) "
                                     "instead of random weights; its layers must match the store's. A DFlash "
                                     "draft (--draft-type dflash) also fixes --block-size and --draft-layers; its "
                                     "layers and MASK id are taken unless --layers or --mask-token-id is given.")
    init_vocab: str = _f("keep", "With --init-from: keep its vocabulary (d2t, t2d, lm_head as they are) or "
                                 "new (built from this store; lm_head rows of shared tokens copied).",
                         choices=("keep", "new"))
    loss_on: str = _f("all", "Positions the loss scores: all (every token: the teacher is the target's own "
                             "distribution wherever it stands, so prompt positions teach the same function; "
                             "measured ahead at every budget and target tried, docs/benchmarks.md) or answers "
                             "(the store's loss mask, the assistant's tokens). Held-out metrics always score "
                             "answers.", choices=LOSS_ON)
    # --- draft vocabulary ---
    draft_vocab_size: str = _f("32000", "Draft vocab size N (capped at the target's) or 'auto'.")
    vocab_coverage: float = _f(0.99, "With --draft-vocab-size auto: share of masked tokens to cover.")
    # --- draft architecture (docs/design.md §3; written to config.json, read by vLLM and SGLang) ---
    preset: str = _f("eagle3", "Defaults to start from (below a recipe and the flags): eagle3, this tool's "
                               "(chosen by measurement: docs/benchmarks.md, 'Defaults study'), or paper, the "
                               "EAGLE-3 paper's (no norm before fc, lr 1e-4, cosine, loss on the answers).",
                         choices=("eagle3", "paper"))
    variant: str = _f("eagle3", "Draft architecture: eagle3 (the paper's) or eagle3.1 (adds fc_norm, one RMSNorm per "
                                "target stream before fc, and norm_output, the normed output fed to the next step).",
                      choices=VARIANTS)
    norm_before_fc: bool | None = _f(None, "One RMSNorm over the concatenated target streams before fc (input_norm; "
                                           "norm_before_fc: vLLM, SGLang and llama.cpp serve it). Not with --variant "
                                           "eagle3.1 (its fc_norm normalises each stream instead).")
    norm_before_residual: bool = _f(False, "The residual around the draft's attention is hidden_norm(g) instead of g "
                                           "(speculators' variant; vLLM serves it, SGLang 0.5.23 does not).")
    norm_output: bool = _f(False, "Feed norm(a) to the next TTT step and to the LM head instead of a (EAGLE-3.1 "
                                  "and speculators; vLLM and SGLang serve it, llama.cpp does not). On by itself "
                                  "or with the other norms; --variant eagle3.1 turns it on too.")
    # --- initialisation ---
    warm_start: str = _f("none", "Start the draft from the target's weights: comma-separated parts of head (final "
                                 "norm + LM head rows), fc (pass the high stream through), layer (the target's "
                                 "last layer); none = random (measured best for short CPU runs, docs/benchmarks.md).")
    init_std: float = _f(0.02, "Standard deviation of the random initial weights of fc, the layer's linears and "
                               "the LM head.")
    residual_init_std: float | None = _f(None, "Standard deviation of the initial o_proj and down_proj, the two "
                                               "linears that write into the residual stream (default: --init-std), "
                                               "in every layer of a dflash draft; 0 starts the layer as the identity.")
    freeze_head: bool = _f(False, "Keep the LM head as the target's (with --warm-start head; ignored otherwise and "
                                  "with --init-from): nothing to learn there.")
    # --- draft family (docs/design.md §13) ---
    draft_type: str = _f("eagle3", "Draft family: eagle3 (one layer drafting token by token, trained with "
                                   "training-time test) or dflash (a block of tokens drafted in one non-causal "
                                   "forward of a small stack that reads the target's streams). eval, inspect, "
                                   "convert and push read it from the draft's config.json.", choices=DRAFT_TYPES)
    block_size: int = _f(4, "dflash: tokens in a block, the anchor and block-size - 1 drafted ones (vLLM's "
                            "num_speculative_tokens is block-size - 1, SGLang's draft tokens block-size). 4: "
                            "the most held-out acceptance at a few CPU-minutes (docs/benchmarks.md); the public "
                            "GPU-trained drafts use 16.")
    draft_layers: int = _f(1, "dflash: decoder layers of the draft.")
    num_anchors: int = _f(64, "dflash: blocks trained per conversation in a step, anchored at random positions "
                              "whose next token the loss scores.")
    loss_gamma: float = _f(0.0, "dflash with --position-weights decay: drafted position k weighs exp(-(k-1)/gamma) "
                                "in the loss; also the decay of the reported loss (0: 7 for blocks "
                                "of 16, 4 for 8, else half the block less one, at least 1).")
    position_weights: str = _f("dpace", "dflash: how the loss weighs drafted position k: dpace (by the chance "
                                        "that the block is accepted up to k and beyond, from the draft's own "
                                        "confidences; a higher held-out tau than decay on both seeds measured, "
                                        "docs/benchmarks.md) or decay (exp(-(k-1)/gamma), --loss-gamma).",
                                choices=POSITION_WEIGHTS)
    dpace_alpha: float = _f(0.5, "dflash with --position-weights dpace: confidences are smoothed to "
                                 "(1 - alpha) q + alpha; 1 weighs every position alike, 0 the raw chances.")
    soft_labels: float = _f(0.0, "dflash: the share of each drafted position's loss scored against the target's "
                                 "whole distribution rather than its argmax alone (0: argmax only, as DFlash's "
                                 "authors train; 1: the distribution only).")
    mask_token_id: int = _f(-1, "dflash: the token id whose embedding fills the block after the anchor; a real "
                                "row of the target's embedding, never eos or pad (-1: the first spare row, else "
                                "the last id that is no special token).")
    # --- training-time test ---
    ttt_steps: int = _f(7, "Unrolled drafting steps per position.")
    step_decay: float = _f(0.8, "Loss weight decay per step: loss = sum_s decay^s * loss_s.")
    ttt_warmup: int = _f(0, "Optimizer steps trained with one TTT step before the full unroll (a curriculum: "
                            "step 0 is learned first).")
    eval_ttt_steps: int = _f(0, "Steps unrolled for the held-out evaluation (0: --ttt-steps), e.g. 7 to "
                                "measure a --ttt-steps 1 draft on the 7-step scale.")
    recompute: bool | None = _f(None, "Recompute each TTT step's layer in the backward instead of keeping its "
                                      "activations: same values, less memory, more compute. Default: auto (on "
                                      "when the kept activations would exceed 1 GB, docs/benchmarks.md).")
    # --- loss and regularisation ---
    accept_loss: float = _f(0.0, "Share w of the acceptance loss: train on (1 - w) soft cross-entropy + w (-log "
                                 "sum_v min(p_v, q_v)), the chance speculative sampling accepts a drafted token "
                                 "(LK losses, arXiv 2602.23881). 0: soft cross-entropy alone.")
    feature_noise: float = _f(0.0, "Gaussian noise added to the target's streams in training steps, as a share of "
                                   "each stream's RMS at that position (0: none).")
    # --- optimisation ---
    lr: float = _f(1e-3, "Peak learning rate (AdamW, betas 0.9/0.95). 1e-3 with the default norm before fc: the best "
                         "measured at 40 and 600 steps (docs/benchmarks.md, 'Defaults study'); --preset paper: 1e-4.")
    optimizer: str = _f("adamw", "adamw, or muon: torch's Muon (Newton-Schulz orthogonalised momentum, its update "
                                 "scaled to AdamW's RMS so --lr carries over) for the 2-D weights inside the draft "
                                 "(fc, attention, MLP); the LM head and the norms stay on AdamW. On a CPU it "
                                 "computes in fp32 unless --mixed-precision bf16 is given, and its Newton-Schulz "
                                 "iteration runs in fp32 where the CPU has no native bf16 (30x faster there than "
                                 "torch's bf16).",
                        choices=OPTIMIZERS)
    adam_beta2: float = _f(0.95, "AdamW's second-moment decay (beta2; beta1 is 0.9), with --optimizer muon "
                                 "for the weights AdamW keeps. 0.95 follows the gradient's scale within about 20 "
                                 "steps; torch's default, 0.999, within about 1,000.")
    warmup_ratio: float = _f(0.02, "Share of steps spent warming up linearly; --lr-schedule after.")
    lr_schedule: str = _f("linear", "Decay after the warm-up, from --lr to --min-lr-ratio x --lr at the last step: "
                                    "linear (the default: ahead of cosine at 40 and at 600 steps), cosine, or constant "
                                    "(no decay).", choices=LR_SCHEDULES)
    min_lr_ratio: float = _f(0.0, "Final learning rate as a share of --lr.")
    weight_decay: float = _f(0.0, "Decoupled weight decay of the matrices (AdamW's and Muon's); norms and "
                                    "other 1-D weights are never decayed.")
    grad_clip: float = _f(0.5, "Gradient norm clip.")
    max_tokens: int = _f(8192, "Token budget of one micro-batch (padded tokens, per process).")
    grad_accum: int = _f(1, "Micro-batches per optimizer step.")
    regroup_batches: bool = _f(False, "Draw new length-sorted batches every epoch (within random mega-batches, "
                                      "transformers' group_by_length order) instead of one grouping whose order "
                                      "alone is reshuffled.")
    epochs: int = _f(3, "Passes over the training split.")
    max_steps: int = _f(0, "Stop after this many optimizer steps (0: no limit; the schedule spans it).")
    max_minutes: float = _f(0.0, "End the run within this many minutes of its start (0: no limit): once steps "
                                 "are timed, the step count (at most what --epochs/--max-steps give) is refitted "
                                 "to the time left and the LR schedule spans it; the last validation and the "
                                 "export are reserved for.")
    mixed_precision: str = _f("auto", "bf16: compute under bf16 autocast (fp32 master weights and teacher); no: "
                                      "fp32. auto: bf16 on a GPU and on a CPU with AMX or AVX512-BF16 (1.6x fp32's "
                                      "tokens per CPU-second there: docs/benchmarks.md), fp32 on other CPUs and with "
                                      "--optimizer muon on a CPU.",
                              choices=MIXED_PRECISION)
    max_length: int = _f(2048, "Longer conversations are cut to this many tokens.")
    seed: int = _f(0, "Seed for initialisation, split and batch order.")
    val_fraction: float = _f(0.02, "Share of conversations held out and evaluated each epoch.")
    # --- checkpoints and logging ---
    save_every: int = _f(500, "Checkpoint every N optimizer steps (and at the end).")
    keep_checkpoints: int = _f(2, "Keep the last K checkpoints.")
    resume: bool = _f(False, "Resume from the last checkpoint in --out.")
    log_every: int = _f(10, "Update the live metrics every N steps.")
    report_to: str | None = _f(None, "Also log to: tensorboard, wandb (accelerate trackers), comma-separated.")
    # --- acceptance measured during training (train_eval.py) ---
    eval_every: int = _f(0, "Every N optimizer steps and at the end, decode a few held-out prompts with the draft "
                            "(chain 3, greedy, lossless) and log the measured tau beside the simulated one (0: off).")
    eval_prompts: str | None = _f(None, "With --eval-every: a prompts file, JSONL of {\"turns\": [...]} records (what "
                                        "`eagle3 eval --prompts` reads), whose first turns are decoded instead of "
                                        "the store's held-out conversations.", flag="prompts",
                                  aliases=(Alias("--eval-prompts"),))
    eval_samples: int = _f(4, "With --eval-every: how many prompts are decoded.", flag="num_prompts",
                           aliases=(Alias("--eval-samples"),))
    eval_new_tokens: int = _f(64, "With --eval-every: tokens decoded per prompt.", flag="max_new_tokens",
                              aliases=(Alias("--eval-new-tokens"),))
    keep: str = _f("last", "The draft exported at the end: last (the final weights) or best (the measured step with "
                           "the highest measured tau; needs --eval-every).", choices=KEEP)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, alone: bool = False) -> list[str]:
        """Refuse flag values that cannot train, before anything is loaded; returns the
        --report-to tracker names (each known and installed). ``alone``: only the checks of each
        value by itself (the train command runs them on its flags before it reads a recipe, a
        store or the target's config; the combinations are checked once the recipe is in)."""
        check_choices(self, TrainError)
        if self.data is None and not alone:
            raise TrainError("--store is required (a folder written by `eagle3 gen-data`)")
        for name in FLOAT_SETTINGS:
            if not math.isfinite(getattr(self, name)):
                raise TrainError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        if not 0 <= self.adam_beta2 < 1:
            raise TrainError(f"--adam-beta2 must lie in [0, 1) (0.95 or 0.999 are usual), got {self.adam_beta2:g}")
        if not 0 < self.lr <= 1:
            raise TrainError(f"--lr must lie in (0, 1] (EAGLE-3 drafts train at 1e-4 to 1e-3), got {self.lr:g}")
        for name in AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise TrainError(f"{flag_of(TrainConfig, name)} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.val_fraction < 1:
            raise TrainError(f"--val-fraction must lie in [0, 1), got {self.val_fraction}")
        if not 0 <= self.accept_loss <= 1:
            raise TrainError(f"--accept-loss must lie in [0, 1] (a share of the loss), got {self.accept_loss:g}")
        if self.feature_noise < 0:
            raise TrainError(f"--feature-noise must be 0 or more (a share of each stream's RMS), got "
                             f"{self.feature_noise:g}")
        if self.max_minutes < 0:
            raise TrainError(f"--max-minutes must be 0 (no limit) or more, got {self.max_minutes:g}")
        if self.ttt_warmup < 0:
            raise TrainError(f"--ttt-warmup must be 0 or more optimizer steps, got {self.ttt_warmup}")
        if self.eval_every < 0:
            raise TrainError(f"--eval-every must be 0 (off) or a number of optimizer steps, got {self.eval_every}")
        if not 0 < self.init_std <= 1:
            raise TrainError(f"--init-std must lie in (0, 1], got {self.init_std:g}")
        if self.residual_init_std is not None and not 0 <= self.residual_init_std <= 1:
            raise TrainError(f"--residual-init-std must lie in [0, 1], got {self.residual_init_std:g}")
        if self.block_size < 2:
            raise TrainError(f"--block-size must be at least 2 (the anchor and one drafted token), got "
                             f"{self.block_size}")
        if self.loss_gamma < 0:
            raise TrainError(f"--loss-gamma must be 0 (auto) or more, got {self.loss_gamma:g}")
        if not 0 <= self.dpace_alpha <= 1:
            raise TrainError(f"--dpace-alpha must lie in [0, 1], got {self.dpace_alpha:g}")
        if not 0 <= self.soft_labels <= 1:
            raise TrainError(f"--soft-labels must lie in [0, 1], got {self.soft_labels:g}")
        if self.eval_prompts and not Path(self.eval_prompts).is_file():
            raise TrainError(f"--prompts {self.eval_prompts}: no such file")
        if alone:
            return check_trackers(self.report_to)
        if self.keep == "best" and not self.eval_every:
            raise TrainError("--keep best needs --eval-every N: the steps whose measured tau it compares")
        if (self.load_in_8bit or self.load_in_4bit) and not self.online:
            raise TrainError("--load-in-8bit/--load-in-4bit only apply to --online training "
                             "(offline training uses the stored features)")
        return check_trackers(self.report_to)


def check_trackers(report_to: str | None) -> list[str]:
    """--report-to names, each known and installed (accelerate would silently drop the others)."""
    import importlib.util

    names = [t.strip().lower() for t in (report_to or "").split(",") if t.strip()]
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise TrainError(f"--report-to {name}: unknown tracker; choose from {', '.join(TRACKER_PACKAGES)}")
        if not any(importlib.util.find_spec(p) for p in TRACKER_PACKAGES[name]):
            raise TrainError(f"--report-to {name} needs the {TRACKER_PACKAGES[name][0]} package: "
                             f"pip install {TRACKER_PACKAGES[name][0]}")
    return names


def field_types() -> dict[str, type]:
    """Plain type of each field (bool, int, float or str; ``X | None`` -> X)."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out[f.name] = {"bool": bool, "int": int, "float": float}.get(t.split("|")[0].strip(), str)
    return out


def coerce(key: str, value: Any, source: str) -> Any:
    """Check/convert one setting to its field's type (YAML reads 1e-4 as a string)."""
    types = field_types()
    if key not in types:
        raise OptionError(f"{source}: unknown setting {key!r} (see `eagle3 train --help`)")
    if value is None:
        return None
    want = types[key]
    try:
        if want is bool:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if want is int and isinstance(value, float) and not value.is_integer():
            raise TypeError
        return want(value)
    except (TypeError, ValueError):
        raise OptionError(f"{source}: {key} must be of type {want.__name__}, got {value!r}") from None



def draft_options(cfg: TrainConfig) -> dict[str, bool]:
    """The DraftConfig architecture options of ``cfg`` (``--variant`` and the two norm flags)."""
    check_choices(cfg)
    v31 = cfg.variant == "eagle3.1"
    nbf = not v31 if cfg.norm_before_fc is None else cfg.norm_before_fc  # None: the default, on unless eagle3.1
    if v31 and nbf:
        raise OptionError("--norm-before-fc does not combine with --variant eagle3.1: its fc_norm already normalises "
                          "each stream before fc (speculators refuses both)")
    return {"fc_norm": v31, "norm_output": v31 or bool(cfg.norm_output), "norm_before_fc": nbf,
            "norm_before_residual": bool(cfg.norm_before_residual)}


# ---- recipes --------------------------------------------------------------------------------

def _recipe_dir():
    """Packaged recipes; in a source checkout that is not installed, the repo's recipes/."""
    try:
        return files("eagle3cli.recipes")
    except (ModuleNotFoundError, TypeError):
        return Path(__file__).resolve().parents[2] / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in _recipe_dir().iterdir() if p.name.endswith(".yaml"))


def recipe_for_model_type(model_type: str | None) -> str | None:
    return FAMILIES.get((model_type or "").lower())


def recipe_source(name_or_path: str) -> tuple[str, str]:
    """(name, YAML text) of a packaged recipe name or a YAML file path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise OptionError(f"recipe file {name_or_path} does not exist")
        return str(path), path.read_text()
    if name_or_path in recipe_names():
        return name_or_path, (_recipe_dir() / f"{name_or_path}.yaml").read_text()
    raise OptionError(f"unknown recipe {name_or_path!r}; choose one of {', '.join(recipe_names())}, "
                      "auto, none, or a YAML file")


def read_recipe(name_or_path: str) -> tuple[str, dict]:
    """(name, raw mapping) of a recipe."""
    name, text = recipe_source(name_or_path)
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise OptionError(f"recipe {name}: expected a mapping of settings, got {type(raw).__name__}")
    return name, raw


def load_recipe(name_or_path: str) -> tuple[str, dict]:
    """(name, validated settings) of a recipe; unknown keys and wrong types are errors."""
    name, raw = read_recipe(name_or_path)
    settings = {k: coerce(k, v, f"recipe {name}") for k, v in raw.items() if k not in META_KEYS}
    return name, settings


# What --preset paper changes: the EAGLE-3 paper's setup, which the defaults study measured behind
# the eagle3 defaults at every budget tried (docs/benchmarks.md, "Defaults study").
PRESETS = {"eagle3": {}, "paper": {"lr": 1e-4, "norm_before_fc": False, "lr_schedule": "cosine", "loss_on": "answers"}}


def check_family_flags(given, draft_type: str) -> None:
    """Refuse the typed flags (``given``: field names) that only the other draft family reads."""
    foreign = [n for family, names in FAMILY_ONLY.items() if family != draft_type for n in names if n in given]
    if foreign:
        other = next(f for f in FAMILY_ONLY if f != draft_type)
        typed = ", ".join(flag_of(TrainConfig, n) for n in foreign)
        raise TrainError(f"{typed}: only a --draft-type {other} draft reads {'it' if len(foreign) == 1 else 'them'}, "
                         f"and this run trains {draft_type}; add --draft-type {other} or drop {typed}")


def resolve(recipe: str | None, flags: dict, model_type: str | None = None) -> tuple[TrainConfig, str | None]:
    """defaults < --preset < recipe < flags. ``flags`` holds only the flags actually given (None = unset).

    Returns the config and the name of the recipe used (None when none applies).
    """
    flags = {k: coerce(k, v, "flag") for k, v in flags.items() if v is not None}
    settings: dict = {}
    used = None
    if recipe and recipe != "none":
        if recipe == "auto":
            used = recipe_for_model_type(model_type)
        else:
            used = recipe
        if used is not None:
            used, settings = load_recipe(used)
    preset = flags.get("preset", settings.get("preset", "eagle3"))
    cfg = TrainConfig(**{**PRESETS.get(preset, {}), **settings, **flags})
    draft_options(cfg)  # a wrong --variant fails here, before any model is loaded
    return cfg, used
