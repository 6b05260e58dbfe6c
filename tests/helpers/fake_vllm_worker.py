"""A stand-in for the vLLM workers (eagle3cli.engines.vllm_capture, eagle3cli.engines.vllm_decode): the same
protocols, features from an HF forward, answers and spec-decode counters made up by a fixed rule.
Started by tests through a fake "vLLM python" script that runs this file with the worker's
arguments (``-m MODULE --config JSON --reply-fd N``), so everything eagle3 does around vLLM (start,
requests, the store it writes, resume, the eval engine section) is tested without vLLM.

FAKE_VLLM_FAIL=start|capture makes it fail there, as a broken vLLM install would.
The decoding worker: every answer is ``min(max_tokens, 10)`` tokens (ids from the prompt's
length), each speculative one costs 5 drafts of k tokens with 4 accepted (3 at position 1, 1 at
position 2); FAKE_VLLM_DIFFER=1 changes the speculative answers' last token.
The capability probe (``-c CODE``, eagle3cli.evaluate.vllm_eval.check_python) prints FAKE_VLLM_VERSION
(default 0.32.0-fake; empty: "vllm is not installed").
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def decode(cfg, reply):
    """eagle3cli.engines.vllm_decode's protocol."""
    if os.environ.get("FAKE_VLLM_FAIL") == "start":
        reply.write(json.dumps({"ok": False, "error": "vLLM did not start: ValueError: no draft"}) + "\n")
        return 2
    log = os.environ.get("FAKE_VLLM_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"cfg": cfg}) + "\n")
    spec = bool(cfg.get("draft"))
    k = int(cfg["k"])
    c = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_tokens_per_pos": [0.0] * k} \
        if spec else {}
    reply.write(json.dumps({"ok": True, "ready": True, "startup_s": 1.5, "dtype": "float32",
                            "vllm_version": "0.32.0-fake", "counters": c}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "exit":
            break
        outs = []
        for ids in req["ids"]:
            n = min(int(req["max_tokens"]), 10)
            toks = [(len(ids) + j) % 50 + 3 for j in range(n)]
            if spec and os.environ.get("FAKE_VLLM_DIFFER"):
                toks[-1] += 1
            if spec:
                c["drafts"] += 5
                c["draft_tokens"] += 5 * k
                c["accepted_tokens"] += 4
                c["accepted_tokens_per_pos"][0] += 3
                c["accepted_tokens_per_pos"][1] += 1
            # plain: 10 tokens in 0.2 s (50 tok/s); speculative: in 0.1 s (100 tok/s)
            outs.append({"token_ids": toks, "text": f"answer of {len(ids)}", "seconds": 0.1 if spec else 0.2})
        reply.write(json.dumps({"ok": True, "outputs": outs, "counters": c}) + "\n")
    return 0


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "-c":  # eagle3cli.evaluate.vllm_eval.check_python's probe
        print(os.environ.get("FAKE_VLLM_VERSION", "0.32.0-fake"))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("-m")
    p.add_argument("--config", required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    cfg = json.loads(args.config)
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    if args.m == "eagle3cli.engines.vllm_decode":
        return decode(cfg, reply)
    assert args.m == "eagle3cli.engines.vllm_capture", args.m
    import torch  # the capture worker only: the decoding one and the probe start without torch
    from safetensors.torch import save_file

    from eagle3cli.model.target import TargetSpec, capture, load_target

    if os.environ.get("FAKE_VLLM_FAIL") == "start":
        reply.write(json.dumps({"ok": False, "error": "vLLM did not start: RuntimeError: no engine"}) + "\n")
        return 2
    torch.set_num_threads(1)
    model = load_target(TargetSpec(cfg["model"], device="cpu", dtype="float32"))
    reply.write(json.dumps({"ok": True, "ready": True, "startup_s": 0.0, "dtype": "float32",
                            "vllm_version": "fake"}) + "\n")
    log = os.environ.get("FAKE_VLLM_LOG")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "exit":
            break
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"n": len(req["ids"]), "cfg": cfg}) + "\n")
        if os.environ.get("FAKE_VLLM_FAIL") == "capture":
            reply.write(json.dumps({"ok": False, "error": "RuntimeError: worker died"}) + "\n")
            continue
        dtype = getattr(torch, cfg["feature_dtype"])
        auxes, finals, lengths = [], [], []
        for ids in req["ids"]:
            aux, final = capture(model, torch.tensor([ids]), tuple(cfg["layer_ids"]), None)
            auxes.append(aux[0].to(dtype))
            finals.append(final[0].to(dtype))
            lengths.append(len(ids))
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        save_file({"aux": torch.cat(auxes), "final": torch.cat(finals), "offsets": offsets}, req["out"])
        reply.write(json.dumps({"ok": True, "tokens": int(offsets[-1]), "seconds": 0.0}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
