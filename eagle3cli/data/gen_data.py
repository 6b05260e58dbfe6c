"""gen-data: chat prompts -> the target's own answers -> assistant masks -> features on disk.

The pipeline, per shard of ``shard_size`` conversations (shard s is written by rank s % n):

1. regenerate the answers with the target (local batched generation or an OpenAI-compatible
   endpoint), or keep the dataset's own answers; regenerated conversations are saved as
   ``regenerated/part-SSSSS.jsonl`` before anything else, so a crash never pays for them twice;
2. tokenise each conversation with the target's chat template and build its assistant mask
   (``chat_mask``); cut it at ``max_length`` (counted, never dropped silently);
3. one target forward per conversation (micro-batched by token budget, right padding, no
   generation) capturing ``hidden_states[j]`` for the three layer ids and ``hidden_states[N]``;
4. write ``shards/shard-RR-SSSSS.safetensors`` atomically, then its stats sidecar
   ``shard-RR-SSSSS.json``: a shard whose sidecar exists is finished and a rerun skips it.

``manifest.json`` (fields: docs/design.md §9) is rewritten after every shard from all the
sidecars present, so the store on disk always describes itself; ``complete`` says whether every
planned shard is there. The settings that shape the data are recorded under ``run``; a rerun
with different settings is refused unless ``overwrite``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

from .. import __version__
from ..config.options import GenDataOptions  # noqa: F401  (its fields are the flags; defined with them)
from ..core.errors import Eagle3Error
from ..core.hf_utils import eos_token_ids, text_config
from ..core.io_utils import ensure_dir, file_sha256, write_json
from ..core.progress import LogProgress
from ..core.threads import adapt as adapt_threads
from ..core.time_limit import TimeLimit, now
from .chat_mask import (
    MaskError,
    chat_template,
    end_of_turn_ids,
    exact_answer_labels,
    highlight,
    template_hash,
    tokenize_conversation,
)
from .chat_mask import last_turn_only as last_turn_only_mask
from .features import (
    MANIFEST,
    SHARD_DIR,
    content_hash,
    data_fingerprint,
    finished_shards,
    new_manifest,
    shard_name,
    shard_problem,
    write_manifest,
    write_shard,
)
from .sources import Conversation, images_of, load_conversations, with_system

REGEN_DIR = "regenerated"
BYTES_PER_VALUE = 2  # bf16 / fp16 features


class GenDataError(Eagle3Error, ValueError):
    """A problem the user must fix; the message is one line."""


# ---------------------------------------------------------------- small pieces


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard i/n`` -> (i, n) with 0 <= i < n."""
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise GenDataError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise GenDataError(f"--shard {text}: need 0 <= i < n")
    return i, n


def rank_and_world(shard: str | None):
    """(rank, world size, device or None, accelerate state or None): --shard wins, else the
    ``accelerate launch`` environment, else a single process."""
    parsed = parse_shard(shard)
    if parsed:
        return parsed[0], parsed[1], None, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        state = PartialState()
        return state.process_index, state.num_processes, str(state.device), state
    return 0, 1, None, None


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def bytes_per_token(hidden: int, features: str) -> int:
    """(3 streams + final) x hidden x 2 bytes, plus 5 bytes of id and mask."""
    return (3 + 1) * hidden * BYTES_PER_VALUE + 5 if features == "offline" else 5


# ---------------------------------------------------------------- samples


def build_sample(tokenizer, conv: Conversation, max_length: int, template_kwargs: dict | None = None,
                 last_turn_only: bool = False, processor=None) -> tuple[dict, bool]:
    """(sample with input_ids/loss_mask lists, truncated?) or MaskError.

    ``template_kwargs`` go to the chat template (``enable_thinking``), with the row's ``tools``;
    ``last_turn_only`` learns only the last assistant turn; ``processor`` (a vision-language
    target's) expands the images of a conversation that has some, and the sample then carries
    its ``media`` tensors for the capture forward (data/media.py)."""
    from .regenerate import strip_meta

    kw = {**(template_kwargs or {}), **({"tools": conv.tools} if conv.tools else {})}
    tok = tokenize_conversation(tokenizer, strip_meta(conv.messages), **kw)
    ids, mask, unlearned = exact_answer_labels(tok, conv.messages)
    if last_turn_only:
        mask = last_turn_only_mask(mask)
    images = images_of(conv.messages)
    media = None
    if images:
        if processor is None:
            raise MaskError("conversation with images, and the target is not a vision-language model")
        from .chat_mask import render
        from .media import with_images

        ids, mask, media = with_images(processor, render(tokenizer, strip_meta(conv.messages), **kw), images,
                                       ids, mask)
    truncated = len(ids) > max_length
    if truncated:
        if media is not None:
            from .media import cut_media

            token = getattr(processor, "image_token_id", None)
            media = cut_media(media, max_length, token, ids, sum(t == token for t in ids))
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise MaskError("no assistant tokens within --max-length" if truncated else "no assistant tokens")
    sample = {"sample_id": conv.id, "input_ids": ids, "loss_mask": mask, "end_ids": tok.end_ids,
              "unlearned_answers": unlearned}
    if media is not None:
        sample["media"] = media
    return sample, truncated


