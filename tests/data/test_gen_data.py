"""gen-data end to end on a tiny Llama with SmolLM2's real tokenizer and chat template."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.config.options import GenDataOptions
from eagle3cli.data.chat_mask import chat_template, exact_answer_labels, tokenize_conversation
from eagle3cli.data.endpoint import Endpoint, regenerate_endpoint
from eagle3cli.data.estimates import bytes_per_token
from eagle3cli.data.features import FeatureStore
from eagle3cli.data.gen_data import run
from eagle3cli.data.gen_errors import GenDataError
from eagle3cli.data.regenerate import GenSettings, strip_meta
from eagle3cli.model.target import TargetSpec

REPO = Path(__file__).resolve().parents[2]
MANIFEST_KEYS = {"format", "version", "target", "model_type", "hidden_size", "vocab_size", "num_layers", "layer_ids",
                 "features", "dtype", "chat_template_hash", "max_length", "num_samples", "num_tokens",
                 "num_masked_tokens", "bytes", "truncated", "skipped", "end_token_ids", "source"}


def conversations(n):
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                 {"from": "gpt", "value": f"It is {2 * i}."}]
        if i % 2:
            turns += [{"from": "human", "value": "Explain why, briefly."}, {"from": "gpt", "value": "Addition."}]
        rows.append({"id": str(i), "conversations": turns})
    return rows


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chats.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in conversations(6)) + "\n")
    return p


def options(out, data, **kw):
    base = dict(out=Path(out), data=str(data), max_new_tokens=6, max_length=96, shard_size=2, batch_size=4)
    base.update(kw)
    return GenDataOptions(**base)


@pytest.fixture(scope="module")
def full_run(smol_tiny_dir, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "store"
    man = run(options(out, data_file), TargetSpec(str(smol_tiny_dir), device="cpu"))
    return out, man


def shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted((Path(out) / "shards").glob("shard-*"))}


def test_manifest_contract(full_run, smol_tiny_dir):
    out, man = full_run
    assert MANIFEST_KEYS <= set(man)
    store = FeatureStore(out)
    assert man["format"] == "eagle3-features" and man["version"] == 1 and man["features"] == "offline"
    assert (man["hidden_size"], man["num_layers"], man["layer_ids"], man["vocab_size"]) == (64, 8, [2, 4, 5], 49152)
    assert man["dtype"] == "bfloat16" and man["complete"] and man["shards_done"] == man["shards_planned"] == 3
    assert man["num_samples"] == len(store) == 6
    assert man["num_tokens"] == sum(store.lengths())
    assert man["num_masked_tokens"] == sum(int(store[i]["loss_mask"].sum()) for i in range(len(store)))
    assert man["bytes"] == sum(p.stat().st_size for p in (out / "shards").glob("*.safetensors"))
    assert man["end_token_ids"] == [2]  # <|im_end|>: SmolLM2's end of turn and EOS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_tiny_dir)
    assert man["chat_template_hash"] == hashlib.sha256(chat_template(tok).encode()).hexdigest()
    assert man["target"]["id"] == str(smol_tiny_dir) and len(man["target"]["content_hash"]) == 64
    assert store.token_counts(49152).sum() == man["num_masked_tokens"]
    # shards get the umask's mode like any other file (safetensors alone would leave 0600)
    from eagle3cli.core.io_utils import default_file_mode

    assert {p.stat().st_mode & 0o777 for p in (out / "shards").glob("*.safetensors")} == {default_file_mode()}
    assert default_file_mode() != 0o600


def test_regenerated_jsonl_and_masks(full_run, smol_tiny_dir, data_file):
    out, _ = full_run
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_tiny_dir)
    regen = [json.loads(line) for p in sorted((out / "regenerated").glob("part-*.jsonl"))
             for line in p.read_text().splitlines()]
    source = [r["conversations"] for r in conversations(6)]
    assert [r["id"] for r in regen] == list(range(6))
    store = FeatureStore(out)
    for i, r in enumerate(regen):
        msgs = r["messages"]
        # The user turns, in order, each followed by the target's own answer (not the dataset's).
        users = [t["value"] for t in source[i] if t["from"] == "human"]
        assert [m["content"] for m in msgs if m["role"] == "user"] == users[:len(msgs) // 2]
        answers = [m for m in msgs if m["role"] == "assistant"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * len(answers)
        # Every user turn is answered, unless a cut answer (max_new_tokens 6) ended the conversation.
        assert len(answers) == len(users) or answers[-1].get("finished") is False
        assert all(m.get("finished", True) for m in answers[:-1])
        assert all(m["content"] not in ("Addition.", f"It is {2 * i}.") for m in answers)
        ids, mask, _ = exact_answer_labels(tokenize_conversation(tok, strip_meta(msgs)), msgs)
        sample = store[i]
        assert sample["input_ids"].tolist() == ids[:96]
        assert sample["loss_mask"].tolist() == mask[:96]
        # The last answer's learned tokens are exactly the ids the target emitted.
        last = answers[-1]["token_ids"]
        if len(ids) <= 96:
            assert sample["input_ids"].tolist()[-len(last):] == last and all(sample["loss_mask"][-len(last):])


def test_stored_streams_equal_fresh_forward(full_run, smol_tiny_dir):
    out, man = full_run
    assert_streams_of_a_fresh_forward(out, man, smol_tiny_dir)


def assert_streams_of_a_fresh_forward(out, man, smol_tiny_dir):
    from transformers import AutoModelForCausalLM

    # --capture-dtype auto: bf16 on a CPU that multiplies bf16 natively, else the target's fp32
    dtype = getattr(torch, man["run"].get("capture_dtype") or "float32")
    model = AutoModelForCausalLM.from_pretrained(smol_tiny_dir, dtype=dtype).eval()
    store = FeatureStore(out)
    for i in range(len(store)):
        s = store[i]
        with torch.no_grad():
            hs = model(s["input_ids"][None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[j][0] for j in man["layer_ids"]], dim=-1)
        assert s["aux"].dtype == torch.bfloat16 and s["aux"].shape == (len(s["input_ids"]), 3 * 64)
        # bf16 storage: equal to the fresh fp32 forward rounded to bf16 (one bf16 ulp of slack for
        # batched-vs-single forward noise deciding a rounding).
        # In bf16 the batched forward's own roundings add a few ulps more.
        rtol = 2 ** -7 if dtype == torch.float32 else 2 ** -5
        torch.testing.assert_close(s["aux"].float(), want.to(torch.bfloat16).float(), rtol=rtol, atol=1e-5)
        torch.testing.assert_close(s["final"].float(), hs[-1][0].to(torch.bfloat16).float(), rtol=rtol, atol=1e-5)
        # And the first stream is exactly the embedding output (no arithmetic there).
        assert torch.equal(s["aux"][:, :64], hs[2][0].to(torch.bfloat16)) or man["layer_ids"][0] != 0


@pytest.mark.parametrize("bf16_cpu", [True, False])
def test_capture_dtype_auto_follows_the_cpu_and_is_recorded(smol_tiny_dir, data_file, tmp_path, monkeypatch, bf16_cpu):
    from eagle3cli.core import hardware
    from eagle3cli.data import gen_data
    from eagle3cli.data import regenerate as regen

    for mod in (hardware, regen):
        monkeypatch.setattr(mod, "has_bf16_matmul", lambda: bf16_cpu)
    loaded = []
    real_load = gen_data.Pipeline.connect

    def connect(self):
        real_load(self)
        loaded.append(next(self.model.parameters()).dtype)

    monkeypatch.setattr(gen_data.Pipeline, "connect", connect)
    out = tmp_path / "store"
    man = run(options(out, data_file, max_samples=4), TargetSpec(str(smol_tiny_dir), device="cpu"))
    want = "bfloat16" if bf16_cpu else None
    assert man["run"].get("capture_dtype") == want and man["run"].get("regen_dtype") == want
    assert loaded == [torch.bfloat16 if bf16_cpu else torch.float32]  # one target serves regeneration and capture
    assert_streams_of_a_fresh_forward(out, man, smol_tiny_dir)
    if bf16_cpu:  # a resume must capture as the finished shards did
        with pytest.raises(GenDataError, match=r"different settings \(capture_dtype, regen_dtype\)"):
            run(options(out, data_file, max_samples=4, capture_dtype="float32", regen_dtype="float32"),
                TargetSpec(str(smol_tiny_dir), device="cpu"))


def test_capture_dtype_is_refused_where_it_cannot_hold(smol_tiny_dir, data_file, tmp_path):
    with pytest.raises(GenDataError, match="regeneration in float32 would read its rounded weights"):
        run(options(tmp_path / "a", data_file, capture_dtype="bfloat16", regen_dtype="float32"),
            TargetSpec(str(smol_tiny_dir), device="cpu"))
    assert not (tmp_path / "a").exists()
    m = ["-m", str(smol_tiny_dir), "--data", str(data_file), "--dry-run"]
    assert "--capture-dtype sets what the local target captures features in; it does nothing with --online" in \
        cli_error(m + ["--online", "--capture-dtype", "bfloat16"])


def test_rerun_resumes_and_refuses_other_settings(full_run, smol_tiny_dir, data_file, monkeypatch):
    out, man = full_run
    before = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    import eagle3cli.model.target as target

    monkeypatch.setattr(target, "load_target", lambda spec: pytest.fail("a finished run must not load the model"))
    again = run(options(out, data_file), TargetSpec(str(smol_tiny_dir), device="cpu"))
    assert {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()} == before
    assert {k: again[k] for k in ("num_samples", "num_tokens", "bytes")} == \
        {k: man[k] for k in ("num_samples", "num_tokens", "bytes")}
    with pytest.raises(GenDataError, match=r"different settings \(max_length\).*--overwrite"):
        run(options(out, data_file, max_length=64), TargetSpec(str(smol_tiny_dir), device="cpu"))


def test_interrupted_run_resumes_bit_identical(full_run, smol_tiny_dir, data_file, tmp_path):
    ref_out, _ = full_run
    out = tmp_path / "store"
    cmd = [sys.executable, "-m", "eagle3cli.cli", "gen-data", "-m", str(smol_tiny_dir), "--data", str(data_file),
           "-o", str(out), "--max-new-tokens", "6", "--max-length", "96", "--shard-size", "2", "--batch-size", "4",
           "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.time() + 120
    while time.time() < deadline and not list((out / "shards").glob("*.json")) and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = list((out / "shards").glob("*.json"))
    assert 1 <= len(done) < 3, "the kill should land after the first shard and before the last"
    man = run(options(out, data_file), TargetSpec(str(smol_tiny_dir), device="cpu"))
    assert man["complete"]
    assert shard_bytes(out) == shard_bytes(ref_out)
    assert not [p for p in out.rglob(".*tmp*")], "no temporary files left behind"


def test_truncation_counted_and_features_none(smol_tiny_dir, data_file, tmp_path, monkeypatch):
    import eagle3cli.model.target as target

    monkeypatch.setattr(target, "load_target", lambda spec: pytest.fail("no model needed"))
    # The rows render to 49-69 tokens, the first answer starting at token 42.
    man = run(options(tmp_path / "s", data_file, regenerate=False, features="none", max_length=45),
              TargetSpec(str(smol_tiny_dir)))
    store = FeatureStore(tmp_path / "s")
    assert man["features"] == "none" and not store.has_features and "aux" not in store[0]
    assert store.lengths() == [45] * 6
    assert man["truncated"] == man["num_samples"] == 6 and man["num_masked_tokens"] == 6 * 3
    assert man["bytes"] < 3 * 2000  # ids + masks + headers, no features
    # Nothing left to learn: refused before any work, nothing written (issue 13).
    with pytest.raises(GenDataError, match=r"^no conversation would give a training sample \(6 checked: no "
                       r"assistant tokens within --max-length: 6\): raise --max-length \(now 40\)$"):
        run(options(tmp_path / "t", data_file, regenerate=False, features="none", max_length=40),
            TargetSpec(str(smol_tiny_dir)))
    assert not (tmp_path / "t").exists()


def test_shard_split_across_ranks(smol_tiny_dir, data_file, tmp_path):
    spec = lambda: TargetSpec(str(smol_tiny_dir))  # noqa: E731
    one = run(options(tmp_path / "one", data_file, regenerate=False, features="none"), spec())
    m0 = run(options(tmp_path / "two", data_file, regenerate=False, features="none", shard="0/2"), spec())
    assert not m0["complete"] and m0["shards_done"] == 2
    m1 = run(options(tmp_path / "two", data_file, regenerate=False, features="none", shard="1/2"), spec())
    assert m1["complete"] and m1["num_tokens"] == one["num_tokens"]
    names = sorted(p.name for p in (tmp_path / "two" / "shards").glob("*.safetensors"))
    assert names == ["shard-00-00000.safetensors", "shard-00-00002.safetensors", "shard-01-00001.safetensors"]
    a, b = FeatureStore(tmp_path / "one"), FeatureStore(tmp_path / "two")
    by_id = lambda st: {int(i): st[k]["input_ids"].tolist() for k, i in enumerate(  # noqa: E731
        torch.cat([st._open(s).get_tensor("sample_ids") for s in range(len(st.shards))]))}
    assert by_id(a) == by_id(b)


def test_disk_estimate_and_dry_run(smol_tiny_dir, data_file, tmp_path):
    assert bytes_per_token(576, "offline") == 4 * 576 * 2 + 5
    res = CliRunner().invoke(app, ["gen-data", "-m", str(smol_tiny_dir), "--data", str(data_file), "-o",
                                   str(tmp_path / "dry"), "--dry-run", "--show-mask", "1", "--max-length", "96"])
    assert res.exit_code == 0, res.output
    assert "disk estimate: ~" in res.output and "(3+1) x 64 x 2" in res.output
    assert "It is 0.<|im_end|>" in res.output  # the shown sample's learned answer
    assert "nothing written" in res.output and not (tmp_path / "dry").exists()


def test_disk_estimate_bounds_what_is_written(full_run, smol_tiny_dir, data_file, tmp_path):
    """The estimate counts the template's own tokens (SmolLM2's default system prompt): exact with
    the dataset's answers, an upper bound with regeneration (every answer at --max-new-tokens)."""
    import re

    def estimate(*args):
        res = CliRunner().invoke(app, ["gen-data", "-m", str(smol_tiny_dir), "--data", str(data_file), "-o",
                                       str(tmp_path / "dry"), "--dry-run", "--max-length", "96", *args])
        assert res.exit_code == 0, res.output
        return int(re.search(r"disk estimate: ~([\d,]+) tokens", res.output).group(1).replace(",", ""))

    kept = run(options(tmp_path / "kept", data_file, regenerate=False, features="none"),
               TargetSpec(str(smol_tiny_dir)))
    assert estimate("--no-regenerate") == kept["num_tokens"]
    _, regenerated = full_run  # --max-new-tokens 6
    # 438 against 288 written: an answer cut at 6 tokens ends its conversation, so fewer turns are stored
    assert regenerated["num_tokens"] <= estimate("--max-new-tokens", "6") <= 2 * regenerated["num_tokens"]


