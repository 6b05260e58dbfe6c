"""Which `eagle3 train` defaults make the best draft: architecture, learning rate and schedule,
head initialisation and init scale, at several budgets and seeds, scored on held-out data.

    PYTHONPATH=. python benchmarks/defaults_study.py --store STORE --model TARGET --work runs/study \
        --steps 40 --seeds 0,1,2 --grid arch-lr          # every architecture x lr
    PYTHONPATH=. python benchmarks/defaults_study.py ... --grid schedule,init --base nbf-3e-3
    PYTHONPATH=. python benchmarks/defaults_study.py ... --steps 600 --seeds 0 --only paper-1e-4,nbf-3e-3

Every run is `eagle3 train --recipe none` on the same store with the same micro-batches
(--tokens per optimizer step), TTT --ttt-steps, draft vocabulary --draft-vocab, one thread, and
only the studied settings changed, each passed explicitly (so a run means the same thing whatever
the package's defaults are). Scores: the trainer's held-out acceptance per position (acc_0..acc_2,
its validation split of the store, never trained on) at the end, and chain-3 tau of our lossless
generator (benchmarks/chain_tau.py: `eagle3 eval`'s speculative decode) on the first --num-prompts
prompts of --prompts with up to --max-turns turns each (prompts the store never saw). Each run's
result is kept as JSON in --work, so a rerun only trains what is new; --jobs runs that many at once
(one thread each). Prints one table: mean and standard deviation over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peer_trainers import sh  # noqa: E402  (one thread a run, logged; the same runner as the peer benchmark)

SHARED = HERE.parents[1] / "shared" / "data" / "eval"
EAGLE3 = str(Path(sys.executable).parent / "eagle3")

# Architectures (docs/design.md §3), each spelled out flag by flag.
ARCH = {
    "paper": ("--no-norm-before-fc", "--no-norm-before-residual", "--no-norm-output"),
    "nbf": ("--norm-before-fc", "--no-norm-before-residual", "--no-norm-output"),
    "nbr": ("--no-norm-before-fc", "--norm-before-residual", "--no-norm-output"),
    "nout": ("--no-norm-before-fc", "--no-norm-before-residual", "--norm-output"),
    "nbf+nout": ("--norm-before-fc", "--no-norm-before-residual", "--norm-output"),
    "eagle3.1": ("--variant", "eagle3.1", "--no-norm-before-fc", "--no-norm-before-residual"),
    "spec3": ("--norm-before-fc", "--norm-before-residual", "--norm-output"),  # speculators' three norms
}
LRS = ("1e-4", "3e-4", "1e-3", "3e-3")
DEFAULT_REST = ("--lr-schedule", "cosine", "--min-lr-ratio", "0", "--warm-start", "none", "--no-freeze-head",
                "--init-std", "0.02", "--loss-on", "answers")
# Variations of one base configuration (--base ARCH-LR).
SCHEDULES = {"linear": ("--lr-schedule", "linear"), "floor 0.1": ("--min-lr-ratio", "0.1"),
             "constant": ("--lr-schedule", "constant"), "warmup 0.1": ("--warmup-ratio", "0.1")}
INITS = {"head from target": ("--warm-start", "head"), "head from target, frozen": ("--warm-start", "head",
                                                                                      "--freeze-head"),
         "init std 0.01": ("--init-std", "0.01"), "init std 0.05": ("--init-std", "0.05"),
         **{f"residual init {x}": ("--residual-init-std", x) for x in ("0", "0.002", "0.005", "0.01")}}


def configs(args) -> dict[str, tuple[str, ...]]:
    """name -> the flags that make it (every studied setting explicit)."""
    out: dict[str, tuple[str, ...]] = {}
    grids = args.grid.split(",")
    if "arch-lr" in grids:
        for arch, flags in ARCH.items():
            for lr in LRS:
                out[f"{arch}-{lr}"] = (*flags, "--lr", lr, *DEFAULT_REST)
    arch_lr, _, base_schedule = args.base.partition(" ")  # "nbf-1e-3" or "nbf-1e-3 linear"
    base_arch, base_lr = arch_lr.split("-", 1)
    if base_schedule and base_schedule not in SCHEDULES:
        raise SystemExit(f"--base {args.base!r}: the schedule must be one of {', '.join(SCHEDULES)}")
    base = (*ARCH[base_arch], "--lr", base_lr, *DEFAULT_REST, *SCHEDULES.get(base_schedule, ()))
    for grid, table in (("schedule", SCHEDULES), ("init", INITS)):
        if grid in grids:
            out[args.base] = base
            for label, flags in table.items():
                out[f"{args.base} {label}"] = (*base, *flags)  # later flags win
    if args.only:
        wanted = args.only.split(",")
        for name in wanted:
            if name not in out and "-" in name:
                arch, lr = name.split("-", 1)
                out[name] = (*ARCH[arch], "--lr", lr, *DEFAULT_REST)
        out = {k: v for k, v in out.items() if k in wanted}
    return out


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def one_run(name: str, flags: tuple[str, ...], seed: int, args, work: Path) -> dict:
    out = work / f"{slug(name)}_s{seed}_{args.steps}"
    res_file = out.parent / f"{out.name}.json"  # not with_suffix: names like "floor 0.1" hold dots
    if res_file.exists():
        return json.loads(res_file.read_text())
    log = out.parent / f"{out.name}.log"
    if not (out / "model.safetensors").exists():
        sh([EAGLE3, "train", "--store", args.store, "--model", args.model, "--out", str(out), "--recipe", "none",
            "--device", "cpu", "--ttt-steps", str(args.ttt_steps), "--draft-vocab-size", str(args.draft_vocab),
            "--max-tokens", str(args.tokens), "--max-steps", str(args.steps), "--epochs", "1000",
            "--val-fraction", str(args.val_fraction), "--max-length", str(args.max_length), "--seed", str(seed),
            "--log-every", "1", "--save-every", "100000", *flags, *args.common], log)
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    acc = [r["val"]["acc"] for r in recs if "val" in r][-1]
    lrs = [r["lr"] for r in recs if "lr" in r]
    tau_file = out.parent / f"{out.name}.tau.json"
    sh([sys.executable, str(HERE / "chain_tau.py"), "--model", args.model, "--draft", str(out), "--prompts",
        args.prompts, "--limit", str(args.num_prompts), "--max-turns", str(args.max_turns), "--steps", "3",
        "--max-new-tokens", str(args.new_tokens), "--json-out", str(tau_file)], log)
    tau = json.loads(tau_file.read_text())["tau"]
    res = {"name": name, "seed": seed, "steps": args.steps, "flags": list(flags), "acc": acc, "tau": tau,
           "lr_first_last": lrs[:1] + lrs[-1:]}
    res_file.write_text(json.dumps(res))
    print(f"{name} seed {seed}: acc {[round(a, 3) for a in acc[:3]]}, tau {tau:.3f}", flush=True)
    return res


def spread(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="an `eagle3 gen-data` feature store")
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", default="runs/study")
    ap.add_argument("--grid", default="arch-lr", help="comma-separated: arch-lr, schedule, init")
    ap.add_argument("--base", default="nbf-3e-3",
                    help="ARCH-LR[ SCHEDULE] the schedule and init grids vary, e.g. 'nbf-1e-3 linear'")
    ap.add_argument("--only", help="comma-separated config names to run (ARCH-LR names are always known)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--prompts", default=str(SHARED / "mt_bench.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--common", default="",
                    help="extra train flags for every run (one string; after the studied ones, so they win)")
    args = ap.parse_args(argv)
    args.common = args.common.split()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    todo = [(name, flags, seed) for name, flags in configs(args).items() for seed in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda x: one_run(*x, args, work), todo))
    print(f"\n{args.steps} steps x {args.tokens} tokens, TTT {args.ttt_steps}, draft vocab {args.draft_vocab}, "
          f"seeds {args.seeds}; chain-3 tau on {args.num_prompts} prompts x {args.max_turns} turns x "
          f"{args.new_tokens} tokens\n")
    print("| config | acc_0 | acc_1 | acc_2 | chain-3 tau |\n|---|---|---|---|---|")
    for name in dict.fromkeys(r["name"] for r in results):
        rs = [r for r in results if r["name"] == name]
        accs = [spread([r["acc"][i] for r in rs]) for i in range(3)]
        print(f"| {name} | {' | '.join(accs)} | {spread([r['tau'] for r in rs])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
