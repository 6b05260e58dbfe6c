"""Where llama.cpp's speculative cycle goes: plain vs EAGLE-3 decoding with llama.cpp's own tools.

    python benchmarks/llamacpp_bench.py --llama-cpp DIR --target-gguf T.gguf --draft-gguf D.gguf \
        [--model HF_TARGET_DIR] [--prompts eagle3cli/prompts/mt_bench.jsonl --limit 3] [-n 128] \
        [--threads 2] [--n-max 1,2,3] [--p-min 0] [--repeats 3] [--json out.json]

Plain: ``llama-bench -m T -p 0 -n N -t THREADS -r REPEATS`` (tokens/s of pure decoding).
Speculative: ``llama-speculative-simple -m T -md D --spec-type draft-eagle3 --spec-draft-n-max K
--spec-draft-p-min P -n N -t THREADS --temp 0`` on each prompt (chat-formatted with the HF
tokenizer when --model is given), REPEATS times; medians. From its output: decoded tokens/s,
n_drafted / n_accept, and the target context's perf counters (``prompt eval time`` holds the
verification batches of K+1 tokens, ``eval time`` single-token steps). Per cycle (one target
verification): cycles = n_predict - n_accept (each cycle emits its accepted drafts plus one);
verify ms = target eval time (batched + single, prompt pass excluded) / cycles; draft+overhead ms
= the rest of the decode time / cycles. A cycle pays off when tau / (cycle ms) > 1 / (plain step ms).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3cli.evaluate.llamacpp import find_binary  # noqa: E402

NUM = r"([0-9.]+)"


def plain_tps(bench: Path, target: Path, n: int, threads: int, repeats: int) -> float:
    out = subprocess.run([str(bench), "-m", str(target), "-p", "0", "-n", str(n), "-t", str(threads),
                          "-r", str(repeats), "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


def parse_spec(text: str) -> dict:
    def grab(pat, cast=float):
        m = re.search(pat, text)
        return cast(m.group(1)) if m else None

    r = {
        "decoded": grab(r"decoded\s+(\d+) tokens", int),
        "decode_s": grab(r"decoded\s+\d+ tokens in\s+" + NUM + " seconds"),
        "speed": grab(r"decoded\s+\d+ tokens in\s+[0-9.]+ seconds, speed:\s+" + NUM),
        "n_drafted": grab(r"n_drafted\s*=\s*(\d+)", int),
        "n_accept": grab(r"n_accept\s*=\s*(\d+)", int),
    }
    # target context perf (after the "target:" line): prompt eval = batched (prompt + verifications)
    tgt = text.split("target:")[-1]
    m = re.search(r"prompt eval time =\s+" + NUM + r" ms /\s+(\d+) tokens", tgt)
    r["tgt_batch_ms"], r["tgt_batch_tokens"] = (float(m.group(1)), int(m.group(2))) if m else (None, None)
    m = re.search(r"\s eval time =\s+" + NUM + r" ms /\s+(\d+) runs", tgt)
    r["tgt_single_ms"], r["tgt_single_runs"] = (float(m.group(1)), int(m.group(2))) if m else (None, None)
    m = re.search(r"encoded\s+(\d+) tokens in\s+" + NUM + " seconds", text)
    r["prompt_tokens"], r["prompt_s"] = (int(m.group(1)), float(m.group(2))) if m else (None, None)
    return r


def run_spec(spec_bin: Path, target: Path, draft: Path, prompt: str, n: int, threads: int, n_max: int,
             p_min: float, extra=()) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    cmd = [str(spec_bin), "-m", str(target), "-md", str(draft), "--spec-type", "draft-eagle3",
           "--spec-draft-n-max", str(n_max), "--spec-draft-p-min", str(p_min), "-f", f.name, "-n", str(n),
           "-t", str(threads), "--temp", "0", "-c", "4096", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    Path(f.name).unlink()
    if p.returncode != 0:
        raise SystemExit(f"llama-speculative-simple failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}")
    r = parse_spec(p.stderr + p.stdout)
    r["cmd"] = " ".join(cmd)
    return r


def prompts(path: Path | None, limit: int, model: str | None) -> list[str]:
    if path is None:
        return ["Write a short story about a robot who learns to paint."]
    qs = []
    for line in path.read_text().splitlines():
        if line.strip():
            qs.append(json.loads(line)["turns"][0])
        if len(qs) >= limit:
            break
    if model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                for q in qs]
    return qs


def summarize(runs: list[dict], plain: float, n_max: int) -> dict:
    med = lambda xs: statistics.median(x for x in xs if x is not None)  # noqa: E731
    cyc = [r["decoded"] - r["n_accept"] for r in runs]
    out = {"speed": med(r["speed"] for r in runs),
           "tau": sum(r["decoded"] for r in runs) / sum(cyc),
           "accepted": sum(r["n_accept"] for r in runs), "drafted": sum(r["n_drafted"] for r in runs)}
    cycle_ms = [1000 * r["decode_s"] / c for r, c in zip(runs, cyc)]
    # target time per cycle: its batched evals (prompt + verifications) and single-token evals (steps
    # with nothing drafted), minus the prompt pass ('encoded ... in S', which also holds the draft's
    # prompt pass: verify is a slight underestimate, draft/other a slight overestimate)
    ver_ms = [(r["tgt_batch_ms"] + (r["tgt_single_ms"] or 0) - 1000 * r["prompt_s"]) / c
              if r["tgt_batch_ms"] is not None and r["prompt_s"] else None for r, c in zip(runs, cyc)]
    out["cycle_ms"] = statistics.median(cycle_ms)
    vs = [v for v in ver_ms if v is not None]
    out["verify_ms"] = statistics.median(vs) if vs else None
    out["draft_other_ms"] = out["cycle_ms"] - out["verify_ms"] if out["verify_ms"] is not None else None
    out["plain_step_ms"] = 1000 / plain
    out["cycle_over_step"] = out["cycle_ms"] / out["plain_step_ms"]
    out["speedup"] = out["speed"] / plain
    out["n_max"] = n_max
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--target-gguf", required=True, type=Path)
    ap.add_argument("--draft-gguf", required=True, type=Path)
    ap.add_argument("--model", help="HF target folder: chat-format the prompts with its tokenizer")
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--threads-draft", type=int)
    ap.add_argument("--n-max", default="3")
    ap.add_argument("--p-min", default="0")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    bench, spec = find_binary("llama-bench", a.llama_cpp), find_binary("llama-speculative-simple", a.llama_cpp)
    plain = plain_tps(bench, a.target_gguf, a.n, a.threads, max(3, a.repeats))
    print(f"plain: {plain:.1f} tok/s ({bench.name} -m {a.target_gguf.name} -p 0 -n {a.n} -t {a.threads} "
          f"-r {max(3, a.repeats)})")
    ps = prompts(a.prompts, a.limit, a.model)
    extra = ["-td", str(a.threads_draft)] if a.threads_draft else []
    rows = []
    for k in [int(x) for x in a.n_max.split(",")]:
        for p_min in [float(x) for x in a.p_min.split(",")]:
            runs = [run_spec(spec, a.target_gguf, a.draft_gguf, p, a.n, a.threads, k, p_min, extra)
                    for _ in range(a.repeats) for p in ps]
            s = summarize(runs, plain, k)
            s.update(p_min=p_min, cmd=runs[0]["cmd"])
            rows.append(s)
            print(f"n_max {k} p_min {p_min}: {s['speed']:.1f} tok/s ({s['speedup']:.2f}x plain), tau {s['tau']:.3f}, "
                  f"accepted {s['accepted']}/{s['drafted']}; per cycle {s['cycle_ms']:.1f} ms = verify "
                  f"{s['verify_ms'] or float('nan'):.1f} + draft/other {s['draft_other_ms'] or float('nan'):.1f} "
                  f"(plain step {s['plain_step_ms']:.1f} ms; cycle = {s['cycle_over_step']:.2f} steps)", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"plain_tps": plain, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
