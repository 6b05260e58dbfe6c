"""A stand-in for llama.cpp's ``llama-server``: the HTTP subset eagle3cli/evaluate/llamacpp.py uses.

GET /health, POST /completion (token-id prompt, greedy), GET /metrics; the ``timings`` block and
the ``llamacpp:spec_decode_*`` counters are shaped as llama-server's (llama-cpp-python 0.3.36).
Every answer is ANSWER_LEN tokens. Plain: 20 ms a token. With ``-md``: 10 ms a token, and each
answer took STEPS target steps that accepted ACCEPTED drafts of ``--spec-draft-n-max`` each.
It appends its argv to $FAKE_LLAMA_ARGS (one JSON line per start); FAKE_LLAMA_DIFFER=1 makes the
speculative answers differ from the plain ones; FAKE_LLAMA_SPEED=X divides every reported time by X.
Per server, matched against its argv joined by spaces (a settings sweep starts many): FAKE_LLAMA_FASTER,
a JSON object {substring: X}, divides the times by every X whose substring is in it;
FAKE_LLAMA_ACCEPT, {substring: N}, accepts N drafts an answer (the first match); FAKE_LLAMA_DIFFER_IF,
a JSON list of substrings, makes the speculative answers differ where all of them are in it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER_LEN = 10
ACCEPTED = 4  # per answer
STEPS = ANSWER_LEN - 1 - ACCEPTED  # target steps after the prompt pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", required=True)
    ap.add_argument("-md")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--spec-draft-n-max", type=int, default=3)
    ap.add_argument("--version", action="store_true")
    args, _ = ap.parse_known_args()
    if os.environ.get("FAKE_LLAMA_ARGS"):
        with open(os.environ["FAKE_LLAMA_ARGS"], "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    for path in (args.m, args.md):
        if path and not os.path.isfile(path):
            print(f"error: failed to load model '{path}'", flush=True)
            sys.exit(1)
    spec = args.md is not None
    argv = " ".join(sys.argv[1:])
    speed = float(os.environ.get("FAKE_LLAMA_SPEED", "1"))
    for key, x in json.loads(os.environ.get("FAKE_LLAMA_FASTER", "{}")).items():
        speed *= x if key in argv else 1
    accepted = next((n for key, n in json.loads(os.environ.get("FAKE_LLAMA_ACCEPT", "{}")).items() if key in argv),
                    ACCEPTED)
    steps = ANSWER_LEN - 1 - accepted
    differ_if = json.loads(os.environ.get("FAKE_LLAMA_DIFFER_IF", "null"))
    differ = bool(os.environ.get("FAKE_LLAMA_DIFFER")) or bool(differ_if and all(k in argv for k in differ_if))
    counters = {"spec_decode_num_drafts_total": 0, "spec_decode_num_draft_tokens_total": 0,
                "spec_decode_num_accepted_tokens_total": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body, ctype="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            if self.path == "/metrics":
                text = "".join(f"# TYPE llamacpp:{k} counter\nllamacpp:{k} {v}\n" for k, v in counters.items())
                return self._send(200, text, "text/plain")
            self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/completion":
                return self._send(404, {"error": "not found"})
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = req["prompt"]
            assert all(isinstance(t, int) for t in prompt), "prompt must be token ids"
            assert req.get("temperature") == 0.0
            n = min(ANSWER_LEN, req["n_predict"])
            shift = 1 if spec and differ else 0
            tokens = [(len(prompt) + k + shift) % 97 + 3 for k in range(n)]
            timings = {"prompt_n": len(prompt), "prompt_ms": 1.0 * len(prompt) / speed, "predicted_n": n,
                       "predicted_ms": (10.0 if spec else 20.0) * n / speed}
            timings["predicted_per_second"] = 1000.0 * n / timings["predicted_ms"]
            if spec and n == ANSWER_LEN:
                k = args.spec_draft_n_max
                timings.update(draft_n=steps * k, draft_n_accepted=accepted)
                counters["spec_decode_num_drafts_total"] += steps
                counters["spec_decode_num_draft_tokens_total"] += steps * k
                counters["spec_decode_num_accepted_tokens_total"] += accepted
            self._send(200, {"content": " ".join(f"w{t}" for t in tokens), "tokens": tokens,
                             "tokens_predicted": n, "stop": True, "timings": timings})

    ThreadingHTTPServer((args.host, args.port), H).serve_forever()


if __name__ == "__main__":
    main()
