"""eagle3's trainer against speculators' and SpecForge's on the same feature store and budget.

    bash benchmarks/setup_peers.sh                      # the peers' own venv (~/venvs/peers, CPU torch)
    python benchmarks/peer_trainers.py --data STORE --work runs/peers   # no --data: builds a GSM8K store
    python benchmarks/peer_trainers.py --work runs/peers --ablate --ablate-lr 1e-3

Every tool trains a one-layer EAGLE-3 draft of the store's target for the same number of optimizer
steps of the same token budget (--steps x --tokens: eagle3's --max-tokens of padded tokens, the
packed sequence length of speculators, the padded batch of SpecForge), TTT --ttt-steps, the same
draft vocabulary (the --draft-vocab eagle3 picks from the store, handed to the peers as d2t/t2d),
AdamW, one thread each, on the training split eagle3 uses (its held-out split is left out of
everyone's data). The peers compute in fp32 (their autocast is for GPUs); eagle3 runs in its CPU
default (bf16 autocast where the CPU has native bf16) and in fp32. Each tool keeps its own loss,
step weights, norms, init, schedule and batching; the learning rate is ours (1e-4) and, where the
tool recommends another, that one too (and ours at it, so the lr is not mistaken for the rest).
``--ablate`` trains eagle3 with the peer's choices that it has flags for, one at a time.

The peers run in their own venv (their declared dependencies pull a CUDA torch): speculators'
Trainer with two device stubs (it moves batches with ``.to(local_rank)`` and times steps with an
accelerator synchronize) and its eager loss; SpecForge's OnlineEagle3Model with its step weights,
BF16Optimizer (fp32 master weights) and schedule, its Triton loss replaced by its own reference
formula. The store is adapted in memory to each one's sample format (speculators: a BaseDataset
of hidden_states / verifier_last_hidden_states, packed by its CollateFn and Multipack sampler;
SpecForge: its offline sample normaliser and padding collator). The store holds the target's
final-normed state (what the LM head reads); speculators' teacher applies the target's norm to a
pre-norm state, so its verifier norm is an identity here.

Each draft is converted with ``eagle3 convert --to ours`` and scored the same way: held-out
acceptance per position (the trainer's validation on eagle3's held-out split), and tau measured
by our lossless generator on the first --prompts mt_bench questions (chain 3 and tree) and GSM8K
test questions (chain 3, in the store's domain), --new-tokens each (``benchmarks/chain_tau.py``:
``eagle3 eval``'s speculative decode without its two plain baselines). Prints one table;
tokens/s is wall-clock, tokens per CPU-second is the training loop's process time (the cores are
shared), CPU-min is the whole training process's (setup included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "data" / "eval"
SMOLLM2 = Path("~/.cache/eagle3/models/SmolLM2-135M-Instruct").expanduser()
EAGLE3 = str(Path(sys.executable).parent / "eagle3")  # the project's CLI, beside its python
RECOMMENDED_LR = {"speculators": 1e-3, "specforge": 1e-4}  # each peer's default


# ---------------------------------------------------------------- the peers' side (their venv)

def load_split(path: Path) -> tuple[list[dict], dict]:
    """The exported training split: per-sample tensors and the shared settings."""
    from safetensors.torch import load_file

    flat = load_file(str(path / "train.safetensors"))
    meta = json.loads((path / "meta.json").read_text())
    samples = [{k: flat[f"{i}.{k}"] for k in ("input_ids", "loss_mask", "aux", "final")}
               for i in range(meta["samples"])]
    return samples, meta


def store_dataset(base: type, samples: list[dict]) -> type:
    """speculators' dataset (``base``: its BaseDataset, importable only in the peers' venv) over the
    exported split, under the key names its collators read; its EAGLE-3 and DFlash trainers share it."""

    class StoreDataset(base):
        def _compute_approx_lengths(self):
            return [int(s["input_ids"].numel()) for s in samples]

        def _get_raw_data(self, i):
            s = samples[i]
            return {"hidden_states": s["aux"].float(), "input_ids": s["input_ids"].long(),
                    "verifier_last_hidden_states": s["final"].float(), "loss_mask": s["loss_mask"].bool()}

        def __len__(self):
            return len(samples)

    return StoreDataset


def record_lr(optimizer) -> list[float]:
    """The learning rate of each optimizer step, as it was applied (read after the step, before
    the scheduler moves it on): a post-step hook, so every tool is logged the same way."""
    lrs: list[float] = []
    optimizer.register_step_post_hook(lambda opt, *_: lrs.append(float(opt.param_groups[0]["lr"])))
    return lrs


def counted(loader, field: str):
    """The loader, counting the real tokens of the batches it hands out (``counted.tokens``)."""

    class Counted:
        tokens = 0
        batch_sampler = getattr(loader, "batch_sampler", None)

        def __len__(self):
            return len(loader)

        def __iter__(self):
            for batch in loader:
                Counted.tokens += int(field(batch))
                yield batch

    return Counted()


def run_speculators(split: Path, out: Path, lr: float, steps: int, tokens: int, ttt: int) -> dict:
    import speculators.train.trainer as st
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import BaseDataset
    from speculators.train.dataloader import _setup_dataloader
    from transformers import AutoConfig

    torch.accelerator.synchronize = lambda *a, **k: None  # stub 1: the step timer's synchronize
    st.get_local_rank = lambda: "cpu"  # stub 2: batches and the model go .to(local_rank)
    samples, meta = load_split(split)

    StoreDataset = store_dataset(BaseDataset, samples)
    vcfg = AutoConfig.from_pretrained(meta["model"])
    vcfg.num_hidden_layers = 1
    vocab = torch.load(split / "vocab.pt")
    model = Eagle3DraftModel.from_training_args(
        verifier_config=vcfg, t2d=vocab["t2d"], d2t=vocab["d2t"], draft_vocab_size=meta["draft_vocab"],
        norm_before_residual=True, norm_before_fc=True, norm_output=True,  # its eagle3 defaults
        ttt_steps=ttt, verifier_name_or_path=meta["model"], target_layer_ids=meta["layers"],
        draft_attn_impl="sdpa")
    model.verifier_norm = torch.nn.Identity()  # the store's final state is already normed
    train_kw, _ = Eagle3DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                      ttt_steps=ttt, ttt_step_loss_decay=1.0)
    ds = StoreDataset(max_len=tokens, hidden_states_dtype=torch.float32)
    loader = counted(_setup_dataloader(ds, total_seq_len=tokens, hidden_size=vcfg.hidden_size, num_workers=0,
                                       preprocess=shift_batch, seed=0),
                     lambda b: (b["document_ids"] != -1).sum())
    cfg = st.TrainerConfig(lr=lr, num_epochs=1, save_path=str(out / "ckpt"), optimizer="adamw",
                           train_call_kwargs=train_kw, hidden_states_dtype=torch.float32,
                           log_freq=10 ** 9, max_steps=steps, scheduler_total_steps=steps)
    trainer = st.Trainer(model, cfg, loader, None)
    lrs = record_lr(trainer.optimizers[0])
    t0, c0 = time.time(), time.process_time()
    epoch = 0
    while trainer.global_step < steps:
        trainer.train_epoch(epoch)
        epoch += 1
    wall, cpu = time.time() - t0, time.process_time() - c0
    model.save_pretrained(str(out / "draft"))
    return {"steps": trainer.global_step, "tokens": loader.tokens, "wall_s": wall, "cpu_s": cpu, "lrs": lrs}


def specforge_batches(samples: list[dict], tokens: int, seed: int) -> list[list[int]]:
    """Shuffled conversations grouped while batch size x longest length stays within ``tokens``
    (SpecForge pads a batch to its longest sample)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(samples), generator=g).tolist()
    batches, cur, longest = [], [], 0
    for i in order:
        n = min(int(samples[i]["input_ids"].numel()), tokens)
        if cur and max(longest, n) * (len(cur) + 1) > tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return batches + ([cur] if cur else [])


