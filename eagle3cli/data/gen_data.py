"""gen-data: chat prompts -> the target's own answers -> assistant masks -> features on disk.

The pipeline, per shard of ``shard_size`` conversations (shard s is written by rank s % n):

1. regenerate the answers with the target (local batched generation or an OpenAI-compatible
   endpoint), or keep the dataset's own answers; regenerated conversations are saved as
   ``regenerated/part-SSSSS.jsonl`` before anything else, so a crash never pays for them twice
   (through an endpoint each answer is journaled as it arrives, ``part-SSSSS.journal``, until then);
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

from collections import Counter
from dataclasses import replace
from pathlib import Path

from .. import __version__
from ..config.options import GenDataOptions
from ..core.hf_utils import eos_token_ids, text_config
from ..core.time_limit import TimeLimit
from .answer_journal import journal_path
from .chat_mask import MaskError, chat_template, end_of_turn_ids, highlight, template_hash
from .estimates import check_disk, disk_line, estimate_store, regen_eta
from .fingerprints import content_hash, data_fingerprint
from .gen_errors import GenDataError
from .gen_progress import run_shards
from .samples import (
    capture_budget,
    capture_dtype,
    capture_samples,
    check_template_syntax,
    conversation_samples,
    fix_for,
    reasoning_kwargs,
    shard_samples,
    why_unusable,
)
from .sources import Conversation, images_of, load_conversations, with_system
from .store_build import finished_shards, new_manifest, write_manifest
from .store_writer import (
    REGEN_DIR,
    prepare_out,
    rank_and_world,
    read_regenerated,
    run_settings,
    verify_done,
    write_regenerated,
    write_shard_files,
)


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
        from ..model.layers import parse_draft_types, store_layers
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
            self.layers = store_layers(self.config, parse_draft_types(o.draft_type), o.layers)
        except ValueError as e:
            raise GenDataError(str(e)) from None
        self.hidden = int(tc.hidden_size)
        self.tokenizer, self.template = self.load_tokenizer()
        self.template_sha = template_hash(self.template)
        self.end_ids = end_of_turn_ids(self.tokenizer)
        self.stop_ids = eos_token_ids(self.end_ids, getattr(self.config, "eos_token_id", None),
                                      getattr(tc, "eos_token_id", None))
        self.regen_dtype, self.regen_recorded = self.resolve_regen_dtype()
        self.capture_dtype = self.resolve_capture_dtype()
        self.sample_kw = {"template_kwargs": reasoning_kwargs(o.reasoning, self.template),
                          "last_turn_only": o.last_turn_only, "reasoning": o.reasoning}

    def _target_dtype(self):
        """(device, torch dtype) the target computes in by its own settings: the one home of that
        rule for the regeneration and capture dtypes."""
        from ..model.target import default_device, resolve_dtype

        device = self.spec.device or default_device()
        return device, resolve_dtype(self.spec.dtype, device)

    def resolve_regen_dtype(self) -> tuple[str | None, str | None]:
        """(the dtype local regeneration computes in, None without local regeneration; the same
        when it differs from the target's compute dtype, else None: what run settings record),
        checked before any weights are loaded."""
        from ..model.target import DTYPES
        from .regenerate import regen_dtype

        o = self.opts
        if not o.regenerate or o.endpoint:
            if o.regen_dtype != "auto":
                raise GenDataError("--regen-dtype sets how the local target regenerates; it does nothing with "
                                   + ("--endpoint" if o.endpoint else "--no-regenerate"))
            return None, None
        device, own = self._target_dtype()
        try:
            name = regen_dtype(o.regen_dtype, self.config, device, own,
                               quantized=self.spec.load_in_8bit or self.spec.load_in_4bit)
        except ValueError as e:
            raise GenDataError(str(e)) from None
        return name, (None if DTYPES[name] == own else name)

    def resolve_capture_dtype(self) -> str | None:
        """The dtype the target is loaded and captures features in, when not its own (None: its own;
        ``samples.capture_dtype``), checked before any weights are loaded."""
        from ..model.target import DTYPES

        o = self.opts
        if o.features != "offline" or o.engine != "hf":
            return None
        device, own_dtype = self._target_dtype()
        own = next(k for k, v in DTYPES.items() if v == own_dtype)
        try:
            name = capture_dtype(o.capture_dtype, device, own, self.spec.load_in_8bit or self.spec.load_in_4bit,
                                 self.regen_dtype)
        except ValueError as e:
            raise GenDataError(str(e)) from None
        return None if name == own else name

    def load_data(self):
        from .raw_rows import SourceError

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
            raise GenDataError(f"--dataset has conversations with images and {self.spec.model} is not a "
                               "vision-language model: use its image-text-to-text target or text conversations")
        if o.regenerate:
            raise GenDataError("conversations with images keep the dataset's answers: pass --no-regenerate")
        if o.features != "offline" or o.engine != "hf":
            raise GenDataError("conversations with images need their features captured here (no --online, "
                               "--engine hf): the image tokens' states come from the vision tower")
        try:
            return load_processor(self.spec)
        except TargetError as e:
            raise GenDataError(str(e)) from None

    def base_manifest(self, settings: dict) -> dict:
        """The manifest's fixed fields (store_build.new_manifest; totals come from the sidecars)."""
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

    def regenerate(self, index: int, convs: list[Conversation]) -> tuple[list[Conversation | None], dict]:
        from .regenerate import GenSettings, regenerate_local

        o = self.opts
        path = self.out / REGEN_DIR / f"part-{index:05d}.jsonl"
        if path.exists():
            journal_path(path).unlink(missing_ok=True)  # left by a stop between the two writes below
            return read_regenerated(path)
        settings = GenSettings(max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_p=o.top_p,
                               batch_size=o.batch_size, max_length=o.max_length, dtype=self.regen_dtype)
        msgs, tools = [c.messages for c in convs], [c.tools for c in convs]
        template_kwargs = self.sample_kw["template_kwargs"]
        journal = None
        if self.endpoint is not None:
            results, stats, journal = self.regenerate_through_endpoint(index, path, convs, settings)
        else:
            results, stats = regenerate_local(self.model, self.tokenizer, msgs, settings, self.stop_ids,
                                              on_batch=lambda s: self.progress.status(f"shard {index}: generating {s}"),
                                              seed=o.seed * 1_000_003 + index,  # reproducible per shard
                                              template_kwargs=template_kwargs, tools=tools,
                                              on_progress=lambda d, _t: self.progress.within_shard(d))
        stats_d = {"answers": stats.answers, "cut": stats.cut, "dropped_turns": stats.dropped_turns,
                   "generated_tokens": stats.generated_tokens,
                   "rejected": {str(convs[i].id): r for i, r in stats.rejected.items()}}
        write_regenerated(path, convs, results, stats_d)
        if journal is not None:
            journal.remove()  # the part file holds every answer now
        return [Conversation(c.id, m, c.tools) if m is not None else None for c, m in zip(convs, results)], stats_d

    def regenerate_through_endpoint(self, index: int, path: Path, convs: list[Conversation], settings):
        """(results, stats, journal) of one shard through --endpoint. Each answer is journaled as it
        arrives (answer_journal): a stop loses none of them, and a rerun asks only for the others."""
        from .answer_journal import AnswerJournal
        from .endpoint import EndpointError, regenerate_endpoint

        journal = AnswerJournal(journal_path(path))
        if journal.kept:
            self.console.print(f"shard {index}: {journal.kept} answers kept from an earlier run "
                               f"({journal.path.name}); asking the server for the others only", highlight=False)
        done = []
        try:
            results, stats = regenerate_endpoint(
                self.endpoint, [c.messages for c in convs], settings, tools=[c.tools for c in convs],
                template_kwargs=self.sample_kw["template_kwargs"], journal=journal, ids=[c.id for c in convs],
                on_done=lambda i: done.append(i) or self.progress.within_shard(len(done)))
        except EndpointError as e:
            raise GenDataError(f"{e}; stopped: the {len(journal)} answers of shard {index} received so far are kept "
                               f"in {journal.path} and the finished shards in {self.out}: run the same command "
                               "again to resume (only the unanswered turns are sent)") from None
        finally:
            journal.close()
        return results, stats, journal

    def process_shard(self, index: int, convs: list[Conversation]) -> dict:
        o = self.opts
        skipped = Counter()
        regen_stats = None
        if o.regenerate:
            regen, regen_stats = self.regenerate(index, convs)
            skipped["endpoint rejected the conversation"] += sum(r is None for r in regen)
            convs = [r for r in regen if r is not None]
        samples, truncated, unlearned, ends = shard_samples(self.tokenizer, convs, o, self.sample_kw, skipped)
        if self.pending_show:
            self.show_masks(convs, self.pending_show)
            self.pending_show = 0
        if samples and o.features == "offline":
            self.progress.status(f"shard {index}: capturing features" + (" (vLLM)" if self.vllm is not None else ""))
            if self.vllm is not None:
                self.vllm.capture(samples)
            else:
                # Capture is the whole shard's work when the dataset's answers are kept: the log's
                # progress follows it (in conversations, pro rata); regeneration reported its own.
                n_convs = len(convs)
                on_progress = None if o.regenerate else (
                    lambda done: self.progress.within_shard(n_convs * done // len(samples)))
                capture_samples(self.model, samples, self.layers.ids, o.capture_tokens or capture_budget(self.model),
                                on_progress)
        return write_shard_files(self.out, self.rank, index, samples, o.feature_dtype, skipped, truncated, unlearned,
                                 ends, regen_stats)

    # -- driver

    def run(self) -> dict | None:
        o, console = self.opts, self.console
        self.setup()
        self.load_data()
        streams = len(self.layers.ids)
        tokens, nbytes = estimate_store(self.tokenizer, self.convs, o, self.hidden, streams)
        console.print(disk_line(tokens, nbytes, self.hidden, o.features, streams), highlight=False)
        if o.dry_run:
            self.dry_run()
            return None
        self.preflight()
        self.out = Path(o.out)
        settings = run_settings(o, self.spec, self.template_sha, self.layers.ids, data_fingerprint(o.data),
                                regen=self.regen_recorded, capture=self.capture_dtype)
        mode = prepare_out(self.out, settings, o.overwrite, self.rank, self.world)
        base = self.base_manifest(settings)
        n_shards = -(-len(self.convs) // o.shard_size)
        mine = [s for s in range(n_shards) if s % self.world == self.rank]
        done = verify_done(finished_shards(self.out), mine, console)
        todo = [s for s in mine if s not in done]
        if mode == "resume":
            console.print(f"resuming: {len(mine) - len(todo)} of {len(mine)} shards of this rank already done")
        check_disk(self.out, nbytes, len(todo), n_shards, o.skip_disk_check, console)
        if todo:
            self.connect()
        self.pending_show = o.show_mask
        try:
            if todo and o.engine == "vllm":
                self.start_vllm(base)
            write_manifest(self.out, base, n_shards)
            run_shards(self, todo, base, n_shards)
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

    def dry_run(self):
        """--dry-run: the masks asked for and the shards planned; nothing written, no model loaded."""
        o, console = self.opts, self.console
        if o.show_mask:
            if o.regenerate:
                console.print("(dry run: masks shown on the dataset's own answers; the run regenerates them)")
            self.show_masks([c for c in self.convs if any(m["role"] == "assistant" for m in c.messages)],
                            o.show_mask)
        console.print(f"dry run: {len(self.convs)} conversations, "
                      f"{-(-len(self.convs) // o.shard_size)} shards of up to {o.shard_size}; nothing written")

    def connect(self):
        """What the shards still to do need: the target's weights (local capture or regeneration)
        and the endpoint that regenerates instead."""
        o, console = self.opts, self.console
        if (o.features == "offline" and o.engine == "hf") or (o.regenerate and not o.endpoint):
            from ..model.target import load_target

            regen = f" (regenerating in {self.regen_dtype})" if self.regen_dtype else ""
            cast = f", features in {self.capture_dtype}" if self.capture_dtype else ""
            console.print(f"loading target {self.spec.model}{regen}{cast} ...")
            self.model = load_target(replace(self.spec, dtype=self.capture_dtype) if self.capture_dtype else self.spec)
        if o.endpoint:
            from .endpoint import Endpoint, EndpointError

            self.endpoint = Endpoint(o.endpoint, model=o.endpoint_model, api_key=o.api_key,
                                     concurrency=o.concurrency, patience=o.endpoint_patience,
                                     say=lambda m: console.print(m, highlight=False, markup=False))
            try:
                console.print(f"endpoint {self.endpoint.base}: model {self.endpoint.resolve_model()}")
            except EndpointError as e:
                raise GenDataError(str(e)) from None

    def say_estimate(self, convs: list[Conversation]):
        """Before local regeneration of many conversations: how long it will take here (estimates.regen_eta)."""
        o = self.opts
        if not (o.regenerate and self.model is not None and self.endpoint is None) or len(convs) < 2 * o.batch_size:
            return
        self.console.print(regen_eta(self.model, self.tokenizer, convs, o, self.regen_dtype), highlight=False,
                           markup=False)


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


def run(opts: GenDataOptions, spec, console=None) -> dict | None:
    """Run gen-data from Python; returns the manifest (None for a dry run)."""
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    return Pipeline(opts, spec, console).run()
