"""eagle3's DFlash trainer against speculators' at equal data and steps, scored by one function.

    bash benchmarks/setup_peers.sh                      # the peers' venv (~/venvs/peers, CPU torch)
    python benchmarks/peer_dflash.py --store runs/sg400b --work runs/peer_dflash --steps 40 --seeds 0
    python benchmarks/peer_dflash.py --store runs/sg400b --steps 80 --runs "eagle3_a256;eagle3_muon=--optimizer muon"
    python benchmarks/peer_dflash.py --store runs/sg400b --work runs/peer_dflash --seeds 2 --grad-check
    python benchmarks/peer_dflash.py --store runs/sg400b --steps 30 --seeds 2 \
        --runs "speculators;eagle3_replay=--init-from peer --replay peer --optimizer muon ..."

A run already scored (its json in --work) is reused, so tables grow run by run; ``--num-anchors
100000`` rescores the runs named on a block at every held-out answer position (kept in each json
beside the default scoring's 64 blocks per conversation). ``eagle3_a256`` is
ours at --num-anchors 256: 512 blocks a step on these 1,024-token steps, as many as the peer's 512
anchors per packed step (our default, 64 per conversation, draws 128); NAME=FLAGS runs ours with
more `eagle3 train` flags. Given several --seeds it ends with every run pooled over them (each
seed's blocks once) and each of ours' lead over the peer in standard errors: paired block by block
from the per-block hits each scoring keeps beside the json (``NAME.hits_aN.safetensors``), where
both drafts have them; ``--paired`` scores again the runs saved before those were kept. A last
table gives the lead seed by seed, with an error from the seeds' spread: the paired error holds
the held-out blocks' noise only, this one the training's randomness too.

The store must hold DFlash's streams (`eagle3 gen-data ... --draft-type dflash` or eagle3,dflash).
Which peer: speculators 0.9.0 and SpecForge 0.2.0 both train DFlash on a CPU (an SDPA mask in place
of flex attention). speculators is the one whose objective is comparable: it labels every drafted
position with the target's argmax (``--loss-fn ce`` on the verifier's logits), as eagle3 does and
as greedy verification accepts; SpecForge 0.2.0 labels them with the dataset's own tokens (its
paper runs regenerate the answers with the target first), which a store of dataset answers does
not match.

Both tools train a DFlash draft of the store's target from the same data (eagle3's training
split; its held-out split is left out of both), for the same optimizer steps of the same token
budget (--tokens: eagle3's --max-tokens of padded tokens per step, speculators' packed
sequence length), the same block size, draft layers, target streams (the store's columns for
eagle3's DFlash layer ids, handed to speculators as its ``hidden_states``; its layer ids count
layer inputs, i.e. the same numbers as ours, z-lab's count layer outputs, one less) and MASK id,
one thread each. Everything else is each tool's own default:

    eagle3       AdamW (betas 0.9/0.95) lr 1e-3, warm-up 2% then its schedule, clip 0.5; --num-anchors
                 per conversation, among every position whose next token the loss scores (--loss-on
                 all: prompts and template too); CE on the target's argmax with D-PACE position
                 weights (alpha 0.5); init std 0.02; bf16 autocast where the CPU has native bf16 (its
                 CPU default).
    speculators  its CLI's DFlash defaults: Muon (2-D weights, lr = --lr, weight decay 0.1, RMS matched to
                 AdamW) + AdamW (the rest, weight decay 0.01) at lr 1e-3, linear schedule with 1%
                 warm-up, clip 1.0; 512 anchors per packed step, among the answers; CE on the
                 verifier's argmax with D-PACE position weights (alpha 0.5); HF init (the target's
                 initializer_range); fp32 (its autocast names CUDA, which a CPU build turns off).

One departure from speculators' defaults, so its draft is the DFlash every engine serves and
converts to ours exactly: its CLI makes every draft layer a sliding-window layer that is causal
inside the block (window 2048, longer than any sequence here); the public z-lab drafts, vLLM,
SGLang and eagle3 attend bidirectionally inside the block, so it trains with
``--full-attention-indices`` on every layer (``layer_types`` all full_attention). And on a CPU
without native bf16 (AVX2 only) its Muon, torch's, runs the Newton-Schulz iteration in fp32 as
eagle3's does there (``optim.newton_schulz_dtype``): torch's bf16 is emulated on such a CPU and
made a DFlash step 2.5x slower (benchmarks/muon_precision.py), and both tools' updates then round alike;
where bf16 is native both keep torch's. ``--peer-optimizer
adamw`` runs speculators with the plain AdamW its TrainerConfig defaults to; the run
``speculators_kl`` trains it with ``--loss-fn kl_div`` (KL to the verifier's distribution, its
default for the other speculator types), the peer's counterpart of eagle3's ``--soft-labels 1``.
``--init-from peer`` in a run's flags starts ours from the very weights the peer's run at that
seed starts from (drawn again in its venv from the same torch seed): a common initialisation
takes the initial draw's share out of the seed-to-seed noise, so the two trainers are compared on
what they do with the data. ``--replay peer`` trains ours on the very steps the peer's run at that
seed takes (its packs and anchors, recorded by ``Tape``; benchmarks/dflash_replay.py): with
``--init-from peer`` and the peer's optimizer recipe the two tools then run one computation, and
their drafts may differ only by rounding.

Scoring: speculators' weights carry the same tensor names as ours (fc, hidden_norm, layers.i.*,
norm; no embedding, the target's frozen LM head); they are loaded into eagle3's DFlashDraft and
both drafts go through the same function: eagle3's Trainer built on the same store and split,
``evaluate(draft)``, in fp32: per drafted position k, the share of held-out blocks whose token k
equals the target's greedy token once tokens 1..k-1 did (acc_k, the chance greedy verification
accepts token k given the ones before it), on the same anchors for both. The conversion is
checked first: the peer's own forward and eagle3's on the same blocks of a training sample must
give the same logits (max |diff| printed and required below 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from peer_trainers import load_split, store_dataset  # the peers' split and dataset, shared with the EAGLE-3 benchmark

HERE = Path(__file__).resolve().parent
SMOLLM2 = Path("~/.cache/eagle3/models/SmolLM2-135M-Instruct").expanduser()
EAGLE3 = str(Path(sys.executable).parent / "eagle3")
DRAFT_FILE = "model.safetensors"
GRAD_SAMPLES = 2  # conversations in --grad-check's pack: one 1,024-token step
SCORE_ANCHORS = 64  # the scorer's held-out blocks per conversation, unless --num-anchors says otherwise
PACKS_FILE = "packs.json"  # the steps a peer's run took (Tape), for dflash_replay.py
FROZEN = ("embed_tokens.", "lm_head.", "verifier_lm_head.", "verifier_norm.", "t2d", "d2t")


# ---------------------------------------------------------------- the peer's side (its venv)

def peer_model(a, meta: dict):
    """speculators' DFlash draft as its CLI builds it for --speculator-type dflash (train/config/schema.py,
    train/cli.py defaults), every layer full attention; its initial weights are drawn here, from the
    torch seed the worker set."""
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config

    tl = create_transformer_layer_config(meta["model"], num_layers=a.draft_layers, draft_arch="qwen3",
                                         hidden_act="silu", sliding_window=2048,
                                         full_attention_indices=list(range(a.draft_layers)))
    model = DFlashDraftModel.from_training_args(
        verifier_config=tl, draft_vocab_size=tl.vocab_size, block_size=a.block_size,
        target_layer_ids=meta["layers"], verifier_name_or_path=meta["model"], mask_token_id=meta["mask_token_id"],
        draft_attn_impl="sdpa", sample_from_anchor=False, sliding_window_non_causal=False)
    model.verifier_norm = torch.nn.Identity()  # the store's final state is already normed
    return model, tl


def save_peer_weights(model, out: Path) -> None:
    """The draft's own tensors (not the target's frozen embedding and head), under the names ours carry."""
    from safetensors.torch import save_file

    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if not k.startswith(FROZEN)}
    save_file(state, str(out / DRAFT_FILE))


def fp32_newton_schulz() -> None:
    """torch's Muon iterates in the dtype eagle3's Muon uses on this CPU (fp32 where bf16 is emulated)."""
    import torch.optim._muon as muon

    from eagle3cli.train.optim import newton_schulz_dtype, orthogonalise

    dtype = newton_schulz_dtype(torch.device("cpu"))
    if dtype != torch.bfloat16:
        muon._zeropower_via_newtonschulz = lambda g, coef, steps, eps: orthogonalise(g, coef, steps, eps, dtype)


class Tape:
    """What speculators' loop hands each step: the split's conversations in its pack (in order, the
    last one cut where the pack is full) and the anchors its ``select_anchors`` drew (positions in
    the pack). ``dflash_replay.py`` trains eagle3 on exactly these steps."""

    def __init__(self, dataset_cls, dcore):
        self.steps: list[dict] = []
        self.fetched: list[int] = []
        tape = self

        class Dataset(dataset_cls):
            def _get_raw_data(self, i):
                tape.fetched.append(int(i))
                return super()._get_raw_data(i)

        self.Dataset = Dataset
        draw = dcore.select_anchors

        def select_anchors(loss_mask, num, block):
            anchors, valid = draw(loss_mask, num, block)
            if self.steps and "anchors" not in self.steps[-1]:
                self.steps[-1]["anchors"] = anchors[valid].tolist()
            return anchors, valid

        self.select_anchors = dcore.select_anchors = select_anchors

    def pack(self, batch) -> None:
        ids = batch["document_ids"][0]
        lens = torch.bincount(ids[ids >= 0]).tolist()
        self.steps.append({"docs": self.fetched[:len(lens)], "lens": lens})
        self.fetched = []

    def dry_run(self, loader, a) -> dict:
        """The steps a training run at this seed takes, drawn without training: the loop's only other
        draws from torch's RNG are the loader's (one a pass) and select_anchors' (one a step)."""
        epoch = 0
        while len(self.steps) < a.steps:
            loader.batch_sampler.set_epoch(epoch)
            for batch in loader:
                self.select_anchors(batch["loss_mask"], a.peer_anchors, a.block_size)
                if len(self.steps) >= a.steps:
                    break
            epoch += 1
        self.save(Path(a.out) / PACKS_FILE, a.steps)
        return {"steps": len(self.steps), "tokens": loader.tokens}

    def save(self, path: Path, steps: int) -> None:
        path.write_text(json.dumps(self.steps[:steps]))