def reference_loss_module():
    """specforge.core.loss without Triton: LogSoftmaxLoss.apply as its own reference formula
    (``_compute_loss``: -sum(position_mask * target_p * log_softmax(logits)) averaged over positions)."""
    import types

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            logp = torch.nn.functional.log_softmax(logits.float(), dim=2)
            return -torch.sum(position_mask * target_p * logp, 2).mean()

    mod = types.ModuleType("specforge.core.loss")
    mod.LogSoftmaxLoss = LogSoftmaxLoss
    return mod


def run_specforge(split: Path, out: Path, lr: float, steps: int, tokens: int, ttt: int) -> dict:
    sys.modules["specforge.core.loss"] = reference_loss_module()
    from safetensors.torch import load_file
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from transformers import LlamaConfig

    samples, meta = load_split(split)
    cfg = LlamaConfig.from_pretrained(meta["model"])
    cfg.num_hidden_layers, cfg.draft_vocab_size, cfg.tie_word_embeddings = 1, meta["draft_vocab"], False
    draft = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
    weights = load_file(str(Path(meta["model"]) / "model.safetensors"))
    draft.embed_tokens.weight.data.copy_(weights["model.embed_tokens.weight"])
    draft.freeze_embedding()
    vocab = torch.load(split / "vocab.pt")
    draft.d2t.copy_(vocab["d2t"])
    draft.t2d.copy_(vocab["t2d"])
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # TargetHead: the target's LM head
    head.weight.data.copy_(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))
    head.requires_grad_(False)
    model = OnlineEagle3Model(draft, length=ttt, attention_backend="sdpa")
    opt = BF16Optimizer(draft, lr=lr, max_grad_norm=0.5, total_steps=steps, warmup_ratio=0.015)
    lrs = record_lr(opt.optimizer)
    collate = DataCollatorWithPadding()
    raw = [{"aux_hidden_state": s["aux"].float()[None], "hidden_state": s["final"].float()[None],
            "input_ids": s["input_ids"].long(), "loss_mask": s["loss_mask"].long()} for s in samples]
    seen, step, epoch = 0, 0, 0
    t0, c0 = time.time(), time.process_time()
    while step < steps:
        for idx in specforge_batches(samples, tokens, seed=epoch):
            if step >= steps:
                break
            b = collate([normalize_offline_sample(raw[i], tokens) for i in idx])
            seen += int(b["attention_mask"].sum())
            # TargetHead.preprocess: input ids and the target's final state shifted left by one,
            # the teacher its LM head over that state (normalize_offline_sample: "hidden_state" is
            # the aux streams, "target" the final state)
            ids = torch.cat([b["input_ids"][:, 1:], torch.zeros_like(b["input_ids"][:, :1])], 1)
            tgt = torch.cat([b["target"][:, 1:], torch.zeros_like(b["target"][:, :1])], 1)
            with torch.no_grad():
                target = head(tgt)
            plosses, *_ = model(input_ids=ids, attention_mask=b["attention_mask"], target=target,
                                loss_mask=b["loss_mask"][..., None], hidden_states=b["hidden_state"])
            loss = sum(0.8 ** i * p for i, p in enumerate(plosses))  # Eagle3TrainStrategy's ploss_decay
            loss.backward()
            opt.step()
            step += 1
        epoch += 1
    wall, cpu = time.time() - t0, time.process_time() - c0
    save_specforge(draft, cfg, out / "draft")
    return {"steps": step, "tokens": seen, "wall_s": wall, "cpu_s": cpu, "lrs": lrs}


