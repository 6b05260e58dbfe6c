"""A stand-in for the vLLM worker (eagle3cli.vllm_capture): the same protocol, features from an HF
forward. Started by tests through a fake "vLLM python" script that runs this file with the
worker's arguments (``-m eagle3cli.vllm_capture --config JSON --reply-fd N``), so everything
eagle3 does around vLLM (start, requests, the store it writes, resume) is tested without vLLM.

FAKE_VLLM_FAIL=start|capture makes it fail there, as a broken vLLM install would.
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3cli.target import TargetSpec, capture, load_target  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-m")
    p.add_argument("--config", required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args()
    assert args.m == "eagle3cli.vllm_capture", args.m
    cfg = json.loads(args.config)
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
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