def fix_anchors(dcore, anchors: torch.Tensor) -> None:
    """speculators' DFlash forward draws ``anchors`` (pack positions, all real) instead of random ones."""
    dcore.select_anchors = lambda loss_mask, num, block: (anchors, torch.ones_like(anchors, dtype=torch.bool))


def run_speculators(a) -> dict:
    """speculators' DFlash draft trained by its Trainer on the exported split (two device stubs, as
    benchmarks/peer_trainers.py drives its EAGLE-3 trainer on a CPU)."""
    import speculators.train.trainer as st
    from speculators.models.dflash import core as dcore
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.train.data import BaseDataset
    from speculators.train.dataloader import _setup_dataloader

    torch.accelerator.synchronize = lambda *x, **k: None  # stub 1: the step timer's synchronize
    st.get_local_rank = lambda: "cpu"  # stub 2: batches and the model go .to(local_rank)
    fp32_newton_schulz()
    samples, meta = load_split(Path(a.split))
    StoreDataset = store_dataset(BaseDataset, samples)
    model, tl = peer_model(a, meta)
    train_kw, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn=a.peer_loss, loss_implementation="eager", dflash_decay_gamma=4.0, max_anchors=a.peer_anchors,
        per_position_loss_weight="dpace", dpace_alpha=0.5)
    tape = Tape(StoreDataset, dcore)
    ds = tape.Dataset(max_len=a.tokens, hidden_states_dtype=torch.float32)
    inner = _setup_dataloader(ds, total_seq_len=a.tokens, hidden_size=tl.hidden_size, num_workers=0,
                              num_target_layers=len(meta["layers"]), preprocess=None, seed=a.seed)

    class Counted:  # the loader, counting the real tokens of the packed batches it hands out
        tokens = 0
        batch_sampler = inner.batch_sampler

        def __len__(self):
            return len(inner)

        def __iter__(self):
            for batch in inner:
                Counted.tokens += int((batch["document_ids"] != -1).sum())
                tape.pack(batch)
                yield batch

    loader = Counted()
    if a.record_only:  # the packs and anchors alone: the loop's draws from torch's RNG, without training
        return tape.dry_run(loader, a)
    cfg = st.TrainerConfig(lr=a.lr, num_epochs=10 ** 6, save_path=str(Path(a.out) / "ckpt"), optimizer=a.peer_optimizer,
                           weight_decay=0.01, muon_lr=a.lr, muon_weight_decay=0.1, scheduler_type="linear",
                           train_call_kwargs=train_kw, hidden_states_dtype=torch.float32, log_freq=10 ** 9,
                           max_steps=a.steps, scheduler_total_steps=a.steps)
    trainer = st.Trainer(model, cfg, loader, None)
    lrs: list[float] = []
    trainer.optimizers[0].register_step_post_hook(lambda opt, *_: lrs.append(float(opt.param_groups[0]["lr"])))
    t0, c0 = time.time(), time.process_time()
    epoch = 0
    while trainer.global_step < a.steps:
        trainer.train_epoch(epoch)
        epoch += 1
    wall, cpu = time.time() - t0, time.process_time() - c0
    out = Path(a.out)
    save_peer_weights(model, out)
    if a.record:
        tape.save(out / PACKS_FILE, a.steps)
    # the conversion check: the peer's own logits for fixed blocks of the first sample
    s = samples[0]
    t = int(s["input_ids"].numel())
    anchors = torch.tensor([4, t // 3, t // 2, t - a.block_size - 1])
    fix_anchors(dcore, anchors)
    model.eval()
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            s["aux"].float()[None], s["input_ids"].long()[None], torch.ones(1, t, dtype=torch.long),
            s["final"].float()[None], torch.zeros(1, t, dtype=torch.long), max_anchors=len(anchors))
    torch.save({"anchors": anchors, "logits": logits[0].view(len(anchors), a.block_size, -1)[:, 1:].clone()},
               out / "check.pt")
    return {"steps": trainer.global_step, "tokens": loader.tokens, "wall_s": wall, "cpu_s": cpu, "lrs": lrs}


def peer_gradient(a) -> None:
    """speculators' loss and gradient at its initial draw for one pack of the split's first
    GRAD_SAMPLES conversations, its anchors fixed to those in ``anchors.pt`` (each conversation's
    own positions): one step's raw material, before clipping and the optimizer."""
    from speculators.models.dflash import core as dcore
    from speculators.models.dflash.core import DFlashDraftModel

    samples, meta = load_split(Path(a.split))
    model, _ = peer_model(a, meta)
    parts = samples[:GRAD_SAMPLES]
    lens = [int(p["input_ids"].numel()) for p in parts]
    per_doc = torch.load(Path(a.out) / "anchors.pt")
    anchors = torch.cat([torch.tensor(x) + sum(lens[:j]) for j, x in enumerate(per_doc)])
    fix_anchors(dcore, anchors)
    cat = lambda key, dtype: torch.cat([p[key].to(dtype) for p in parts])[None]  # noqa: E731
    kw, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn="ce", loss_implementation="eager", dflash_decay_gamma=4.0, max_anchors=len(anchors),
        per_position_loss_weight="dpace", dpace_alpha=0.5)
    _, loss, _ = model(cat("aux", torch.float32), cat("input_ids", torch.long), cat("loss_mask", torch.long),
                       cat("final", torch.float32), torch.cat([torch.full((n,), j) for j, n in enumerate(lens)])[None],
                       position_ids=torch.cat([torch.arange(n) for n in lens])[None], **kw)
    loss.backward()
    torch.save({"loss": float(loss), "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}},
               Path(a.out) / "grad.pt")


def worker(a) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.grad_check:
        return peer_gradient(a)
    if a.init_only:  # the weights run_speculators starts from at this seed: nothing draws from torch's RNG first
        model, _ = peer_model(a, json.loads((Path(a.split) / "meta.json").read_text()))
        return save_peer_weights(model, Path(a.out))
    res = run_speculators(a)
    (Path(a.out) / "result.json").write_text(json.dumps(res))
    print(json.dumps({k: v for k, v in res.items() if k != "lrs"}))


# ---------------------------------------------------------------- our side (the project's venv)

def nice_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "EAGLE3_THREADS": "1",
            "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(HERE.parent)}


def sh(cmd: list[str], log: Path) -> int:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(["nice", "-n", "5", *cmd], stdout=f, stderr=subprocess.STDOUT, env=nice_env()).returncode


def scorer(args, work: Path, seed: int):
    """eagle3's Trainer on the store at the benchmark's DFlash settings, set up but never run: its
    ``evaluate`` scores any draft on the held-out split, and ``draft`` is the template a draft's
    tensors are loaded into (the target's embedding and head already in place)."""
    import shutil

    from eagle3cli.config.train_config import TrainConfig
    from eagle3cli.train.trainer import Trainer

    out = work / "_score"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(data=args.store, model=args.model, out=str(out), device="cpu", draft_type="dflash",
                      block_size=args.block_size, draft_layers=args.draft_layers, num_anchors=args.num_anchors,
                      max_tokens=args.tokens, max_length=args.max_length, val_fraction=args.val_fraction,
                      seed=seed, mixed_precision="no")
    t = Trainer(cfg, quiet=True)
    t.setup()
    return t


def with_weights(template, path: Path):
    """A copy of the template draft holding the trainable tensors of ``path`` (ours or the peer's:
    the same names); the frozen embedding and head stay the target's."""
    import copy

    from safetensors.torch import load_file

    draft = copy.deepcopy(template).float()
    state = {k: v.float() for k, v in load_file(str(path)).items() if not k.startswith(FROZEN)}
    want = set(draft.trainable_state_dict())
    if set(state) != want:
        raise SystemExit(f"{path}: tensors {sorted(set(state) ^ want)} differ from the DFlash draft's")
    draft.load_state_dict(state, strict=False)
    return draft.eval()


def export_split(t, out: Path, args) -> None:
    """eagle3's training split of the store (its seed and held-out share), the DFlash streams only,
    as one safetensors file the peer's venv reads without eagle3."""
    from safetensors.torch import save_file

    from eagle3cli.train.families import select_streams

    hidden = int(t.draft.config.hidden_size)
    flat = {}
    for j, i in enumerate(t.train_idx):
        s = t.store[i]
        n = min(int(s["input_ids"].numel()), args.max_length)
        flat.update({f"{j}.input_ids": s["input_ids"][:n].contiguous(),
                     f"{j}.loss_mask": s["loss_mask"][:n].to(torch.uint8),
                     f"{j}.aux": select_streams(s["aux"][:n], t.columns, hidden).contiguous(),
                     f"{j}.final": s["final"][:n].contiguous()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(flat, str(out / "train.safetensors"))
    (out / "meta.json").write_text(json.dumps({
        "samples": len(t.train_idx), "model": args.model, "layers": list(t.layer_ids),
        "mask_token_id": int(t.draft.config.mask_token_id), "val_samples": len(t.val_idx)}))


def grad_check(t, seed: int, args, work: Path, split: Path, per_doc: int = 30) -> None:
    """Both tools' loss gradient for one step's input, from one set of weights (the peer's initial draw
    at ``seed``): the split's first GRAD_SAMPLES conversations, ``per_doc`` anchors each among the
    positions whose block lies inside an answer (where both tools' anchor rules agree). Prints each
    tensor's cosine and norm ratio; the ratio should be the divisors' (the peer's label count over
    our position weights' sum) on every tensor."""
    from eagle3cli.train import dflash_loss
    from eagle3cli.train.batching import collate
    from eagle3cli.train.families import select_streams

    init = peer_init(t, seed, args, work, split) / DRAFT_FILE
    b = collate(t.store, [t.train_idx[j] for j in range(GRAD_SAMPLES)], args.max_length, True)
    aux = select_streams(b["aux"], t.columns, b["final"].shape[-1]).float()
    mask, lengths, blk = b["loss_mask"].bool(), b["attention_mask"].sum(1), args.block_size
    gen = torch.Generator().manual_seed(seed)
    oks = [[a for a in range(1, int(lengths[r]) - blk) if bool(mask[r, a:a + blk].all())] for r in range(GRAD_SAMPLES)]
    per_doc = min(per_doc, *map(len, oks))
    chosen = [sorted(ok[i] for i in torch.randperm(len(ok), generator=gen)[:per_doc].tolist()) for ok in oks]
    out = work / f"grad_check_s{seed}"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(chosen, out / "anchors.pt")
    if sh([args.peers_python, str(Path(__file__).resolve()), "--worker", "--grad-check", "--split", str(split),
           "--out", str(out), "--block-size", str(blk), "--draft-layers", str(args.draft_layers), "--seed",
           str(seed)], out / "peer.log"):
        raise SystemExit(f"speculators' gradient failed: see {out / 'peer.log'}")
    anchors = torch.tensor(chosen)
    real = torch.ones_like(anchors, dtype=torch.bool)
    used = dflash_loss.needed_positions(mask, lengths, anchors, real, blk)
    labels = dflash_loss.block_labels(dflash_loss.target_argmax(t.head, b["final"].float(), used), mask, lengths,
                                      anchors, real, blk)
    draft = with_weights(t.draft, init).train()
    for n, p in draft.named_parameters():
        p.requires_grad_(not n.startswith(FROZEN))
    out_loss = dflash_loss.DFlashLoss(draft, None, 0.5)(b["input_ids"], aux, anchors, labels).loss
    out_loss.backward()
    loss = out_loss.item()
    peer = torch.load(out / "grad.pt")
    print(f"seed {seed}: one step's input, {GRAD_SAMPLES} conversations x {per_doc} blocks of {blk}; loss ours "
          f"{loss:.4f}, peer {peer['loss']:.4f} (ratio {loss / peer['loss']:.4f})")
    print("| tensor | cosine | norm ours / peer |\n|---|---|---|")
    for n, p in draft.named_parameters():
        if p.grad is not None:
            q = peer["grads"][n]
            cos = float(torch.nn.functional.cosine_similarity(p.grad.flatten().double(), q.flatten().double(), dim=0))
            print(f"| {n} | {cos:.6f} | {float(p.grad.norm() / q.norm()):.4f} |")


def last_checkpoint(out: Path) -> Path | None:
    steps = sorted((out / "checkpoints").glob("step-*"))
    return steps[-1] / DRAFT_FILE if steps else None


def train_ours(name: str, seed: int, args, work: Path, split: Path, extra: list[str]) -> dict:
    """`eagle3 train --draft-type dflash` at its defaults; the weights from its export, or from its
    final checkpoint (written before the export) where the export is not there. ``--replay peer`` in
    the flags trains it on the packs and anchors of speculators' run at this seed (dflash_replay.py)."""
    out = work / name
    log = work / f"{name}.log"
    t0 = time.time()
    extra, packs = without_replay(extra, seed, args, work, split)
    cmd = [sys.executable, str(HERE / "dflash_replay.py"), "--packs", str(packs), "--"] if packs else [EAGLE3]
    rc = sh([*cmd, "train", "--store", args.store, "--model", args.model, "--out", str(out), "--draft-type", "dflash",
             "--block-size", str(args.block_size), "--draft-layers", str(args.draft_layers),
             "--max-tokens", str(args.tokens), "--max-steps", str(args.steps), "--epochs", "100000",
             "--val-fraction", str(args.val_fraction), "--seed", str(seed), "--max-length", str(args.max_length),
             "--log-every", "1", "--save-every", "100000", "--eval-every", "0", *extra], log)
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tokens_per_s" in r]
    weights = out / DRAFT_FILE if (out / DRAFT_FILE).exists() else last_checkpoint(out)
    if not steps or weights is None or steps[-1]["step"] != args.steps:
        raise SystemExit(f"eagle3 train did not reach step {args.steps} (rc {rc}): see {log}")
    return {"weights": str(weights), "rc": rc, "steps": steps[-1]["step"], "tokens": sum(r["tokens"] for r in steps),
            "cpu_s": sum(r["cpu_s"] for r in steps), "wall_s": sum(r["tokens"] / r["tokens_per_s"] for r in steps),
            "process_wall_s": time.time() - t0, "lrs": [r["lr"] for r in steps]}


def peer_steps(seed: int, args, work: Path, split: Path) -> Path:
    """The packs and anchors speculators' run at ``seed`` trains on (its Tape, drawn without
    training); checked against the run's own record where that run was made with one."""
    name = f"peer_packs_b{args.block_size}l{args.draft_layers}_t{args.tokens}_a{args.peer_anchors}_s{seed}"
    out = work / name
    packs = out / PACKS_FILE
    if not packs.exists() or len(json.loads(packs.read_text())) < args.steps:
        rc = sh([args.peers_python, str(Path(__file__).resolve()), "--worker", "--record-only", "--split", str(split),
                 "--out", str(out), "--steps", str(args.steps), "--tokens", str(args.tokens), "--block-size",
                 str(args.block_size), "--draft-layers", str(args.draft_layers), "--peer-anchors",
                 str(args.peer_anchors), "--seed", str(seed)], work / f"{name}.log")
        if rc:
            raise SystemExit(f"speculators' packs failed (rc {rc}): see {work / f'{name}.log'}")
    drawn = json.loads(packs.read_text())
    ran = work / run_name("speculators", seed, args) / PACKS_FILE
    if ran.exists():
        taken = json.loads(ran.read_text())
        if taken != drawn[:len(taken)]:
            raise SystemExit(f"{packs} differs from the steps its run took ({ran}): the draw is not the run's")
    return packs


def without_replay(extra: list[str], seed: int, args, work: Path, split: Path) -> tuple[list[str], Path | None]:
    """A run's flags less ``--replay peer``, and the recorded steps it asks for (None without it)."""
    if "--replay" not in extra:
        return extra, None
    i = extra.index("--replay")
    if extra[i + 1:i + 2] != ["peer"]:
        raise SystemExit("--replay takes one value: peer")
    return extra[:i] + extra[i + 2:], peer_steps(seed, args, work, split)


def train_peer(name: str, seed: int, args, work: Path, split: Path, lr: float, optimizer: str,
               loss: str = "ce") -> dict:
    out = work / name
    log = work / f"{name}.log"
    t0 = time.time()
    rc = sh([args.peers_python, str(Path(__file__).resolve()), "--worker", "--split", str(split), "--out", str(out),
             "--lr", str(lr), "--steps", str(args.steps), "--tokens", str(args.tokens), "--block-size",
             str(args.block_size), "--draft-layers", str(args.draft_layers), "--peer-anchors", str(args.peer_anchors),
             "--peer-optimizer", optimizer, "--peer-loss", loss, "--seed", str(seed), "--record"], log)
    if rc:
        raise SystemExit(f"speculators' run failed (rc {rc}): see {log}")
    res = json.loads((out / "result.json").read_text())
    return {"weights": str(out / DRAFT_FILE), "process_wall_s": time.time() - t0, **res}


def peer_init(t, seed: int, args, work: Path, split: Path) -> Path:
    """A draft directory holding the weights speculators' run at ``seed`` starts from (its worker
    draws them from the same torch seed), for ``--init-from peer``: both tools then train from one
    initialisation, so what differs between their drafts is the training alone."""
    from eagle3cli.publish.dflash_export import save_dflash

    name = f"peer_init_b{args.block_size}l{args.draft_layers}_s{seed}"  # the draw's shapes follow both
    out, raw, log = work / name, work / f"{name}_raw", work / f"{name}.log"
    if not (out / "config.json").exists():
        rc = sh([args.peers_python, str(Path(__file__).resolve()), "--worker", "--init-only", "--split", str(split),
                 "--out", str(raw), "--block-size", str(args.block_size), "--draft-layers", str(args.draft_layers),
                 "--seed", str(seed)], log)
        if rc:
            raise SystemExit(f"speculators' initial draft failed (rc {rc}): see {log}")
        save_dflash(with_weights(t.draft, raw / DRAFT_FILE), out, dtype=torch.float32)
    trained = work / run_name("speculators", seed, args) / DRAFT_FILE
    if trained.exists():  # the cached draft itself, so a run that reuses it is checked without the raw folder
        check_same_draw(out / DRAFT_FILE, trained)
    return out


def check_same_draw(init: Path, trained: Path, least: float = 0.5) -> None:
    """The redrawn weights must be the ones the peer's run started from: its trained matrices stay
    close to their initial draw in these short runs (correlation 0.96-0.9996 at 240 steps, about 0
    against another seed's), so a draw that a later speculators makes differently fails here."""
    from safetensors.torch import load_file

    a, b = load_file(str(init)), load_file(str(trained))
    for k, v in a.items():
        if v.dim() == 2:
            r = float(torch.corrcoef(torch.stack([v.flatten().float(), b[k].flatten().float()]))[0, 1])
            if r < least:
                raise SystemExit(f"{init}: {k} correlates {r:.3f} with the peer's trained {trained}: not the "
                                 f"draw its run started from")


def with_peer_init(extra: list[str], t, seed: int, args, work: Path, split: Path) -> list[str]:
    """``--init-from peer`` in a run's flags: the peer's initial draft at this seed."""
    return [str(peer_init(t, seed, args, work, split)) if x == "peer" and i and extra[i - 1] == "--init-from" else x
            for i, x in enumerate(extra)]


def check_conversion(t, name: str, work: Path, draft) -> float:
    """The peer's logits for fixed blocks of the first training sample against eagle3's forward of
    the converted draft on the same blocks: max |diff|."""
    from eagle3cli.train.families import select_streams

    chk = torch.load(work / name / "check.pt")
    s = t.store[t.train_idx[0]]
    n = min(int(s["input_ids"].numel()), t.crop)
    aux = select_streams(s["aux"][:n].float(), t.columns, int(draft.config.hidden_size))
    with torch.no_grad():
        ours = draft(aux[None], s["input_ids"][:n].long()[None], chk["anchors"][None])[0, :, 1:]
    return float((ours - chk["logits"]).abs().max())


def held_out_blocks(t, draft):
    """The scorer's held-out blocks, batch by batch: the draft's logits for the drafted positions
    [B, m, k, V], their labels (the target's greedy tokens) and which labels exist [B, m, k]. Every
    draft of a seed meets the same blocks in the same order (``evaluate``'s blocks and labels)."""
    from eagle3cli.train.batching import make_batches
    from eagle3cli.train.dflash_loss import IGNORE

    for idx in make_batches(t.val_idx, t.crop_lengths, t.cfg.max_tokens, t.cfg.seed, 0):
        (ids, aux, anchors, labels), _ = t._inputs(idx, held_out=True)
        yield draft(aux, ids, anchors)[:, :, 1:], labels, labels != IGNORE


@torch.no_grad()
def position_accuracy(t, draft) -> dict:
    """Per drafted position k, the share of held-out blocks whose token k is the target's greedy one,
    whatever tokens 1..k-1 were (on the same blocks and labels as ``evaluate``): unlike acc_k, every
    position rests on all the blocks. ``pos_blocks`` counts them (a label past the sequence is none),
    so seeds pool by blocks. ``hits`` and ``valid`` ([blocks, k], the same block order for every
    draft of a seed) pair two drafts block by block."""
    hits, valids = [], []
    for logits, labels, valid in held_out_blocks(t, draft):
        block = valid.any(-1)
        hits.append(((logits.argmax(-1) == labels) & valid)[block])
        valids.append(valid[block])
    hit, valid = torch.cat(hits), torch.cat(valids)
    n = valid.sum(0).float()
    return {"pos_acc": (hit.sum(0).float() / n.clamp_min(1)).tolist(), "pos_blocks": [int(x) for x in n.tolist()],
            "hits": hit, "valid": valid}


@torch.no_grad()
def calibration(t, draft) -> dict:
    """Per drafted position, on the scorer's held-out blocks: the mean cross-entropy of the target's
    greedy token under the draft, and the draft's mean top probability. Two drafts can rank one way by
    argmax accuracy and the other by cross-entropy; this shows which, and how sharp each one is."""
    k = t.cfg.block_size - 1
    ce, top, n = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64), torch.zeros(k)
    for logits, labels, valid in held_out_blocks(t, draft):
        logp = logits.float().log_softmax(-1)
        nll = -logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        ce += (nll * valid).sum((0, 1)).double()
        top += (logp.max(-1).values.exp() * valid).sum((0, 1)).double()
        n += valid.sum((0, 1))
    return {"pos_ce": (ce / n.clamp_min(1)).tolist(), "pos_top_p": (top / n.clamp_min(1)).tolist()}


def run_name(run: str, seed: int, args) -> str:
    """A run's name in --work: the tool or recipe, then what fixes its draft (steps, block, layers, seed)."""
    return f"{run}_{args.steps}s_b{args.block_size}l{args.draft_layers}_s{seed}"


def hits_file(work: Path, name: str, anchors: int) -> Path:
    return work / f"{name}.hits_a{anchors}.safetensors"


def save_hits(res: dict, path: Path) -> dict:
    """``res`` without its per-block tensors, which go to ``path`` (safetensors: no pickle to load)."""
    from safetensors.torch import save_file

    hit, valid = res.pop("hits"), res.pop("valid")
    save_file({"hit": hit.to(torch.uint8).contiguous(), "valid": valid.to(torch.uint8).contiguous()}, str(path))
    return res


def score(t, draft, hits: Path) -> dict:
    """``evaluate``'s acc_k and simulated tau, and every position's accuracy; the per-block hits to
    ``hits``."""
    res = t.evaluate(draft)
    return save_hits({"acc": [float(x) for x in res["acc"]], "tau_sim": float(res["tau_sim"]),
                      "blocks": res["positions"], **position_accuracy(t, draft)}, hits)


def split_runs(runs: str) -> list[str]:
    """--runs: by ';' when any run carries flags (flags hold commas), else by ','."""
    parts = runs.split(";") if "=" in runs else runs.split(",")
    out = [p.strip() for p in parts if p.strip()]
    for p in out:
        run = p.partition("=")[0]
        if "=" in p and not run.startswith("eagle3"):
            raise SystemExit(f"--runs: {run}: only eagle3's runs take flags (NAME=FLAGS, NAME starting with eagle3)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="eagle3 feature store holding DFlash's streams")
    ap.add_argument("--model", default=str(SMOLLM2))
    ap.add_argument("--work", default="runs/peer_dflash")
    ap.add_argument("--peers-python", default=str(Path("~/venvs/peers/bin/python").expanduser()))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=1024, help="token budget of one optimizer step")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--num-anchors", type=int, default=SCORE_ANCHORS,
                    help="held-out blocks per conversation the scorer draws (the same for every draft); a "
                         "value above any answer's length scores a block at every held-out answer position. "
                         "Scores at other values are kept in the run's json beside the default's")
    ap.add_argument("--peer-anchors", type=int, default=512, help="speculators' blocks per packed step (its default)")
    ap.add_argument("--peer-optimizer", default="muon", help="muon (its CLI's default) or adamw")
    ap.add_argument("--peer-loss", default="ce", help=argparse.SUPPRESS)  # speculators_kl: kl_div
    ap.add_argument("--lr", type=float, default=1e-3, help="both tools' default")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--paired", action="store_true",
                    help="score again the runs whose per-block hits were not kept (saved before they were), "
                         "so the pooled table pairs every run with the peer block by block")
    ap.add_argument("--calibration", action="store_true",
                    help="also print each draft's held-out cross-entropy and mean top probability per position")
    ap.add_argument("--runs", default="eagle3,speculators",
                    help="comma-separated: eagle3 (its defaults), speculators, speculators_adamw, speculators_kl "
                         "(its loss against the target's distribution, --loss-fn kl_div), eagle3_a256 "
                         "(eagle3 at --num-anchors 256), or NAME=FLAGS: eagle3 with more `eagle3 train` flags "
                         "(NAME starts with eagle3, e.g. 'eagle3_muon=--optimizer muon'; separate runs by ';' "
                         "when one is given so)")
    # the peer's side
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--split", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--grad-check", action="store_true",
                    help="train nothing: compare both tools' loss gradient on one step's input from one set of "
                         "weights (the peer's initial draw at each seed), tensor by tensor")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    torch.set_num_threads(1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        # the split follows the seed (eagle3's split_indices): each seed's runs train and score on its own
        t = scorer(args, work, seed)
        split = work / f"split_s{seed}"
        if not (split / "meta.json").exists():
            export_split(t, split, args)
        if args.grad_check:
            grad_check(t, seed, args, work, split)
            continue
        for spec in split_runs(args.runs):
            run, _, flags = spec.partition("=")
            name = run_name(run, seed, args)
            res_file = work / f"{name}.json"
            hits = hits_file(work, name, args.num_anchors)
            if res_file.exists():
                res = json.loads(res_file.read_text())
                # scored before the unconditional accuracy was added (a run first scored at another
                # --num-anchors has no default score yet: it is made when the default is asked for)
                if "pos_acc" not in res and args.num_anchors == SCORE_ANCHORS:
                    res.update(score(t, with_weights(t.draft, Path(res["weights"])), hits))
                    res_file.write_text(json.dumps(res))
                if args.num_anchors != SCORE_ANCHORS:  # another scoring: kept beside the default one
                    key = f"score_a{args.num_anchors}"
                    if key not in res:
                        res[key] = score(t, with_weights(t.draft, Path(res["weights"])), hits)
                        res_file.write_text(json.dumps(res))
                    res = {**res, **res[key]}
                if args.paired and not hits.exists():  # scored before the per-block hits were kept
                    save_hits(position_accuracy(t, with_weights(t.draft, Path(res["weights"]))), hits)
            else:
                if run.startswith("eagle3"):
                    extra = ["--num-anchors", "256"] if run == "eagle3_a256" else shlex.split(flags)
                    extra = with_peer_init(extra, t, seed, args, work, split)
                    res = train_ours(name, seed, args, work, split, extra)
                else:
                    opt = "adamw" if run == "speculators_adamw" else args.peer_optimizer
                    loss = "kl_div" if run == "speculators_kl" else "ce"
                    res = train_peer(name, seed, args, work, split, args.lr, opt, loss)
                draft = with_weights(t.draft, Path(res["weights"]))
                if not run.startswith("eagle3"):
                    res["conversion_max_abs_diff"] = check_conversion(t, name, work, draft)
                    if res["conversion_max_abs_diff"] > 1e-3:
                        raise SystemExit(f"{name}: the converted draft's logits differ from the peer's by "
                                         f"{res['conversion_max_abs_diff']:.3g}")
                scored = score(t, draft, hits)
                res.update(scored if args.num_anchors == SCORE_ANCHORS else {f"score_a{args.num_anchors}": scored})
                res_file.write_text(json.dumps(res))
                res = {**res, **scored}
            if args.calibration:
                res.update(calibration(t, with_weights(t.draft, Path(res["weights"]))))
            res["val_conversations"] = len(t.val_idx)
            res["hits_file"] = str(hits)  # in memory only: the pooled table pairs the drafts by it
            rows.append((run, seed, res))
            print(f"{name}: acc {[round(x, 4) for x in res['acc']]}, tau_sim {res['tau_sim']:.3f}, "
                  f"cpu {res['cpu_s']:.0f} s", flush=True)
    if not rows:  # --grad-check prints its own tables
        return
    k = args.block_size - 1
    print(f"\n{args.steps} steps x {args.tokens} tokens, block {args.block_size}, {args.draft_layers} draft layer(s), "
          f"streams {list(t.layer_ids)}, MASK {t.draft.config.mask_token_id}, one thread; held-out: "
          f"{rows[0][2]['val_conversations']} conversations, {rows[0][2]['blocks']} blocks\n")
    # acc_k (k >= 2) is conditional on tokens 1..k-1 accepted, so it rests on the blocks that got that
    # far: each cell gives acc_k and, after the slash, about how many held-out blocks it rests on
    # (blocks x acc_1 x .. x acc_{k-1}; blocks whose label at k falls past the sequence are not counted).
    print("| tool | seed | tokens | train CPU-s | " + " | ".join(f"acc_{i} / blocks" for i in range(1, k + 1))
          + " | tau_sim |")
    print("|---|---|---|---|" + "---|" * k + "---|")
    for run, seed, res in rows:
        reach, cells = float(res["blocks"]), []
        for x in res["acc"]:
            cells.append(f"{x:.3f} / ~{round(reach)}")
            reach *= x
        print(f"| {run} | {seed} | {res['tokens']} | {res['cpu_s']:.0f} | " + " | ".join(cells)
              + f" | {res['tau_sim']:.3f} |")
    print("\nEvery position on every block (token k right whatever tokens 1..k-1 were):\n")
    print("| tool | seed | " + " | ".join(f"pos_{i}" for i in range(1, k + 1)) + " |")
    print("|---|---|" + "---|" * k)
    for run, seed, res in rows:
        print(f"| {run} | {seed} | " + " | ".join(f"{x:.3f}" for x in res["pos_acc"]) + " |")
    if args.calibration:
        print_calibration(rows, k)
    if len({seed for _, seed, _ in rows}) > 1:
        print_pooled(rows, k)
        print_seed_leads(rows, k)


def print_calibration(rows, k: int) -> None:
    """``calibration`` per run and seed: cross-entropy, then the mean top probability."""
    print("\nHeld-out cross-entropy of the target's greedy token (nats) / the draft's mean top probability:\n")
    print("| tool | seed | " + " | ".join(f"pos_{i}" for i in range(1, k + 1)) + " |")
    print("|---|---|" + "---|" * k)
    for run, seed, res in rows:
        print(f"| {run} | {seed} | " + " | ".join(f"{c:.2f} / {p:.3f}" for c, p in zip(res["pos_ce"], res["pos_top_p"]))
              + " |")


def pooled(rows, k: int) -> dict[str, tuple[list[float], list[int]]]:
    """Per run, pos_k over the blocks of every seed it ran on: (accuracies, block counts)."""
    hits: dict[str, list[float]] = {}
    blocks: dict[str, list[int]] = {}
    for run, _, res in rows:
        n = res.get("pos_blocks") or [int(res["blocks"])] * k  # runs scored before the counts were kept
        h, b = hits.setdefault(run, [0.0] * k), blocks.setdefault(run, [0] * k)
        for i in range(k):
            h[i] += res["pos_acc"][i] * n[i]
            b[i] += n[i]
    return {run: ([h / max(n, 1) for h, n in zip(hits[run], blocks[run])], blocks[run]) for run in hits}


def with_peer(rows, run: str) -> list[tuple[dict, dict | None]]:
    """``run``'s result at each seed it ran on, beside the peer's at that seed (None where it has none)."""
    peer = {seed: res for r, seed, res in rows if r == "speculators"}
    return [(res, peer.get(seed)) for r, seed, res in rows if r == run]


def paired_lead(rows, run: str) -> tuple[list[float], list[float]] | None:
    """``run``'s lead over the peer per position, pooled over the seeds both were scored on, and its
    standard error paired block by block (both drafts meet the same blocks, whose hits correlate);
    None where a seed lacks either's per-block hits."""
    from safetensors.torch import load_file

    diffs, valids = [], []
    for res, peer in with_peer(rows, run):
        if peer is None:
            return None
        paths = Path(res["hits_file"]), Path(peer["hits_file"])
        if not all(p.exists() for p in paths):
            return None
        ours, theirs = (load_file(str(p)) for p in paths)
        if not torch.equal(ours["valid"], theirs["valid"]):
            return None
        diffs.append(ours["hit"].float() - theirs["hit"].float())
        valids.append(ours["valid"].bool())
    if not diffs:
        return None
    d, v = torch.cat(diffs), torch.cat(valids)
    n = v.sum(0).float().clamp_min(2)
    mean = (d * v).sum(0) / n
    var = ((d - mean) ** 2 * v).sum(0) / (n - 1)
    return mean.tolist(), (var / n).sqrt().tolist()


def seed_lead(rows, run: str) -> tuple[list[float], list[float], list[int], int] | None:
    """``run``'s lead over the peer per position, seed by seed: the mean of (ours - peer) over the
    seeds both ran on, its standard error from the seeds' spread (None under three seeds: two seeds'
    spread is one degree of freedom), and at how many seeds ours is at least the peer. Unlike the
    paired-by-block error, this one holds the training's own randomness (initialisation, anchors,
    order), which one seed's blocks cannot show."""
    diffs = [[a - b for a, b in zip(res["pos_acc"], peer["pos_acc"])]
             for res, peer in with_peer(rows, run) if peer is not None]
    if not diffs:
        return None
    d = torch.tensor(diffs, dtype=torch.float64)
    se = (d.std(0) / len(diffs) ** 0.5).tolist() if len(diffs) > 2 else None
    return d.mean(0).tolist(), se, (d >= 0).sum(0).tolist(), len(diffs)


def print_seed_leads(rows, k: int) -> None:
    """Each of ours' lead over the peer, seed by seed (``seed_lead``)."""
    runs = [r for r in dict.fromkeys(r for r, _, _ in rows) if r != "speculators"]
    leads = {r: seed_lead(rows, r) for r in runs}
    if not any(leads.values()):
        return
    print("\nLead over speculators seed by seed (mean of ours - peer over the seeds; after the slash, in "
          "standard errors of that mean from the seeds' spread where three or more ran, then the seeds at "
          "which ours is at least the peer):\n")
    print("| tool | seeds | " + " | ".join(f"pos_{i}" for i in range(1, k + 1)) + " |")
    print("|---|---|" + "---|" * k)
    for run, lead in leads.items():
        if lead is None:
            continue
        mean, se, ahead, n = lead
        cells = [f"{m:+.4f}" + (f" / {m / s:+.1f}" if se and s > 0 else "") + f" / {a}/{n}"
                 for m, s, a in zip(mean, se or [0.0] * k, ahead)]
        print(f"| {run} | {n} | " + " | ".join(cells) + " |")


def print_pooled(rows, k: int) -> None:
    """Every run pooled over its seeds; beside each of ours, its lead over the peer in standard errors:
    paired block by block where both drafts' per-block hits were kept (marked p), else the unpaired
    binomial error, sqrt(p(1-p)/n) of each added in quadrature, which overstates the noise of a lead
    on shared blocks (marked u)."""
    pools = pooled(rows, k)
    peer = pools.get("speculators")
    seeds = sorted({seed for _, seed, _ in rows})
    print(f"\nPooled over seeds {','.join(map(str, seeds))} (each seed's blocks counted once; after the slash, "
          "the lead over speculators in standard errors, p paired, u unpaired):\n")
    print("| tool | " + " | ".join(f"pos_{i}" for i in range(1, k + 1)) + " |")
    print("|---|" + "---|" * k)
    for run, (acc, n) in pools.items():
        paired = paired_lead(rows, run) if peer is not None and run != "speculators" else None
        cells = []
        for i in range(k):
            cell = f"{acc[i]:.4f}"
            if paired is not None:
                lead, se = paired[0][i], paired[1][i]
                cell += f" / {lead / se:+.1f}p" if se > 0 else ""
            elif peer is not None and run != "speculators":
                pa, na = peer[0][i], peer[1][i]
                se = (acc[i] * (1 - acc[i]) / max(n[i], 1) + pa * (1 - pa) / max(na, 1)) ** 0.5
                cell += f" / {(acc[i] - pa) / se:+.1f}u" if se > 0 else ""
            cells.append(cell)
        print(f"| {run} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