def cli_error(args):
    res = CliRunner().invoke(app, ["gen-data", *args], env={"COLUMNS": "500"})
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, res.output
    return lines[0]


def test_bad_inputs_give_one_line_errors(smol_tiny_dir, data_file, tmp_path):
    m = ["-m", str(smol_tiny_dir), "--data", str(data_file), "--dry-run"]
    # A target without a chat template.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in smol_tiny_dir.iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert "has no chat template: pass --chat-template FILE" in cli_error(["-m", str(bare), "--data",
                                                                           str(data_file), "--dry-run"])
    tpl = tmp_path / "t.jinja"
    tpl.write_text((smol_tiny_dir / "chat_template.jinja").read_text())
    res = CliRunner().invoke(app, ["gen-data", "-m", str(bare), "--data", str(data_file), "--dry-run",
                                   "--chat-template", str(tpl)])
    assert res.exit_code == 0, res.output
    assert "--layers must be comma-separated integers" in cli_error(m + ["--layers", "a,b"])
    assert "layer ids must lie in 0..7" in cli_error(m + ["--layers", "2,4,9"])
    assert "--shard must look like i/n" in cli_error(m + ["--shard", "2"])
    assert CliRunner().invoke(app, ["gen-data", *m, "--features", "online"]).exit_code == 2  # the parser's choice
    assert "no such file" in cli_error(["-m", str(smol_tiny_dir), "--data", str(tmp_path / "x.jsonl")])
    assert "no usable conversations" in cli_error(["-m", str(smol_tiny_dir), "--data", str(data_file),
                                                   "--format", "alpaca", "--dry-run"])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert "not empty and holds no gen-data manifest" in cli_error(
        ["-m", str(smol_tiny_dir), "--data", str(data_file), "-o", str(busy), "--no-regenerate", "--features", "none"])
    assert (busy / "notes.txt").read_text() == "mine"