def turn_prefixes(conv: Conversation) -> list[Conversation]:
    """``--reasoning keep``: one conversation per learned assistant turn, ending with it.

    Reasoning templates drop the thinking of earlier turns from the history they render, so in
    one rendering only the last turn's thinking is there to learn; each prefix is the context
    the target had when it wrote that turn, with the turn's thinking in it."""
    return [Conversation(conv.id, conv.messages[:k + 1], conv.tools) for k, m in enumerate(conv.messages)
            if m["role"] == "assistant" and m.get("learn") is not False]


def conversation_samples(tokenizer, conv: Conversation, max_length: int, reasoning: str | None = None,
                         **kw) -> list[tuple[dict, bool]]:
    """The samples of one conversation (build_sample's): one, or one per turn for ``--reasoning keep``."""
    if reasoning != "keep":
        return [build_sample(tokenizer, conv, max_length, **kw)]
    kw["last_turn_only"] = True
    prefixes = turn_prefixes(conv)
    if not prefixes:
        raise MaskError("no assistant tokens")
    return [build_sample(tokenizer, c, max_length, **kw) for c in prefixes]


def estimated_tokens(tokenizer, conv: Conversation, o) -> int:
    """The tokens ``conv`` will store, counted as the chat template renders it (its default
    system prompt, turn headers and ends included: counting the messages' own text missed them),
    capped at --max-length. With the dataset's answers that is the stored count; with
    regeneration every answer is rendered empty and counted as --max-new-tokens (+ 8 for a
    re-tokenised answer's drift), the longest it may become: an upper bound."""
    from .regenerate import strip_meta

    msgs = [dict(m) for m in conv.messages]
    answers = 0
    if o.regenerate:
        out = []
        for m in msgs:
            if m["role"] == "assistant":
                continue  # every answer is the target's own, one after each user turn
            out.append(m)
            if m["role"] == "user":
                out.append({**m, "role": "assistant", "content": ""})
                answers += 1
        msgs = out
    try:
        n = len(tokenize_conversation(tokenizer, strip_meta(msgs)).input_ids)
    except MaskError:  # the template refuses the shape (empty answers): each message + 8 for its headers
        n = sum(len(tokenizer(m["content"] or "", add_special_tokens=False)["input_ids"]) + 8 for m in msgs)
    return min(n + answers * (o.max_new_tokens + 8), o.max_length)