def save_specforge(draft, cfg, out: Path):
    """SpecForge's export layout (export/to_sglang.py): its module names, no embedding."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
    save_file(state, str(out / "model.safetensors"))
    conf = cfg.to_dict()
    conf.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1)
    (out / "config.json").write_text(json.dumps(conf, indent=2))


def worker(args) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    run = {"speculators": run_speculators, "specforge": run_specforge}[args.worker]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(Path(args.split), out, args.lr, args.steps, args.tokens, args.ttt_steps)
    (out / "result.json").write_text(json.dumps(res))
    print(json.dumps(res))


# ---------------------------------------------------------------- our side (the project's venv)

def child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def nice_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
            "PYTHONPATH": str(HERE.parent)}


def sh(cmd: list[str], log: Path) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(["nice", "-n", "5", *cmd], stdout=f, stderr=subprocess.STDOUT, env=nice_env()).returncode
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}; see {log}")


def export_split(store_dir: str, out: Path, draft: Path, args) -> None:
    """eagle3's training split of the store (same seed and held-out share as its trainer) and the
    draft vocabulary it chose, as one safetensors file the peers' venv reads without eagle3."""
    from safetensors.torch import load_file, save_file

    from eagle3cli.data.features import FeatureStore
    from eagle3cli.train.batching import split_indices

    store = FeatureStore(store_dir)
    train_idx, _ = split_indices(len(store), args.val_fraction, args.seed)
    flat = {}
    for j, i in enumerate(train_idx):
        s = store[i]
        n = min(int(s["input_ids"].numel()), args.max_length)
        flat.update({f"{j}.input_ids": s["input_ids"][:n].contiguous(),
                     f"{j}.loss_mask": s["loss_mask"][:n].to(torch.uint8),
                     f"{j}.aux": s["aux"][:n].contiguous(), f"{j}.final": s["final"][:n].contiguous()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(flat, str(out / "train.safetensors"))
    w = load_file(str(draft / "model.safetensors"))
    torch.save({"d2t": w["d2t"].long(), "t2d": w["t2d"].bool()}, out / "vocab.pt")
    (out / "meta.json").write_text(json.dumps({"samples": len(train_idx), "model": args.model,
                                               "draft_vocab": int(w["d2t"].numel()),
                                               "layers": list(store.meta.layer_ids)}))


def train_ours(name: str, lr: float, args, work: Path, precision: str = "auto", extra: tuple = ()) -> dict:
    out = work / name
    c0, t0 = child_cpu_s(), time.time()
    sh([EAGLE3, "train", "--store", args.data, "--model", args.model, "--out", str(out),
        "--recipe", "none", "--device", "cpu", "--ttt-steps", str(args.ttt_steps), "--draft-vocab-size",
        str(args.draft_vocab), *(("--lr", str(lr)) if lr else ()), "--max-tokens", str(args.tokens),
        "--max-steps", str(args.steps),
        "--epochs", "100", "--val-fraction", str(args.val_fraction), "--seed", str(args.seed),
        "--max-length", str(args.max_length), "--log-every", "1", "--save-every", "100000",
        "--mixed-precision", precision, *extra], work / f"{name}.log")
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tokens_per_s" in r]
    lrs = [r["lr"] for r in recs if "lr" in r]
    tokens = sum(r["tokens"] for r in steps)
    train_wall = sum(r["tokens"] / r["tokens_per_s"] for r in steps)
    return {"dir": out, "tokens": tokens, "wall_s": train_wall, "cpu_s": sum(r["cpu_s"] for r in steps), "lrs": lrs,
            "process_cpu_s": child_cpu_s() - c0, "process_wall_s": time.time() - t0}


def train_peer(tool: str, name: str, lr: float, args, work: Path, split: Path) -> dict:
    out = work / name
    c0, t0 = child_cpu_s(), time.time()
    sh([args.peers_python, str(Path(__file__).resolve()), "--worker", tool, "--split", str(split), "--out", str(out),
        "--lr", str(lr), "--steps", str(args.steps), "--tokens", str(args.tokens), "--ttt-steps", str(args.ttt_steps)],
       work / f"{name}.log")
    res = json.loads((out / "result.json").read_text())
    res.update(process_cpu_s=child_cpu_s() - c0, process_wall_s=time.time() - t0)  # training, not conversion
    conv = work / f"{name}_ours"
    sh([EAGLE3, "convert", str(out / "draft"), "--to", "ours", "--out", str(conv),
        "--model", args.model, "--layers", ",".join(map(str, json.loads((split / "meta.json").read_text())["layers"]))],
       work / f"{name}.log")
    return {"dir": conv, **res}


def held_out(draft: Path, args, work: Path) -> list[float]:
    """Per-position acceptance on eagle3's held-out split: the trainer's own validation, run on the
    converted draft (--init-from, its vocabulary kept) before any step."""
    import shutil

    from eagle3cli.config.train_config import TrainConfig
    from eagle3cli.train.trainer import Trainer

    out = work / "_score"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(data=args.data, model=args.model, out=str(out), device="cpu", init_from=str(draft),
                      init_vocab="keep", ttt_steps=args.ttt_steps, draft_vocab_size=str(args.draft_vocab),
                      max_tokens=args.tokens, max_length=args.max_length, val_fraction=args.val_fraction,
                      seed=args.seed)
    t = Trainer(cfg, quiet=True)
    t.setup()
    return [float(a) for a in t.evaluate(t.draft)["acc"]]


def eval_tau(draft: Path, prompts: str, mode: str, args, work: Path) -> float:
    """Measured tau of our lossless generator (benchmarks/chain_tau.py: the decode `eagle3 eval`
    runs, without its two plain baselines) on the first --prompts first turns of a turns file."""
    out = work / f"_tau_{draft.name}_{Path(prompts).stem}_{mode}.json"
    sh([sys.executable, str(HERE / "chain_tau.py"), "--model", args.model, "--draft", str(draft), "--prompts", prompts,
        "--limit", str(args.prompts), "--max-turns", str(args.max_turns), "--max-new-tokens", str(args.new_tokens),
        "--mode", mode, "--steps", "3",
        "--json-out", str(out)], work / f"_tau_{draft.name}.log")
    return float(json.loads(out.read_text())["tau"])


# speculators' choices that eagle3 train has flags for (its eagle3 defaults: every TTT step
# weighted 1.0, RMSNorm over the concatenated streams before fc and on the attention residual,
# AdamW weight decay 0.01, and the LM head loaded from the target's rows of the draft vocabulary
# and frozen: load_verifier_weights), one at a time and together.
ABLATION = {
    "ours": (),
    "step weights 1.0": ("--step-decay", "1.0"),
    "norms": ("--norm-before-fc", "--norm-before-residual"),
    "norm before fc": ("--norm-before-fc",),
    "residual norm": ("--norm-before-residual",),
    "weight decay 0.01": ("--weight-decay", "0.01"),
    "all three": ("--step-decay", "1.0", "--norm-before-fc", "--norm-before-residual", "--weight-decay", "0.01"),
    "target's head, frozen": ("--warm-start", "head", "--freeze-head"),
    "target's head, frozen + norms": ("--warm-start", "head", "--freeze-head", "--norm-before-fc",
                                      "--norm-before-residual"),
    # norm_output (the normed stream fed to the next step) only comes with eagle3.1's fc_norm here
    "eagle3.1 (norm_output)": ("--variant", "eagle3.1"),
    "eagle3.1 + residual norm": ("--variant", "eagle3.1", "--norm-before-residual"),
    "closest to speculators": ("--variant", "eagle3.1", "--norm-before-residual", "--step-decay", "1.0",
                               "--weight-decay", "0.01", "--warm-start", "head", "--freeze-head"),
}


def ablation(args, work: Path) -> None:
    """eagle3 train with each of speculators' choices at --ablate-lr; held-out acc of the end."""
    print(f"| eagle3 train at lr {args.ablate_lr:g} with | held-out acc_0 | acc_1 | acc_2 | tokens/CPU-s |")
    print("|---|---|---|---|---|")
    for label, flags in ABLATION.items():
        if args.ablate_only and label not in args.ablate_only.split(";"):
            continue
        name = f"ablate_{args.ablate_lr:g}_" + "".join(c for c in label.replace(" ", "_") if c not in ".,'+")
        res_file = work / f"{name}.json"
        if not res_file.exists():
            res = train_ours(name, args.ablate_lr, args, work, "auto", flags)
            recs = [json.loads(x) for x in (res["dir"] / "train_log.jsonl").read_text().splitlines()]
            res["acc"] = [r["val"]["acc"] for r in recs if "val" in r][-1]  # the trainer's validation, as held_out
            res_file.write_text(json.dumps({**res, "dir": str(res["dir"])}))
        res = json.loads(res_file.read_text())
        a = " | ".join(f"{x:.3f}" for x in res["acc"][:3])
        print(f"| {label} (`{' '.join(flags)}`) | {a} | {res['tokens'] / res['cpu_s']:.0f} |", flush=True)


def runs(args) -> list[tuple[str, str, float | None, str]]:
    """(tool, name, lr, eagle3 precision): every tool at its own defaults (lr None: eagle3's own
    default), then each at the others' default lr, so the lr is not mistaken for the rest. The
    peers train in fp32 here (speculators' autocast is CUDA-only; SpecForge's model is fp32 unless
    cast), eagle3 in its CPU default (bf16 autocast where the CPU has native bf16) and, with
    --eagle3-precision no, in fp32 too."""
    from eagle3cli.config.train_config import TrainConfig

    ours = TrainConfig().lr
    out = [("eagle3", "eagle3_default", None, "auto")]
    out += [("eagle3", f"eagle3_default_{p}", None, p) for p in args.eagle3_precision if p != "auto"]
    for tool in args.tools:
        if tool == "eagle3":
            continue
        out.append((tool, f"{tool}_default", RECOMMENDED_LR[tool], ""))
        if RECOMMENDED_LR[tool] != ours:
            out.append((tool, f"{tool}_lr{ours:g}", ours, ""))
            if not any(r[1] == f"eagle3_lr{RECOMMENDED_LR[tool]:g}" for r in out):
                out.append(("eagle3", f"eagle3_lr{RECOMMENDED_LR[tool]:g}", RECOMMENDED_LR[tool], "auto"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="eagle3 feature store (default: build 300 GSM8K conversations)")
    ap.add_argument("--model", default=str(SMOLLM2))
    ap.add_argument("--work", default="runs/peers")
    ap.add_argument("--peers-python", default=str(Path("~/venvs/peers/bin/python").expanduser()),
                    help="python of the venv benchmarks/setup_peers.sh made")
    ap.add_argument("--tools", default="eagle3,speculators,specforge")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=1, help="turns of each prompt decoded (mt_bench has 2)")
    ap.add_argument("--taus", default="mt_bench:chain,mt_bench:tree,gsm8k:chain",
                    help="the taus scored, comma-separated FILE:MODE (FILE mt_bench or gsm8k, MODE chain or tree)")
    ap.add_argument("--mt-bench", default=str(SHARED / "mt_bench.jsonl"), help="turns file for mt_bench tau")
    ap.add_argument("--gsm8k", default=str(SHARED / "gsm8k.jsonl"), help="turns file for in-domain tau (GSM8K test)")
    ap.add_argument("--eagle3-precision", default="auto,no",
                    help="eagle3 train --mixed-precision values to run at our lr (auto: its CPU default)")
    ap.add_argument("--ablate", action="store_true", help="only the ablation of speculators' choices in eagle3")
    ap.add_argument("--ablate-lr", type=float, default=1e-4)
    ap.add_argument("--ablate-only", help="';'-separated ablation labels to run (default: all)")
    ap.add_argument("--skip-train", action="store_true", help="score the drafts already in --work")
    ap.add_argument("--only", help="comma-separated run names to run (e.g. speculators_default,specforge_lr0.001)")
    # the peers' side
    ap.add_argument("--worker", choices=["speculators", "specforge"], help=argparse.SUPPRESS)
    ap.add_argument("--split", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    torch.set_num_threads(1)
    args.tools = args.tools.split(",")
    args.eagle3_precision = args.eagle3_precision.split(",")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.data:
        sys.path.insert(0, str(HERE))
        from train_throughput import build_store
        store = work / "store"
        args.data = str(store if (store / "manifest.json").exists() else build_store(Path(args.model), store, 300))
    if args.ablate:
        return ablation(args, work)
    rows = []
    split = work / "split"
    from eagle3cli.config.train_config import TrainConfig

    ours_lr = TrainConfig().lr
    for tool, name, lr, precision in runs(args):
        if args.only and name not in args.only.split(","):
            continue
        res_file = work / f"{name}.json"
        if args.skip_train and res_file.exists():
            res = json.loads(res_file.read_text())
            res["dir"] = Path(res["dir"])
        else:
            if tool == "eagle3":
                res = train_ours(name, lr, args, work, precision)
                if not (split / "meta.json").exists():
                    export_split(args.data, split, res["dir"], args)
            else:
                res = train_peer(tool, name, lr, args, work, split)
            res_file.write_text(json.dumps({**res, "dir": str(res["dir"])}))
        if "acc" not in res:  # scores are kept beside the run, so --skip-train only scores what is new
            res["acc"] = held_out(res["dir"], args, work)
            files = {"mt_bench": args.mt_bench, "gsm8k": args.gsm8k}
            res["taus"] = [eval_tau(res["dir"], files[f], m, args, work)
                           for f, m in (x.split(":") for x in args.taus.split(","))]
            res_file.write_text(json.dumps({**res, "dir": str(res["dir"])}))
        acc, taus = res["acc"], res["taus"]
        prec = {"auto": ", CPU default precision", "no": ", fp32", "bf16": ", bf16 autocast"}.get(precision, "")
        rows.append((tool, f"lr {lr or ours_lr:g}{' (its default)' if name.endswith('default') else ''}{prec}",
                     res, acc, taus))
        print(f"{name}: {res['tokens']} tokens, acc {acc}, tau {taus}", flush=True)
    print(f"\n{args.steps} steps x {args.tokens} tokens, TTT {args.ttt_steps}, draft vocab {args.draft_vocab}, "
          f"AdamW, one thread (peers in fp32); tau on {args.prompts} prompts x {args.new_tokens} tokens\n")
    print("| tool | settings | tokens | tokens/s | tokens/CPU-s | CPU-min | lr at steps 1, N/2, N | acc_0 | acc_1 | "
          "acc_2 | " + " | ".join(f"{t} tau" for t in args.taus.split(",")) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(args.taus.split(",")))
    for tool, settings, res, acc, taus in rows:
        a = " | ".join(f"{x:.3f}" for x in acc[:3])
        t = " | ".join(f"{x:.2f}" for x in taus)
        lrs = res.get("lrs") or [float("nan")]
        span = ", ".join(f"{lrs[i]:.2g}" for i in (0, len(lrs) // 2, -1))
        print(f"| {tool} | {settings} | {res['tokens']} | {res['tokens'] / res['wall_s']:.0f} | "
              f"{res['tokens'] / res['cpu_s']:.0f} | {res['process_cpu_s'] / 60:.1f} | {span} ({len(lrs)} steps) | "
              f"{a} | {t} |")


if __name__ == "__main__":
    main()
