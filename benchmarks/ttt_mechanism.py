"""Why a norm over the target streams helps the later TTT steps: the carried stream against the
layer's update, per TTT step, with and without each norm option.

    PYTHONPATH=. python benchmarks/ttt_mechanism.py --store STORE --model TARGET \
        --drafts paper=runs/study/paper-1e-3_s0_40,nbf=runs/study/nbf-1e-3_s0_40 [--init]

At TTT step s the draft's single layer reads the stream it carries (step 0: g = fc(target
streams), later steps: its own previous output a^{s-1}) and adds its update, the attention
and MLP outputs: a^s = r^s + u^s, where r^s is the residual it keeps (the carried stream, or
hidden_norm of it with norm_before_residual). If |r| is large next to |u|, a^s stays close to
a^{s-1}: the later steps can hardly say anything the first did not. For each draft this prints,
per step, over the answer positions of the store's first --samples held-out conversations (the
trainer's split): the RMS of the carried stream h^s, of the kept residual r^s and of the update
u^s, their ratio |u|/|r|, and the cosine between a^s and a^0 (1.0: the step repeats step 0's
stream). ``--init`` also measures each draft re-initialised as training starts (seed 0), so the
starting point and the trained state can be told apart (``--residual-init-std LABEL=STD`` for a
draft trained with that flag).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def unroll(draft, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[dict[str, torch.Tensor]]:
    """The TTT unroll of ``train.ttt.ttt_streams`` (no window, no recompute), keeping per step the
    carried stream, the kept residual, the update and the output, each [T,H]."""
    from eagle3cli.train.ttt import shift_left, ttt_attention

    layer, attn = draft.midlayer, draft.midlayer.self_attn
    t = ids.shape[1]
    positions = torch.arange(t).expand(1, t)
    hidden = draft.fuse(aux)
    keys, values, out = [], [], []
    for s in range(steps):
        tokens = shift_left(ids, 1 + s)
        x = layer.attn_input(draft.embed_tokens(tokens).to(hidden.dtype), hidden)
        cos, sin = draft.rotary(positions + s, x.dtype)
        q, k, v = attn.qkv(x, cos, sin)
        keys.append(k)
        values.append(v)
        o = attn.out(ttt_attention(q, keys, values))
        kept = layer.hidden_norm(hidden) if layer.norm_before_residual else hidden
        h = kept + o
        a_raw = h + layer.mlp(layer.post_attention_layernorm(h))
        a = draft.output(a_raw)
        out.append({"carried": hidden[0], "kept": kept[0], "update": (a_raw - kept)[0], "a": a[0]})
        hidden = a
    return out


def rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(-1).sqrt()


@torch.no_grad()
def measure(draft, samples: list[dict], steps: int) -> list[dict[str, float]]:
    acc: list[dict[str, list]] = [{k: [] for k in ("carried", "kept", "update", "ratio", "cos0")} for _ in range(steps)]
    for smp in samples:
        ids, aux, mask = smp["input_ids"][None], smp["aux"][None].float(), smp["loss_mask"].bool()
        streams = unroll(draft, ids, aux, steps)
        a0 = streams[0]["a"]
        for s, st in enumerate(streams):
            m = mask
            acc[s]["carried"].append(rms(st["carried"])[m])
            acc[s]["kept"].append(rms(st["kept"])[m])
            acc[s]["update"].append(rms(st["update"])[m])
            acc[s]["ratio"].append((rms(st["update"]) / rms(st["kept"]))[m])
            acc[s]["cos0"].append(torch.nn.functional.cosine_similarity(st["a"].float(), a0.float(), dim=-1)[m])
    return [{k: float(torch.cat(v).median()) for k, v in step.items()} for step in acc]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafts", required=True, help="comma-separated LABEL=DRAFT_DIR")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", action="store_true", help="also measure each draft re-initialised (seed 0)")
    ap.add_argument("--residual-init-std", default="",
                    help="comma-separated LABEL=STD: the --residual-init-std a draft was trained with (for --init)")
    args = ap.parse_args(argv)
    residual = {k: float(v) for k, v in (x.split("=", 1) for x in args.residual_init_std.split(",") if x)}
    unknown = set(residual) - {item.split("=", 1)[0] for item in args.drafts.split(",")}
    if unknown:
        raise SystemExit(f"--residual-init-std names no draft of --drafts: {', '.join(sorted(unknown))}")
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from eagle3cli.data.features import FeatureStore
    from eagle3cli.publish.export import load_draft
    from eagle3cli.train.batching import split_indices

    target = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    store = FeatureStore(args.store)
    _, val = split_indices(len(store), args.val_fraction, args.seed)
    samples = [store[i] for i in val[: args.samples]]
    print(f"median over the answer positions of {len(samples)} held-out conversations; |x| is a per-position RMS\n")
    print("| draft | step | carried abs h | kept abs r | update abs u | u/r | cos(a^s, a^0) |")
    print("|---|---|---|---|---|---|---|")
    for item in args.drafts.split(","):
        label, path = item.split("=", 1)
        draft, _ = load_draft(Path(path), target=target)
        states = [(label, draft)]
        if args.init:
            fresh, _ = load_draft(Path(path), target=target)
            fresh.init_weights(seed=0, residual_std=residual.get(label))
            for m in fresh.modules():  # norms start at 1, as a new draft's
                if m.__class__.__name__ == "RMSNorm":
                    m.weight.data.fill_(1.0)
            states.insert(0, (f"{label} (init)", fresh))
        for name, d in states:
            for s, row in enumerate(measure(d.eval(), samples, args.steps)):
                print(f"| {name} | {s} | {row['carried']:.3f} | {row['kept']:.3f} | {row['update']:.3f} | "
                      f"{row['ratio']:.3f} | {row['cos0']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