def capture_samples(model, samples: list[dict], layer_ids, token_budget: int, on_progress=None):
    """Fill ``aux``/``final`` of each sample: forwards over length-sorted micro-batches.
    ``on_progress(n)``: called with the number of samples captured so far after each micro-batch.

    Right padding: real tokens never attend to the pads that follow them (causal mask), so
    each sample's features are those of its own forward.
    """
    import torch

    from ..model.target import capture, model_device

    device = model_device(model)
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]["input_ids"]), i))
    batches, cur = [], []
    for i in order:
        width = len(samples[i]["input_ids"])  # sorted: the newest sample is the widest
        if samples[i].get("media"):  # its images go with it alone
            batches.append([i])
            continue
        if cur and (len(cur) + 1) * width > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    done = 0
    for batch in batches:
        width = max(len(samples[i]["input_ids"]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            n = len(samples[i]["input_ids"])
            ids[r, :n] = torch.tensor(samples[i]["input_ids"])
            attn[r, :n] = 1
        if len(batch) == 1 and samples[batch[0]].get("media"):  # an image conversation: the whole model
            media = {k: v.to(device) for k, v in samples[batch[0]]["media"].items()}
            aux, final = capture(model, ids.to(device), layer_ids, None, media=media)
        else:
            aux, final = capture(model, ids.to(device), layer_ids, attn.to(device) if len(batch) > 1 else None)
        for r, i in enumerate(batch):
            n = len(samples[i]["input_ids"])
            samples[i]["aux"] = aux[r, :n].cpu()
            samples[i]["final"] = final[r, :n].cpu()
        if on_progress is not None:
            done += len(batch)
            on_progress(done)


# ---------------------------------------------------------------- output folder


def run_settings(opts: GenDataOptions, spec, template_sha: str, layer_ids, data_fingerprint,
                 regen: str | None = None) -> dict:
    """The settings that shape the stored data: a rerun must match them to resume. ``regen``: the
    dtype local regeneration computes in, when it is not the target's own (``regen_dtype``)."""
    return {
        "model": spec.model, "revision": spec.revision, "dtype": spec.dtype, "adapter": spec.adapter,
        "load_in_8bit": spec.load_in_8bit, "load_in_4bit": spec.load_in_4bit,
        "data": opts.data, "data_fingerprint": data_fingerprint, "format": opts.format, "split": opts.split,
        "subset": opts.subset, "max_samples": opts.max_samples, "shuffle": opts.shuffle, "seed": opts.seed,
        "regenerate": opts.regenerate, "max_new_tokens": opts.max_new_tokens if opts.regenerate else None,
        "temperature": opts.temperature if opts.regenerate else None,
        "top_p": opts.top_p if opts.regenerate else None, "system": opts.system,
        "chat_template_hash": template_sha, "features": opts.features, "layer_ids": list(layer_ids),
        "max_length": opts.max_length, "shard_size": opts.shard_size,
        "feature_dtype": opts.feature_dtype if opts.features == "offline" else None,
        # Only when not the default, so that stores written before the option still resume.
        **({"capture_engine": opts.engine} if opts.engine != "hf" else {}),
        **({"regen_dtype": regen} if regen else {}),
        **({"reasoning": opts.reasoning} if opts.reasoning else {}),
        **({"last_turn_only": True} if opts.last_turn_only else {}),
    }


def prepare_out(out: Path, settings: dict, overwrite: bool, rank: int, world: int = 1):
    """Start, resume or (with overwrite) replace a store; refuse to mix different runs."""
    mpath = out / MANIFEST
    existing = [p for p in out.iterdir()] if out.is_dir() else []
    if existing and not overwrite:
        if not mpath.exists():
            raise GenDataError(f"--out {out} is not empty and holds no gen-data manifest: choose another --out "
                               "or pass --overwrite")
        old = json.loads(mpath.read_text()).get("run") or {}
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise GenDataError(f"--out {out} holds a run with different settings ({', '.join(diff)}): pass "
                               "--overwrite to replace it, or choose another --out")
        if world == 1:  # half-written files of a killed run (never of a live rank: single process only)
            for d in (out, out / SHARD_DIR, out / REGEN_DIR):
                for p in d.glob(".*.tmp-*") if d.is_dir() else []:
                    p.unlink()
        return "resume"
    if existing and overwrite:
        # Only what gen-data writes, and for a multi-rank run only this rank's own shards.
        pattern = "shard-*" if world == 1 else f"shard-{rank:02d}-*"
        for p in (out / SHARD_DIR).glob(pattern) if (out / SHARD_DIR).is_dir() else []:
            p.unlink()
        if rank == 0:
            shutil.rmtree(out / REGEN_DIR, ignore_errors=True)
            if mpath.exists():
                mpath.unlink()
        return "overwrite"
    ensure_dir(out)
    return "new"


# ---------------------------------------------------------------- regeneration per shard


def _read_regenerated(path: Path) -> tuple[list[Conversation | None], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    stats = json.loads(path.with_suffix(".stats.json").read_text())
    return [None if "rejected" in r else Conversation(r["id"], r["messages"], r.get("tools")) for r in rows], stats


def _write_regenerated(path: Path, convs: list[Conversation], results: list, stats: dict):
    from ..core.io_utils import atomic_write_bytes

    ensure_dir(path.parent)
    write_json(path.with_suffix(".stats.json"), stats)  # first: a .jsonl that exists has its stats
    lines = []
    for c, msgs in zip(convs, results):
        row = {"id": c.id, "messages": msgs, **({"tools": c.tools} if c.tools else {})}
        if msgs is None:
            row["rejected"] = stats.get("rejected", {}).get(str(c.id), "rejected")
        lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


# ---------------------------------------------------------------- the run


class Pipeline:
    """Holds what every shard needs; ``run()`` is the entry point."""

    def __init__(self, opts: GenDataOptions, spec, console):
        self.opts, self.spec, self.console = opts, spec, console
        self.model = None
        self.endpoint = None
        self.vllm = None  # vllm_engine.VllmCapture with --engine vllm
        self.clock = TimeLimit(opts.max_minutes)  # --max-minutes, from the command's start

    # -- setup

    def load_tokenizer(self):
        from ..model.target import load_tokenizer

        tpl = None
        if self.opts.chat_template:
            p = Path(self.opts.chat_template).expanduser()
            if not p.is_file():
                raise GenDataError(f"--chat-template {p}: no such file")
            tpl = p.read_text(encoding="utf-8")
        tok = load_tokenizer(self.spec, chat_template=tpl)
        try:
            template = chat_template(tok)
        except ValueError as e:
            raise GenDataError(str(e)) from None
        check_template_syntax(tok, self.opts.chat_template or f"the chat template of {self.spec.model}")
        return tok, template

    def setup(self):
        from ..model.layers import choose_layers
        from ..model.target import load_config

        o = self.opts
        o.validate(GenDataError)  # every flag alone (the command ran it too, before any import)
        check_engine_options(o, self.spec)
        self.rank, self.world, device, self.state = rank_and_world(o.shard)
        if device and not self.spec.device:
            self.spec.device = device
        self.config = load_config(self.spec)
        tc = text_config(self.config)
        try:
            self.layers = choose_layers(self.config, o.layers)
        except ValueError as e:
            raise GenDataError(str(e)) from None
        self.hidden = int(tc.hidden_size)
        self.tokenizer, self.template = self.load_tokenizer()
        self.template_sha = template_hash(self.template)
        self.end_ids = end_of_turn_ids(self.tokenizer)
        self.stop_ids = eos_token_ids(self.end_ids, getattr(self.config, "eos_token_id", None),
                                      getattr(tc, "eos_token_id", None))
        self.regen_dtype, self.regen_recorded = self.resolve_regen_dtype()
        self.sample_kw = {"template_kwargs": reasoning_kwargs(o.reasoning, self.template),
                          "last_turn_only": o.last_turn_only, "reasoning": o.reasoning}

    def resolve_regen_dtype(self) -> tuple[str | None, str | None]:
        """(the dtype local regeneration computes in, None without local regeneration; the same
        when it differs from the target's compute dtype, else None: what run settings record),
        checked before any weights are loaded."""
        from ..model.target import DTYPES, default_device, resolve_dtype
        from .regenerate import regen_dtype

        o = self.opts
        if not o.regenerate or o.endpoint:
            if o.regen_dtype != "auto":
                raise GenDataError("--regen-dtype sets how the local target regenerates; it does nothing with "
                                   + ("--endpoint" if o.endpoint else "--no-regenerate"))
            return None, None
        device = self.spec.device or default_device()
        own = resolve_dtype(self.spec.dtype, device)
        try:
            name = regen_dtype(o.regen_dtype, self.config, device, own,
                               quantized=self.spec.load_in_8bit or self.spec.load_in_4bit)
        except ValueError as e:
            raise GenDataError(str(e)) from None
        return name, (None if DTYPES[name] == own else name)

    def load_data(self):
        from .sources import SourceError

        o = self.opts
        try:
            convs, report = load_conversations(o.data, fmt=o.format, split=o.split, subset=o.subset,
                                               streaming=o.streaming, max_samples=o.max_samples, shuffle=o.shuffle,
                                               seed=o.seed, need_answers=not o.regenerate, strict=o.strict)
        except SourceError as e:
            raise GenDataError(str(e)) from None
        if o.system is not None:
            convs = with_system(convs, o.system)
        if any(images_of(c.messages) for c in convs):
            self.sample_kw["processor"] = self.image_processor()
        self.convs, self.report = convs, report
        self.console.print(f"data: {report.summary()}", highlight=False)

    def image_processor(self):
        """The target's processor, for conversations with images (checked before any work)."""
        from ..model.target import TargetError, is_vision_language, load_processor

        o = self.opts
        if not is_vision_language(self.config):
            raise GenDataError(f"--dataset has conversations with images and {self.spec.model} is not a vision-language "
                               "model: use its image-text-to-text target or text conversations")
        if o.regenerate:
            raise GenDataError("conversations with images keep the dataset's answers: pass --no-regenerate")
        if o.features != "offline" or o.engine != "hf":
            raise GenDataError("conversations with images need their features captured here (no --online, "
                               "--engine hf): the image tokens' states come from the vision tower")
        try:
            return load_processor(self.spec)
        except TargetError as e:
            raise GenDataError(str(e)) from None

    def estimate(self) -> tuple[int, int]:
        """(tokens, bytes) expected, from up to 500 conversations extrapolated (estimated_tokens)."""
        o = self.opts
        sample = self.convs[:: max(1, len(self.convs) // 500)][:500]
        total = sum(estimated_tokens(self.tokenizer, c, o) for c in sample)
        tokens = int(total * len(self.convs) / max(1, len(sample)))
        return tokens, tokens * bytes_per_token(self.hidden, o.features)

    def base_manifest(self, settings: dict) -> dict:
        """The manifest's fixed fields (features.new_manifest; totals come from the sidecars)."""
        o = self.opts
        return new_manifest(
            target={"id": self.spec.model, "revision": self.spec.revision,
                    "content_hash": content_hash(self.spec.model, self.spec.gguf_file)},
            model_type=getattr(self.config, "model_type", None), hidden_size=self.hidden,
            vocab_size=getattr(text_config(self.config), "vocab_size", None), num_layers=self.layers.n_layers,
            layer_ids=self.layers.ids, features=o.features, dtype=o.feature_dtype,
            chat_template_hash=self.template_sha, max_length=o.max_length, skipped=self.report.skipped,
            end_token_ids=self.end_ids,
            source={"data": o.data, "format": self.report.format, "split": o.split, "subset": o.subset,
                    "rows_read": self.report.rows, "conversations": len(self.convs),
                    "regenerated": o.regenerate, "endpoint": o.endpoint,
                    "generation": {"max_new_tokens": o.max_new_tokens, "temperature": o.temperature,
                                   "top_p": o.top_p, "system": o.system, "dtype": self.regen_dtype}
                    if o.regenerate else None,
                    "seed": o.seed, "shuffle": o.shuffle, "max_samples": o.max_samples},
            version=__version__, run=settings)

    def show_masks(self, convs: list[Conversation], n: int):
        from rich.rule import Rule

        shown = 0
        for c in convs:
            if shown >= n:
                break
            try:
                s, _ = conversation_samples(self.tokenizer, c, self.opts.max_length, **self.sample_kw)[-1]
            except MaskError as e:
                self.console.print(f"[yellow]sample {c.id}: {e}[/]")
                continue
            self.console.print(Rule(f"sample {c.id}: {sum(s['loss_mask'])} of {len(s['input_ids'])} tokens "
                                    "learned (highlighted)"))
            self.console.print(highlight(self.tokenizer, s["input_ids"], s["loss_mask"]))
            shown += 1

    def preflight(self):
        """Refuse a run that cannot store a single sample, before the model is loaded: every
        conversation checked is cut away by --max-length or refused by the template."""
        o = self.opts
        sample = self.convs[:: max(1, len(self.convs) // 200)][:200]
        reasons = Counter(why_unusable(self.tokenizer, c, o, self.sample_kw) for c in sample)
        if None in reasons:
            return
        raise GenDataError(f"no conversation would give a training sample ({len(sample)} checked: "
                           + ", ".join(f"{r}: {n}" for r, n in reasons.most_common()) + f"): {fix_for(reasons, o)}")

    def check_disk(self, nbytes: int, todo: int, n_shards: int):
        """Refuse when the estimate for the shards still to do clearly exceeds the free space."""
        free = shutil.disk_usage(existing_parent(self.out)).free
        need = int(nbytes * todo / max(1, n_shards))
        self.console.print(f"free space: {human_bytes(free)}", highlight=False)
        if need > free and not self.opts.skip_disk_check:
            raise GenDataError(f"not enough disk space: the remaining shards need ~{human_bytes(need)}, "
                               f"{human_bytes(free)} is free at {self.out}: free space, choose another --out or "
                               "lower --max-samples (--skip-disk-check if the estimate is too high)")

    def verify_done(self, done: dict[int, Path], mine: list[int]) -> dict[int, Path]:
        """Finished shards of this rank that match their sidecar; the others are deleted and redone."""
        for s in [s for s in mine if s in done]:
            problem = shard_problem(done[s])
            if problem:
                self.console.print(f"[yellow]shard {s}: {problem}: redoing it[/]", highlight=False)
                shard = done[s].with_suffix(".safetensors")
                done.pop(s).unlink()  # the sidecar first: a shard without one is unfinished
                shard.unlink(missing_ok=True)
        return done

    def start_vllm(self, base: dict):
        from ..engines.vllm_engine import VllmCapture, VllmEngineError, find_vllm_python

        o = self.opts
        try:
            python = find_vllm_python(o.vllm_python)
            cfg = {"model": str(Path(self.spec.model).expanduser()), "layer_ids": list(self.layers.ids),
                   "num_layers": self.layers.n_layers, "max_length": o.max_length, "feature_dtype": o.feature_dtype,
                   "dtype": self.spec.dtype, "tensor_parallel_size": o.tensor_parallel_size,
                   "pipeline_parallel_size": o.pipeline_parallel_size, "kv_cache_gib": o.vllm_kv_cache_gib,
                   "extra": o.vllm_args or {}}
            self.console.print(f"starting vLLM ({python}) to capture features ...", highlight=False)
            self.vllm = VllmCapture(python, cfg)
            info = self.vllm.start()
        except VllmEngineError as e:
            if self.vllm is not None:
                self.vllm.close()
                self.vllm = None
            raise GenDataError(str(e)) from None
        self.console.print(f"vLLM {info.get('vllm_version')} ready in {info.get('startup_s')} s "
                           f"(dtype {info.get('dtype')})", highlight=False)
        base["capture"] = {"engine": "vllm", "vllm_version": info.get("vllm_version"), "dtype": info.get("dtype"),
                           "tensor_parallel_size": o.tensor_parallel_size,
                           "pipeline_parallel_size": o.pipeline_parallel_size}

    # -- per shard

    def regenerate(self, index: int, convs: list[Conversation], status) -> tuple[list[Conversation | None], dict]:
        from .regenerate import GenSettings, regenerate_endpoint, regenerate_local

        o = self.opts
        path = self.out / REGEN_DIR / f"part-{index:05d}.jsonl"
        if path.exists():
            return _read_regenerated(path)
        settings = GenSettings(max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_p=o.top_p,
                               batch_size=o.batch_size, max_length=o.max_length, dtype=self.regen_dtype)
        msgs, tools = [c.messages for c in convs], [c.tools for c in convs]
        template_kwargs = self.sample_kw["template_kwargs"]
        if self.endpoint is not None:
            results, stats = regenerate_endpoint(self.endpoint, msgs, settings, tools=tools,
                                                 template_kwargs=template_kwargs)
        else:
            results, stats = regenerate_local(self.model, self.tokenizer, msgs, settings, self.stop_ids,
                                              on_batch=lambda s: status(f"shard {index}: generating {s}"),
                                              seed=o.seed * 1_000_003 + index,  # reproducible per shard
                                              template_kwargs=template_kwargs, tools=tools,
                                              on_progress=lambda d, _t: self.log_progress.update(self.shard_base + d))
        stats_d = {"answers": stats.answers, "cut": stats.cut, "dropped_turns": stats.dropped_turns,
                   "generated_tokens": stats.generated_tokens,
                   "rejected": {str(convs[i].id): r for i, r in stats.rejected.items()}}
        _write_regenerated(path, convs, results, stats_d)
        return [Conversation(c.id, m, c.tools) if m is not None else None for c, m in zip(convs, results)], stats_d

    def process_shard(self, index: int, convs: list[Conversation], status) -> dict:
        import torch

        o = self.opts
        skipped = Counter()
        regen_stats = None
        if o.regenerate:
            regen, regen_stats = self.regenerate(index, convs, status)
            skipped["endpoint rejected the conversation"] += sum(r is None for r in regen)
            convs = [r for r in regen if r is not None]
        samples, truncated, unlearned, ends = [], 0, 0, set()
        for c in convs:
            if o.regenerate and not any(m["role"] == "assistant" for m in c.messages):
                skipped["first prompt reaches --max-length"] += 1
                continue
            try:
                built = conversation_samples(self.tokenizer, c, o.max_length, **self.sample_kw)
            except MaskError as e:
                skipped[str(e)] += 1
                continue
            for s, cut in built:
                truncated += cut
                unlearned += s.pop("unlearned_answers")
                ends |= s.pop("end_ids")
                samples.append(s)
        if self.pending_show:
            self.show_masks(convs, self.pending_show)
            self.pending_show = 0
        if samples and o.features == "offline":
            status(f"shard {index}: capturing features" + (" (vLLM)" if self.vllm is not None else ""))
            if self.vllm is not None:
                self.vllm.capture(samples)
            else:
                # Capture is the whole shard's work when the dataset's answers are kept: the log's
                # progress follows it (in conversations, pro rata); regeneration reported its own.
                n_convs = len(convs)
                on_progress = None if o.regenerate else (
                    lambda done: self.log_progress.update(self.shard_base + n_convs * done // len(samples)))
                capture_samples(self.model, samples, self.layers.ids, o.capture_tokens, on_progress)
        name = shard_name(self.rank, index)
        path = self.out / SHARD_DIR / name
        if samples:
            for s in samples:
                s.pop("media", None)  # the images' tensors served the capture; the store keeps their tokens
                s["input_ids"] = torch.tensor(s["input_ids"], dtype=torch.int32)
                s["loss_mask"] = torch.tensor(s["loss_mask"], dtype=torch.bool)
            dtype = getattr(torch, o.feature_dtype)
            write_shard(path, samples, dtype=dtype)
        stats = {
            "shard": index, "rank": self.rank, "file": name if samples else None,
            "num_samples": len(samples), "num_tokens": sum(int(s["input_ids"].numel()) for s in samples),
            "num_masked_tokens": sum(int(s["loss_mask"].sum()) for s in samples), "truncated": truncated,
            "bytes": path.stat().st_size if samples else 0, "skipped": {k: v for k, v in skipped.items() if v},
            "sha256": file_sha256(path) if samples else None,  # resume and train verify the file against it
            "end_token_ids": sorted(ends), "unlearned_answers": unlearned, "regeneration": {k: v for k, v in (regen_stats or {}).items()
                                                             if k != "rejected"} or None,
        }
        ensure_dir(self.out / SHARD_DIR)
        write_json(path.with_suffix(".json"), stats)  # last: its existence marks the shard finished
        return stats

    # -- driver

    def run(self) -> dict | None:
        o, console = self.opts, self.console
        self.setup()
        self.load_data()
        tokens, nbytes = self.estimate()
        per_tok = bytes_per_token(self.hidden, o.features)
        console.print(f"disk estimate: ~{tokens:,} tokens x {per_tok:,} B/token "
                      f"({'(3+1) x %d x 2 + ids/mask' % self.hidden if o.features == 'offline' else 'ids + mask'})"
                      f" = ~{human_bytes(nbytes)}", highlight=False)
        if o.dry_run:
            if o.show_mask:
                if o.regenerate:
                    console.print("(dry run: masks shown on the dataset's own answers; the run regenerates them)")
                self.show_masks([c for c in self.convs if any(m["role"] == "assistant" for m in c.messages)],
                                o.show_mask)
            console.print(f"dry run: {len(self.convs)} conversations, "
                          f"{-(-len(self.convs) // o.shard_size)} shards of up to {o.shard_size}; nothing written")
            return None
        self.preflight()
        self.out = Path(o.out)
        settings = run_settings(o, self.spec, self.template_sha, self.layers.ids, data_fingerprint(o.data),
                                regen=self.regen_recorded)
        mode = prepare_out(self.out, settings, o.overwrite, self.rank, self.world)
        base = self.base_manifest(settings)
        n_shards = -(-len(self.convs) // o.shard_size)
        mine = [s for s in range(n_shards) if s % self.world == self.rank]
        done = self.verify_done(finished_shards(self.out), mine)
        todo = [s for s in mine if s not in done]
        if mode == "resume":
            console.print(f"resuming: {len(mine) - len(todo)} of {len(mine)} shards of this rank already done")
        self.check_disk(nbytes, len(todo), n_shards)
        need_model = (o.features == "offline" and o.engine == "hf") or (o.regenerate and not o.endpoint)
        if todo and need_model:
            from ..model.target import load_target

            regen = f" (regenerating in {self.regen_dtype})" if self.regen_dtype else ""
            console.print(f"loading target {self.spec.model}{regen} ...")
            self.model = load_target(self.spec)
        if todo and o.endpoint:
            from .regenerate import Endpoint, EndpointError

            self.endpoint = Endpoint(o.endpoint, model=o.endpoint_model, api_key=o.api_key,
                                     concurrency=o.concurrency)
            try:
                console.print(f"endpoint {self.endpoint.base}: model {self.endpoint.resolve_model()}")
            except EndpointError as e:
                raise GenDataError(str(e)) from None
        self.pending_show = o.show_mask
        try:
            if todo and o.engine == "vllm":
                self.start_vllm(base)
            write_manifest(self.out, base, n_shards)
            self._loop(todo, len(mine), done, base, n_shards)
        finally:
            if self.vllm is not None:
                self.vllm.close()
                self.vllm = None
        if self.state is not None:
            self.state.wait_for_everyone()
        man = write_manifest(self.out, base, n_shards)
        if man["shards_done"] == n_shards and not man["num_samples"]:
            raise GenDataError(f"no samples stored in {self.out} (skipped: "
                               + ", ".join(f"{r}: {n}" for r, n in Counter(man["skipped"]).most_common())
                               + f"); the store is not marked complete: {fix_for(Counter(man['skipped']), o)}")
        return man

    def say_estimate(self, convs: list[Conversation]):
        """Before local regeneration of many conversations: how long it will take here, from one
        measured decode step of all of continuous batching's slots (data/regen_rate.py) and the
        answers' lengths in a sample (core/estimate.py, which the quickstart's planner uses too)."""
        from ..core.estimate import REGEN_SHARE_OF_BOUND, eta_line, mean_regenerated, regen_rate
        from .regen_rate import regen_bound, turn_lengths

        o = self.opts
        if not (o.regenerate and self.model is not None and self.endpoint is None) or len(convs) < 2 * o.batch_size:
            return
        sample = convs[:: max(1, len(convs) // 200)][:200]
        turns = [turn_lengths(self.tokenizer, c.messages, o.max_new_tokens) for c in sample]
        per_conv, _ = mean_regenerated(turns, o.max_new_tokens, o.max_length)
        bound = regen_bound(self.model, self.regen_dtype, o.batch_size, min(o.max_length, 256))
        dtype = self.regen_dtype or "float32"
        share = REGEN_SHARE_OF_BOUND.get(dtype, REGEN_SHARE_OF_BOUND["float32"])
        self.console.print(eta_line("gen-data", per_conv * len(convs), "generated tokens", regen_rate(bound, dtype),
                                    f"(regeneration, answers as long as the dataset's up to --max-new-tokens; "
                                    f"{share:.2f} of one measured {o.batch_size}-slot decode step in {dtype}, "
                                    f"{bound:,.0f} tokens/s)"), highlight=False, markup=False)

    def say_stopped(self, finished: int, todo: int, next_convs: int):
        """--max-minutes reached before the next shard: say what is kept and how to go on."""
        rate = self.clock.rate() or 0.0
        self.console.print(f"time limit ({self.clock.describe()}): stopped after {finished} of the {todo} shards "
                           f"this run had to do (the next would need ~{rate * next_convs / 60:.1f} min "
                           f"at {rate:.1f} s a conversation, {max(0.0, self.clock.left()) / 60:.1f} min are left); "
                           "the finished shards are kept and the store is incomplete: run the same command again "
                           "to finish it, or train on it with --allow-incomplete", highlight=False, markup=False)

    def _loop(self, todo: list[int], n_mine: int, done: dict, base: dict, n_shards: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        from ..engines.vllm_engine import VllmEngineError
        from .regenerate import EndpointError

        o = self.opts
        size = o.shard_size
        total = sum(len(self.convs[s * size:(s + 1) * size]) for s in range(n_shards) if s % self.world == self.rank)
        already = total - sum(len(self.convs[s * size:(s + 1) * size]) for s in todo)
        rate = {"conv": 0, "tok": 0, "t0": time.perf_counter()}

        def rates(_task=None):
            dt = max(1e-9, time.perf_counter() - rate["t0"])
            return f"{rate['conv'] / dt:.2f} conv/s  {rate['tok'] / dt:,.0f} tok/s"

        self.say_estimate([c for s in todo for c in self.convs[s * size:(s + 1) * size]])
        # A log file gets a plain line at least every 30 s (core/progress.py); a terminal the live bar.
        self.log_progress = LogProgress("gen-data", total, "conversations", self.console, done0=already,
                                        extra=lambda: f"{rate['tok'] / max(1e-9, time.perf_counter() - rate['t0']):,.0f}"
                                                      " stored tok/s" if rate["tok"] else "")  # once a shard is stored
        self.shard_base = already
        with self.log_progress, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rates]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=self.console, transient=False) as progress:
            task = progress.add_task("gen-data", total=total, completed=already, rates="")

            def status(text: str):
                progress.update(task, description=text, rates=rates())

            for finished, s in enumerate(todo):
                convs = self.convs[s * size:(s + 1) * size]
                if not self.clock.fits(len(convs)):
                    self.say_stopped(finished, len(todo), len(convs))
                    break
                if o.adapt_threads:
                    adapt_threads("gen-data", lambda m: self.console.print(m, highlight=False))
                shard_t0 = now()
                try:
                    stats = self.process_shard(s, convs, status)
                except (EndpointError, VllmEngineError) as e:
                    raise GenDataError(f"{e} (finished shards are kept; rerun the same command to resume)") from None
                self.clock.record(now() - shard_t0, len(convs))
                rate["conv"] += len(convs)
                rate["tok"] += stats["num_tokens"]
                self.shard_base += len(convs)
                self.log_progress.update(self.shard_base)
                progress.update(task, advance=len(convs), description=f"shard {s} done", rates=rates())
                if not self.console.is_terminal:  # logs get a line per shard (no live bar there)
                    self.console.print(f"shard {s}: {stats['num_samples']} samples, {stats['num_tokens']:,} tokens"
                                       f"; {rates()}", highlight=False)
                write_manifest(self.out, base, n_shards)
        self.throughput = dict(rate, seconds=time.perf_counter() - rate["t0"])


def check_engine_options(o: GenDataOptions, spec):
    """--engine vllm on this target: a local, unquantised, unadapted one (the flags alone are
    GenDataOptions.validate's)."""
    if o.engine == "hf":
        return
    if spec.load_in_8bit or spec.load_in_4bit or spec.adapter or spec.gguf_file:
        raise GenDataError("--engine vllm serves the plain target: no --load-in-8bit/4bit, --adapter or GGUF "
                           "(use --engine hf)")
    if not Path(spec.model).expanduser().is_dir():
        raise GenDataError(f"--engine vllm needs the target as a local folder (got {spec.model}); download it first")


def check_template_syntax(tokenizer, name: str):
    """A chat template with a Jinja syntax error would refuse every conversation: one line now."""
    from jinja2 import TemplateSyntaxError

    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        tokenizer.apply_chat_template(probe, tokenize=False)
    except TemplateSyntaxError as e:
        raise GenDataError(f"{name}: Jinja syntax error on line {e.lineno}: {e.message}") from None
    except Exception:  # noqa: BLE001 - a template may refuse this probe on purpose; rows report it
        pass


def reasoning_kwargs(reasoning: str | None, template: str) -> dict:
    """The chat template options of ``--reasoning``: thinking on (``enable_thinking=True``, for
    templates that take it; others think by default). A template with no thinking at all cannot
    give reasoning data: one line, before any work."""
    if reasoning is None:
        return {}
    if reasoning not in ("keep", "drop"):
        raise GenDataError(f"--reasoning must be keep or drop, got {reasoning!r}")
    if "think" not in template:
        raise GenDataError("--reasoning: the chat template has no thinking (no <think> block, no enable_thinking): "
                           "use the reasoning model's own template (--chat-template)")
    return {"enable_thinking": True} if "enable_thinking" in template else {}


def why_unusable(tokenizer, conv: Conversation, o: GenDataOptions, sample_kw: dict | None = None) -> str | None:
    """Why a conversation cannot give a sample (None when it can), as process_shard counts it."""
    from .chat_mask import render

    try:
        if o.regenerate:  # the answers are generated: the first prompt must leave room for one
            first = conv.messages[:2] if conv.messages[0]["role"] == "system" else conv.messages[:1]
            kw = {**(sample_kw or {}).get("template_kwargs", {}), **({"tools": conv.tools} if conv.tools else {})}
            text = render(tokenizer, first, add_generation_prompt=True, **kw)
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            return "first prompt reaches --max-length" if n >= o.max_length else None
        conversation_samples(tokenizer, conv, o.max_length, **(sample_kw or {}))
    except MaskError as e:
        return str(e)
    return None


def fix_for(reasons: Counter, o: GenDataOptions) -> str:
    top = reasons.most_common(1)[0][0] if reasons else ""
    if "--max-length" in (top or ""):
        return f"raise --max-length (now {o.max_length})"
    if "template" in (top or ""):
        return "fix the chat template (or pass a working --chat-template)"
    return "check the data with --dry-run --show-mask 3"


def existing_parent(path: Path) -> Path:
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    return p


def run(opts: GenDataOptions, spec, console=None) -> dict | None:
    """Run gen-data from Python; returns the manifest (None for a dry run)."""
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    return Pipeline(opts, spec, console).run()