def test_regen_dtype_is_recorded_resumes_and_refuses_a_change(smol_tiny_dir, data_file, tmp_path, monkeypatch):
    """--regen-dtype: the store records what regeneration computed in when it is not --dtype's, the
    answers are those of the bf16 computation, and a rerun in another dtype is refused."""
    import eagle3cli.data.regenerate as regen

    out = tmp_path / "bf16"
    seen = []
    real = regen._regenerate_continuous
    monkeypatch.setattr(regen, "_regenerate_continuous", lambda *a, **k: seen.append(a[3].dtype) or real(*a, **k))
    # features at the target's own fp32 (--capture-dtype auto would follow the CPU)
    man = run(options(out, data_file, regen_dtype="bfloat16", capture_dtype="float32"),
              TargetSpec(str(smol_tiny_dir), device="cpu"))
    assert man["run"]["regen_dtype"] == "bfloat16" and man["source"]["generation"]["dtype"] == "bfloat16"
    assert "capture_dtype" not in man["run"]
    assert seen == ["bfloat16"] * 3  # every shard
    with pytest.raises(GenDataError, match=r"different settings \(regen_dtype\)"):
        run(options(out, data_file, regen_dtype="float32", capture_dtype="float32"),
            TargetSpec(str(smol_tiny_dir), device="cpu"))
    # auto without native bf16: --dtype's own, and nothing recorded (stores from before the option resume).
    monkeypatch.setattr(regen, "has_bf16_matmul", lambda: False)
    man = run(options(tmp_path / "fp32", data_file), TargetSpec(str(smol_tiny_dir), device="cpu"))
    assert "regen_dtype" not in man["run"] and man["source"]["generation"]["dtype"] == "float32"
    monkeypatch.setattr(regen, "has_bf16_matmul", lambda: True)
    man = run(options(tmp_path / "auto", data_file), TargetSpec(str(smol_tiny_dir), device="cpu"))
    assert man["run"]["regen_dtype"] == "bfloat16"
    m = ["-m", str(smol_tiny_dir), "--data", str(data_file), "--dry-run"]
    assert "--regen-dtype sets how the local target regenerates; it does nothing with --no-regenerate" in \
        cli_error(m + ["--no-regenerate", "--regen-dtype", "float32"])
    assert CliRunner().invoke(app, ["gen-data", *m, "--regen-dtype", "x"]).exit_code == 2  # the parser's choice


# ---------------------------------------------------------------- --endpoint


class FakeOpenAI(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible server: answers 'echo: <last user turn>' (503 once first)."""

    failures_left = 1
    requests: list = []

    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "fake-target", "object": "model"}]})
        self._send(404, {"error": "not found"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests.append(req)
        if cls.failures_left > 0:
            cls.failures_left -= 1
            return self._send(503, {"error": "warming up"})
        last = req["messages"][-1]["content"]
        if "TOO LONG" in last:
            return self._send(400, {"error": "context length exceeded"})
        n_ctx = len(req["messages"])
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": f"echo: {last} ({n_ctx})"},
                                      "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 5}})


@pytest.fixture()
def fake_server():
    FakeOpenAI.failures_left, FakeOpenAI.requests = 1, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_endpoint_regeneration(fake_server):
    convs = [[{"role": "system", "content": "Be nice."}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "dataset answer"}, {"role": "user", "content": "again"}],
             [{"role": "user", "content": "TOO LONG"}],
             [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "x"},
              {"role": "user", "content": "TOO LONG"}]]
    ep = Endpoint(fake_server, concurrency=2, retries=2)
    results, stats = regenerate_endpoint(ep, convs, GenSettings(max_new_tokens=7, temperature=0.5, top_p=0.9))
    assert results[0] == [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "echo: hi (2)"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "echo: again (4)"}]
    assert results[1] is None and list(stats.rejected) == [1] and "HTTP 400" in stats.rejected[1]
    assert results[2] == [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "echo: ok (1)"}]
    assert stats.answers == 3 and stats.dropped_turns == 1 and stats.generated_tokens == 15
    ok = [r for r in FakeOpenAI.requests if r["messages"][-1]["content"] == "again"][0]
    assert (ok["model"], ok["max_tokens"], ok["temperature"], ok["top_p"]) == ("fake-target", 7, 0.5, 0.9)
    # The own answer (not the dataset's) is the context of the next turn.
    assert ok["messages"][2] == {"role": "assistant", "content": "echo: hi (2)"}


def test_endpoint_gives_up_with_a_clear_error():
    ep = Endpoint("http://127.0.0.1:9", retries=1, timeout=2)  # nothing listens on port 9
    from eagle3cli.data.endpoint import EndpointError

    with pytest.raises(EndpointError, match=r"127.0.0.1:9/v1/models failed after 2 tries"):
        ep.resolve_model()


def test_gen_data_with_endpoint(fake_server, smol_tiny_dir, data_file, tmp_path, monkeypatch):
    import eagle3cli.model.target as target

    monkeypatch.setattr(target, "load_target",
                        lambda spec: pytest.fail("--endpoint with --features none needs no model"))
    man = run(options(tmp_path / "s", data_file, endpoint=fake_server, features="none", system="Be brief."),
              TargetSpec(str(smol_tiny_dir)))
    assert man["num_samples"] == 6 and man["source"]["endpoint"] == fake_server
    assert man["source"]["regeneration"]["answers"] == 9  # 3 one-turn + 3 two-turn conversations
    first = json.loads((tmp_path / "s" / "regenerated" / "part-00000.jsonl").read_text().splitlines()[0])
    assert first["messages"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Question 0: what is 0 plus 0?"},
                                 {"role": "assistant", "content": "echo: Question 0: what is 0 plus 0? (2)"}]


@pytest.mark.integration
@pytest.mark.skipif(not os.environ.get("EAGLE3_TEST_ENDPOINT"), reason="set EAGLE3_TEST_ENDPOINT to a server's URL")
def test_real_endpoint_20_conversations(tmp_path):
    """A real OpenAI-compatible server (e.g. vLLM CPU serving SmolLM2) regenerates 20 MT-bench
    conversations; the target given by EAGLE3_TEST_MODEL (default: the cached SmolLM2 folder)
    provides the tokenizer and the features."""
    model = os.environ.get("EAGLE3_TEST_MODEL",
                           str(Path("~/.cache/eagle3/models/SmolLM2-135M-Instruct").expanduser()))
    data = REPO.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"
    man = run(options(tmp_path / "s", data, endpoint=os.environ["EAGLE3_TEST_ENDPOINT"], max_samples=20,
                      max_new_tokens=64, max_length=512, shard_size=10, concurrency=8),
              TargetSpec(model, device="cpu"))
    assert man["complete"] and man["num_samples"] == 20
    assert man["source"]["regeneration"]["answers"] == 40  # two turns each
    regen = [json.loads(line) for p in sorted((tmp_path / "s" / "regenerated").glob("*.jsonl"))
             for line in p.read_text().splitlines()]
    assert all(m["content"].strip() for r in regen for m in r["messages"] if m["role"] == "assistant")
    assert FeatureStore(tmp_path / "s")[0]["aux"].shape[-1] == 3 * man["hidden_size"]


def test_prompts_longer_than_max_length_are_not_answered(smol_tiny_dir, data_file, tmp_path, monkeypatch):
    """The prompts render to 42+ tokens: with --max-length 40 nothing would be generated: refused
    before the model is loaded; past that check, the shards count every drop and the empty
    store is an error, not marked complete."""
    with pytest.raises(GenDataError, match=r"\(6 checked: first prompt reaches --max-length: 6\): raise --max-length"):
        run(options(tmp_path / "s", data_file, max_length=40, features="none"), TargetSpec(str(smol_tiny_dir)))
    import eagle3cli.data.gen_data as gd

    monkeypatch.setattr(gd.Pipeline, "preflight", lambda self: None)
    with pytest.raises(GenDataError, match=r"^no samples stored in .*first prompt reaches --max-length: 6\); the "
                       r"store is not marked complete: raise --max-length \(now 40\)$"):
        run(options(tmp_path / "s", data_file, max_length=40, features="none"), TargetSpec(str(smol_tiny_dir)))
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert man["num_samples"] == 0 and man["skipped"] == {"first prompt reaches --max-length": 6}
    assert man["shards_done"] == 3 and man["complete"] is False
    assert man["source"]["regeneration"] == {"answers": 0, "cut": 0, "dropped_turns": 9, "generated_tokens": 0}


def test_capture_reports_its_progress_and_matches_one_forward_a_sample():
    """With the dataset's answers, capture is all of a shard's work: it reports each micro-batch (the
    log's progress line follows it), and micro-batching leaves each sample's features its own."""
    from eagle3cli.data.samples import capture_samples
    from eagle3cli.model.target import capture
    from tests.helpers.tiny import tiny_model

    model = tiny_model("llama")
    lengths = [5, 9, 3, 12, 7]
    samples = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    seen = []
    capture_samples(model, samples, (1, 2, 5), token_budget=20, on_progress=seen.append)
    assert seen == sorted(seen) and seen[-1] == len(samples) and len(seen) > 1
    for s in samples:
        aux, final = capture(model, torch.tensor([s["input_ids"]]), (1, 2, 5), None)
        torch.testing.assert_close(s["aux"], aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s["final"], final[0], rtol=1e-5, atol=1e-5)


def test_capture_budget_is_small_on_a_cpu_and_a_dtype_only_where_it_holds():
    from eagle3cli.data.samples import capture_budget, capture_dtype

    assert capture_budget(torch.nn.Linear(2, 2)) == 2048
    # explicit dtypes: the target's own always; another only where regeneration computes in it
    assert capture_dtype("float32", "cpu", "float32", False, "bfloat16") == "float32"
    assert capture_dtype("bfloat16", "cpu", "float32", False, None) == "bfloat16"
    with pytest.raises(ValueError, match="a --load-in-8bit/4bit target keeps its own"):
        capture_dtype("bfloat16", "cpu", "float32", True, None)
    # auto never casts on a GPU, a quantized target, or beside fp32 regeneration
    assert capture_dtype("auto", "cuda:0", "bfloat16", False, None) == "bfloat16"
    assert capture_dtype("auto", "cpu", "float32", True, None) == "float32"
    assert capture_dtype("auto", "cpu", "float32", False, "float32") == "float32"
