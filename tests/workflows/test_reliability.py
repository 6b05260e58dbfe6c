"""Every fault a one-line error before work is spent, no silent bad output, resume that
cannot be fooled, and a suite that stands on its own (docs/troubleshooting.md lists each case)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3cli.cli import app

REPO = Path(__file__).resolve().parents[2]


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "500", **(env or {})})


def error_line(res) -> str:
    """The single ``error:`` line of a failed command (and no traceback in its output)."""
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return lines[0]


# ---------------------------------------------------------------- the boundary (item 5)

def test_fixtures_live_in_the_repository():
    from transformers import AutoTokenizer

    from tests.helpers.tiny import QWEN_TOKENIZER, SMOLLM2_TOKENIZER

    assert (REPO / "tests" / "fixtures" / "tokenizers") in SMOLLM2_TOKENIZER.parents
    assert "shared" not in QWEN_TOKENIZER.parts  # unpacked from tests/fixtures, not ../shared
    assert len(AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)) == 49152
    assert len(AutoTokenizer.from_pretrained(QWEN_TOKENIZER)) == 151936
    size = sum(p.stat().st_size for p in (REPO / "tests" / "fixtures" / "tokenizers").rglob("*") if p.is_file())
    assert size < 6_000_000


@pytest.fixture
def gen_data_raises(monkeypatch):
    """Make gen-data's pipeline raise a given exception, after the CLI parsed its options."""
    import eagle3cli.data.gen_data as gd

    def arm(exc):
        def boom(self):
            raise exc

        monkeypatch.setattr(gd.Pipeline, "run", boom)

    return arm


def test_full_disk_is_one_line(gen_data_raises, tmp_path):
    gen_data_raises(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "s" / "shard.tmp")))
    res = invoke("gen-data", "-m", "x/y", "--data", "d.jsonl", "-o", tmp_path / "s")
    assert res.exit_code == 1
    assert error_line(res) == (f"error: no space left on the device writing {tmp_path / 's' / 'shard.tmp'}: free "
                               "some space (or choose another --out) and run the same command again; finished "
                               "shards and checkpoints are kept")


def test_ctrl_c_in_gen_data_says_how_to_resume(gen_data_raises, tmp_path):
    gen_data_raises(KeyboardInterrupt())
    res = invoke("gen-data", "-m", "x/y", "--data", "d.jsonl", "-o", tmp_path / "s")
    assert res.exit_code == 130
    assert error_line(res) == (f"error: interrupted: finished shards in {tmp_path / 's'} are kept; run the same "
                               "command again to resume")


def test_debug_switch_shows_the_traceback(gen_data_raises, tmp_path):
    gen_data_raises(OSError(errno.ENOSPC, "No space left on device"))
    res = invoke("gen-data", "-m", "x/y", "--data", "d.jsonl", "-o", tmp_path / "s", env={"EAGLE3_DEBUG": "1"})
    assert isinstance(res.exception, OSError) and res.exception.errno == errno.ENOSPC


def test_a_bug_keeps_its_traceback(gen_data_raises, tmp_path):
    gen_data_raises(ValueError("a bug, not a user error"))
    res = invoke("gen-data", "-m", "x/y", "--data", "d.jsonl", "-o", tmp_path / "s")
    assert isinstance(res.exception, ValueError) and "error:" not in res.output


def test_every_user_error_class_shares_one_base():
    from eagle3cli.config.train_config import TrainError
    from eagle3cli.core.errors import Eagle3Error
    from eagle3cli.data.chat_mask import NoChatTemplate
    from eagle3cli.data.gen_errors import GenDataError
    from eagle3cli.data.merge_data import MergeError
    from eagle3cli.data.raw_rows import SourceError
    from eagle3cli.evaluate.eval_config import EvalError
    from eagle3cli.publish.push import DraftRejected, PushError

    for cls in (GenDataError, TrainError, EvalError, PushError, DraftRejected, SourceError, NoChatTemplate,
                MergeError):
        assert issubclass(cls, Eagle3Error), cls


# ---------------------------------------------------------------- data files (items 5, 6)

CHAT = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4."}]}


def test_utf8_bom_keeps_the_first_conversation(tmp_path):
    from eagle3cli.data.sources import load_conversations

    p = tmp_path / "notepad.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (json.dumps(CHAT) + "\n").encode() * 2)
    convs, report = load_conversations(str(p))
    assert len(convs) == 2 and not report.skipped
    q = tmp_path / "notepad.json"
    q.write_bytes(b"\xef\xbb\xbf" + json.dumps([CHAT]).encode())
    assert len(load_conversations(str(q))[0]) == 1


def test_non_utf8_file_is_one_line(smol_tiny_dir, tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes((json.dumps(CHAT) + "\n").encode() + '{"conversations": "caf\xe9"}\n'.encode("latin-1"))
    res = invoke("gen-data", "-m", smol_tiny_dir, "--data", p, "--dry-run")
    assert res.exit_code == 1
    assert error_line(res) == (f"error: {p}: not UTF-8 text (byte 0xe9 on line 2): save it as UTF-8, "
                               "e.g. iconv -f latin1 -t utf-8")


def test_openai_content_parts_are_joined(tmp_path):
    from eagle3cli.data.sources import load_conversations

    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                       {"type": "text", "text": "there"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]}]
    p = tmp_path / "parts.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs, report = load_conversations(str(p))
    assert convs[0].messages == [{"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Hi!"}]
    # an image part is an image now (vision-language targets): a path that is not there skips the row
    assert dict(report.skipped) == {"image file not found": 1,
                                    "non-string content in an assistant turn": 1}


def test_skip_summary_survives_rich_markup(smol_tiny_dir, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(CHAT) + "\n{not json\n")
    res = invoke("gen-data", "-m", smol_tiny_dir, "--data", p, "--dry-run")
    assert res.exit_code == 0, res.output
    assert ("data: 1 conversations kept of 2 rows read (format: sharegpt); skipped 1 (malformed JSON: 1); "
            "first: d.jsonl:2 (malformed JSON)") in res.output


# ---------------------------------------------------------------- eval, inspect, targets (items 1, 2, 5, 6)

@pytest.fixture(scope="module")
def draft_for_smol(smol_tiny_dir, tmp_path_factory):
    from tests.helpers.evaluate import make_draft

    return make_draft(smol_tiny_dir, tmp_path_factory.mktemp("draft") / "d")


@pytest.fixture
def no_model_load(monkeypatch):
    import eagle3cli.model.target as target

    monkeypatch.setattr(target, "load_target", lambda spec: pytest.fail("checked after loading the model"))


def test_eval_out_that_is_a_file_fails_before_any_prompt(smol_tiny_dir, draft_for_smol, tmp_path, no_model_load):
    out = tmp_path / "existing.txt"
    out.write_text("keep me")
    res = invoke("eval", "-m", smol_tiny_dir, "-d", draft_for_smol, "--task", "mt_bench", "-o", out)
    assert res.exit_code == 1
    assert error_line(res) == f"error: --out {out} is an existing file, not a folder: choose another --out"
    assert out.read_text() == "keep me"


def test_eval_turns_must_be_a_list(tmp_path):
    from eagle3cli.evaluate.eval_config import EvalError
    from eagle3cli.evaluate.tasks import load_turns_file

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"turns": "not a list"}) + "\n")
    with pytest.raises(EvalError, match=r"t.jsonl:1: expected a record with a non-empty 'turns' list of strings"):
        load_turns_file(p)


def test_mt_bench_does_not_wait_for_an_unreachable_hub(monkeypatch):
    import time

    import datasets

    from eagle3cli.evaluate.tasks import load_task

    calls = []

    def slow_hub(*a, **k):  # what datasets does here: retry an unreachable Hub for ~46 s, then fail
        calls.append(a)
        raise ConnectionError("unreachable")

    monkeypatch.setattr(datasets, "load_dataset", slow_hub)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    t0 = time.time()
    task, prompts = load_task("mt_bench", limit=2)
    assert (task, [p.id for p in prompts], calls) == ("mt_bench", ["81", "82"], [])
    assert time.time() - t0 < 5


def test_inspect_truncated_weights_is_a_problem_not_a_traceback(draft_for_smol, tmp_path):
    import shutil

    d = tmp_path / "d"
    shutil.copytree(draft_for_smol, d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    res = invoke("inspect", d)
    assert res.exit_code == 1 and "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    assert ("problem: weights: model.safetensors is unreadable (Error while deserializing header: incomplete "
            "metadata, file not fully covered): export or download it again") in res.output
    res = invoke("push", d, "--repo", "a/b", "--dry-run", tmp_path / "o")
    assert res.exit_code == 1 and "unreadable" in res.output and not (tmp_path / "o").exists()


def test_config_json_that_is_a_list(draft_for_smol, smol_tiny_dir, tmp_path):
    import shutil

    d, m = tmp_path / "d", tmp_path / "m"
    shutil.copytree(draft_for_smol, d)
    shutil.copytree(smol_tiny_dir, m)
    for folder in (d, m):
        (folder / "config.json").write_text("[1, 2]")
    res = invoke("inspect", d)
    assert res.exit_code == 1
    assert "problem: config: config.json holds a JSON list, engines expect an object" in res.output
    res = invoke("inspect", draft_for_smol, "-m", m)
    assert error_line(res) == (f"error: {m / 'config.json'} holds a JSON list, not an object: restore the "
                               "model's config.json")


@pytest.mark.parametrize("command", ["gen-data", "eval", "inspect", "train"])
def test_mistyped_local_model_path_does_not_blame_the_hub(command, smol_tiny_dir, draft_for_smol, tmp_path):
    typo = str(smol_tiny_dir) + "x"
    args = {"gen-data": ["gen-data", "-m", typo, "--data", "d.jsonl"],
            "eval": ["eval", "-m", typo, "-d", draft_for_smol, "-o", tmp_path / "o"],
            "inspect": ["inspect", draft_for_smol, "-m", typo],
            "train": ["train", "--model", typo, "--data", tmp_path / "store", "--recipe", "none"]}[command]
    if command == "train":
        (tmp_path / "store").mkdir()
        (tmp_path / "store" / "manifest.json").write_text(json.dumps({"format": "eagle3-features", "version": 1}))
    line = error_line(invoke(*args))
    assert f"--model {typo}: no such folder (check the path; a Hub id is OWNER/NAME)" in line
    assert "huggingface" not in line.lower() and "repo id" not in line.lower()


def test_inspect_names_the_real_target_hidden_size(draft_for_smol, tmp_path):
    from tests.helpers.tiny import save_tiny

    big = save_tiny(tmp_path / "big", "llama", hidden_size=96, intermediate_size=128)
    res = invoke("inspect", draft_for_smol, "-m", big)
    assert res.exit_code == 1
    rows = {" ".join(c.split()) for ln in res.output.splitlines() for c in [ln.replace("│", " | ")]}
    assert f"| --model {big}: hidden / vocab | 96 / 256 |" in rows
    assert "| hidden / built for target hidden | 64 / 64 |" in rows
    assert "problem: target: hidden size 96, the draft was built for 64" in res.output


# ---------------------------------------------------------------- gen-data (items 1, 2, 4, 5, 6)

def chats(n=6):
    return [{"conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                               {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(n)]


@pytest.fixture
def data6(tmp_path):
    p = tmp_path / "chats.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in chats()) + "\n")
    return p


def gen(model, data, out, *extra):
    """gen-data without a model forward (dataset answers, tokens only): fast, same checks."""
    return invoke("gen-data", "-m", model, "--data", data, "-o", out, "--no-regenerate", "--features", "none",
                  "--max-length", 96, "--shard-size", 2, *extra)


def test_gen_data_max_length_too_small_is_an_error(smol_tiny_dir, data6, tmp_path, no_model_load):
    res = invoke("gen-data", "-m", smol_tiny_dir, "--data", data6, "-o", tmp_path / "s", "--max-length", 32)
    assert res.exit_code == 1
    assert error_line(res) == ("error: no conversation would give a training sample (6 checked: first prompt "
                               "reaches --max-length: 6): raise --max-length (now 32)")
    assert not (tmp_path / "s").exists()


def test_chat_template_with_a_jinja_syntax_error(smol_tiny_dir, data6, tmp_path, no_model_load):
    tpl = tmp_path / "broken.jinja"
    tpl.write_text("{% for m in messages %}{{ m.content }}\n{% endfor\n")
    res = invoke("gen-data", "-m", smol_tiny_dir, "--data", data6, "-o", tmp_path / "s", "--chat-template", tpl)
    assert res.exit_code == 1
    line = error_line(res)
    assert line.startswith(f"error: {tpl}: Jinja syntax error on line 2: ") and not (tmp_path / "s").exists()


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or positive, got -1.0"),
    (["--temperature", "nan"], "--temperature must be 0 (greedy) or positive, got nan"),
    (["--top-p", "0"], "--top-p must lie in (0, 1], got 0.0"),
])
def test_gen_data_generation_options(smol_tiny_dir, data6, tmp_path, no_model_load, flags, message):
    res = invoke("gen-data", "-m", smol_tiny_dir, "--data", data6, "-o", tmp_path / "s", *flags)
    assert res.exit_code == 1 and error_line(res) == f"error: {message}"


def test_gen_data_out_that_is_a_file(smol_tiny_dir, data6, tmp_path, no_model_load):
    out = tmp_path / "existing.txt"
    out.write_text("keep me")
    res = invoke("gen-data", "-m", smol_tiny_dir, "--data", data6, "-o", out)
    assert error_line(res) == f"error: --out {out} is an existing file, not a folder: choose another --out"
    assert out.read_text() == "keep me"


def test_disk_estimate_is_compared_with_free_space(smol_tiny_dir, data6, tmp_path, monkeypatch):
    import shutil as _shutil

    import eagle3cli.data.estimates as estimates

    monkeypatch.setattr(estimates.shutil, "disk_usage", lambda p: _shutil._ntuple_diskusage(10**6, 10**6 - 100, 100))
    res = gen(smol_tiny_dir, data6, tmp_path / "s")
    assert res.exit_code == 1
    line = error_line(res)
    # the estimate counts what the chat template renders (system prompt and turn headers included)
    assert line.startswith("error: not enough disk space: the remaining shards need ~1.5 KB, ") and line.endswith(
        f"100 B is free at {tmp_path / 's'}: free space, choose another --out or lower --max-samples "
        "(--skip-disk-check if the estimate is too high)")
    assert not list((tmp_path / "s").glob("shards/*"))
    res = gen(smol_tiny_dir, data6, tmp_path / "s", "--skip-disk-check")
    assert res.exit_code == 0, res.output


def test_same_size_edit_of_the_data_is_not_resumed(smol_tiny_dir, data6, tmp_path):
    assert gen(smol_tiny_dir, data6, tmp_path / "s").exit_code == 0
    text = data6.read_text()
    data6.write_text(text.replace("It is 4.", "It is 5."))  # same size, other content
    assert data6.stat().st_size == len(text)
    res = gen(smol_tiny_dir, data6, tmp_path / "s")
    assert res.exit_code == 1 and "holds a run with different settings (data_fingerprint)" in error_line(res)


def test_truncated_shard_with_a_sidecar_is_redone(smol_tiny_dir, data6, tmp_path):
    out = tmp_path / "s"
    assert gen(smol_tiny_dir, data6, out).exit_code == 0
    shard = out / "shards" / "shard-00-00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:-10])
    other = out / "shards" / "shard-00-00002.safetensors"
    other.write_bytes(other.read_bytes()[:-1] + b"!")  # same length, other bytes
    res = gen(smol_tiny_dir, data6, out)
    assert res.exit_code == 0, res.output
    assert (f"shard 1: shard-00-00001.safetensors is {len(good) - 10:,} bytes, its sidecar says {len(good):,} "
            "(truncated or replaced): redoing it") in res.output
    assert "shard 2: shard-00-00002.safetensors differs from the sha256 its sidecar recorded" in res.output
    assert "resuming: 1 of 3 shards of this rank already done" in res.output
    assert shard.read_bytes() == good


def test_stray_copy_of_a_shard_is_not_read(smol_tiny_dir, data6, tmp_path):
    import shutil

    from eagle3cli.data.features import FeatureStore

    out = tmp_path / "s"
    assert gen(smol_tiny_dir, data6, out).exit_code == 0
    for suffix in (".safetensors", ".json"):
        shutil.copy(out / "shards" / f"shard-00-00000{suffix}", out / "shards" / f"shard-00-00000 (copy){suffix}")
    store = FeatureStore(out)
    assert len(store) == store.manifest["num_samples"] == 6 and len(store.shards) == 3
    res = gen(smol_tiny_dir, data6, out)  # the rerun is not confused by the copy either
    assert res.exit_code == 0 and "resuming: 3 of 3 shards" in res.output


# ---------------------------------------------------------------- train (items 1, 2, 3, 4, 5, 8)

@pytest.fixture(scope="module")
def token_store(smol_tiny_dir, tmp_path_factory):
    """A finished tokens-only store of 6 conversations (answers start at token ~42)."""
    root = tmp_path_factory.mktemp("tokstore")
    data = root / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in chats()) + "\n")
    res = gen(smol_tiny_dir, data, root / "store")
    assert res.exit_code == 0, res.output
    return root / "store"


def train_args(store, out, *extra):
    return ["train", "--data", store, "--out", out, "--online", "--recipe", "none", "--draft-vocab-size", 64,
            "--ttt-steps", 1, "--max-tokens", 256, "--val-fraction", 0, "--epochs", 1, "--log-every", 1, *extra]


def test_train_out_that_is_a_file(token_store, tmp_path, no_model_load):
    out = tmp_path / "existing.txt"
    out.write_text("keep me")
    res = invoke(*train_args(token_store, out))
    assert error_line(res) == f"error: --out {out} is an existing file, not a folder: choose another --out"
    assert out.read_text() == "keep me"


@pytest.mark.parametrize("flags, message", [
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "1e38"], "--lr must lie in (0, 1] (EAGLE-3 drafts train at 1e-4 to 1e-3), got 1e+38"),
    (["--step-decay", "inf"], "--step-decay must be a finite number, got inf"),
])
def test_train_refuses_absurd_numbers(token_store, tmp_path, no_model_load, flags, message):
    res = invoke(*train_args(token_store, tmp_path / "o", *flags))
    assert res.exit_code == 1 and error_line(res) == f"error: {message}"


def test_train_with_no_learned_tokens_is_an_error(token_store, tmp_path):
    res = invoke(*train_args(token_store, tmp_path / "o", "--max-tokens", 16))
    assert res.exit_code == 1
    assert error_line(res) == ("error: no learned tokens: every training sample's assistant tokens lie beyond the "
                               "first 16 tokens that --max-tokens 16 keeps (the first answer token is at position "
                               "42): raise --max-tokens")
    assert not (tmp_path / "o" / "config.json").exists()


def test_incomplete_store_is_refused_unless_allowed(smol_tiny_dir, token_store, tmp_path):
    import shutil

    store = tmp_path / "part"
    shutil.copytree(token_store, store)
    (store / "shards" / "shard-00-00001.json").unlink()  # as a rank or a killed run leaves it
    man = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**man, "complete": False, "shards_done": 2}))
    res = invoke(*train_args(store, tmp_path / "o"))
    assert res.exit_code == 1
    assert error_line(res) == (f"error: store {store} is incomplete: 2 of 3 shards are done (missing: 1): finish it "
                               "by running the same gen-data command again (every --shard rank), or pass "
                               "--allow-incomplete to train on what is there")
    res = invoke(*train_args(store, tmp_path / "o", "--allow-incomplete", "--max-steps", 20))
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"warning: store {store} is incomplete (2 of 3 shards are done (missing: 1)); training on it" in text
    # 4 samples of ~50 tokens in 256-token batches: one epoch is 1 step, well before --max-steps 20
    plan = "the 1 epoch of 1 steps end the run before --max-steps 20: raise --epochs (or add data) to train longer"
    assert f"plan: 1 optimizer steps ({plan})" in text and f"stopped after 1 optimizer steps: {plan}" in text
    assert json.loads((tmp_path / "o" / "config.json").read_text())["eagle3_training"]["num_samples"] == 4


def test_train_refuses_a_truncated_shard(token_store, tmp_path, no_model_load):
    import shutil

    store = tmp_path / "s"
    shutil.copytree(token_store, store)
    shard = store / "shards" / "shard-00-00002.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    res = invoke(*train_args(store, tmp_path / "o"))
    assert error_line(res) == (f"error: store {store}: shard-00-00002.safetensors is 100 bytes, its sidecar says "
                               f"{size:,} (truncated or replaced): run the same gen-data command again to redo it")


def test_corrupt_optimizer_state_on_resume(token_store, smol_tiny_dir, tmp_path):
    from eagle3cli.config.train_config import TrainConfig
    from eagle3cli.train.trainer import train

    out = tmp_path / "o"
    cfg = TrainConfig(data=str(token_store), out=str(out), online=True, draft_vocab_size="64", ttt_steps=1,
                      max_tokens=128, val_fraction=0.0, epochs=3, save_every=1, log_every=1)
    train(cfg, quiet=True, stop_after=2)
    last = out / "checkpoints" / "step-00000002"
    (last / "optim.pt").write_bytes(b"not a checkpoint")
    res = invoke("train", "--data", token_store, "--out", out, "--online", "--recipe", "none", "--draft-vocab-size",
                 "64", "--ttt-steps", 1, "--max-tokens", 128, "--val-fraction", 0, "--epochs", 3, "--save-every", 1,
                 "--log-every", 1, "--resume")
    line = error_line(res)
    assert line.startswith(f"error: checkpoint {last} is unreadable (optim.pt: ") and line.endswith(
        f"): delete {last} to resume from step-00000001")
    assert (last / "trainer_state.json").exists()  # nothing deleted on the user's behalf


def test_published_files_carry_no_local_paths(token_store, smol_tiny_dir, tmp_path):
    res = invoke(*train_args(token_store, tmp_path / "o", "--model", smol_tiny_dir))
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "o" / "config.json").read_text())["eagle3_training"]
    assert meta["data"] == "chats.jsonl (the dataset's own answers)"
    res = invoke("push", tmp_path / "o", "--repo", "me/smol-eagle3", "--base-model",
                 "HuggingFaceTB/SmolLM2-135M-Instruct",
                 "--dataset-id", "Aeala/ShareGPT_Vicuna_unfiltered", "--dry-run", tmp_path / "pub")
    assert res.exit_code == 0, res.output
    for name in ("config.json", "eagle3_training.json", "README.md"):
        text = (tmp_path / "pub" / name).read_text()
        assert str(tmp_path) not in text and "/tmp/" not in text, name
    pub = json.loads((tmp_path / "pub" / "eagle3_training.json").read_text())
    assert pub["target"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert pub["datasets"] == ["Aeala/ShareGPT_Vicuna_unfiltered"]
    from huggingface_hub import ModelCard

    assert ModelCard.load(tmp_path / "pub" / "README.md").data.datasets == ["Aeala/ShareGPT_Vicuna_unfiltered"]
    # the dry run can be repeated into the same folder (its config differs from the draft's record only)
    assert invoke("push", tmp_path / "o", "--repo", "me/smol-eagle3", "--base-model",
                  "HuggingFaceTB/SmolLM2-135M-Instruct", "--dry-run", tmp_path / "pub").exit_code == 0


def test_push_without_a_token_fails_before_the_network(draft_for_smol, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda *a, **k: pytest.fail("went to the network"))
    res = invoke("push", draft_for_smol, "--repo", "me/x", "--base-model", "a/b")
    assert res.exit_code == 1
    assert error_line(res) == ("error: no Hub token: log in with `hf auth login`, set HF_TOKEN or pass --token "
                               "(--dry-run OUT_DIR needs none)")


def test_full_disk_during_training_is_one_line(token_store, tmp_path, monkeypatch):
    import eagle3cli.train.trainer as trainer

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o" / "checkpoints"))

    monkeypatch.setattr(trainer, "train", full)
    res = invoke(*train_args(token_store, tmp_path / "o"))
    assert res.exit_code == 1
    assert error_line(res).startswith(f"error: no space left on the device writing {tmp_path / 'o' / 'checkpoints'}: ")


def test_garbled_manifest_is_one_line(token_store, tmp_path):
    import shutil

    store = tmp_path / "s"
    shutil.copytree(token_store, store)
    (store / "manifest.json").write_text('{"format": "eagle3-fea')
    res = invoke("train", "--data", store, "--out", tmp_path / "o")  # --recipe auto reads the manifest first
    assert error_line(res).startswith(f"error: {store / 'manifest.json'} is not valid JSON (")
    res = invoke(*train_args(store, tmp_path / "o"))
    assert error_line(res).endswith("): run the same gen-data command again")


def test_eval_refuses_a_garbled_draft_before_loading(smol_tiny_dir, draft_for_smol, tmp_path, no_model_load):
    import shutil

    d = tmp_path / "d"
    shutil.copytree(draft_for_smol, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    res = invoke("eval", "-m", smol_tiny_dir, "-d", d, "-o", tmp_path / "o")
    assert res.exit_code == 1
    assert error_line(res).startswith(f"error: draft {d} does not fit this target: weights: model.safetensors is "
                                      "unreadable (")


def test_ctrl_c_in_train_says_how_to_resume(token_store, tmp_path, monkeypatch):
    import eagle3cli.train.trainer as trainer

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    res = invoke(*train_args(token_store, tmp_path / "o"))
    assert res.exit_code == 130
    assert error_line(res) == (f"error: interrupted: checkpoints in {tmp_path / 'o'}/checkpoints are kept; continue "
                               "with the same command plus --resume")


def test_eval_turns_file_with_a_bom_or_not_utf8(tmp_path):
    from eagle3cli.evaluate.eval_config import EvalError
    from eagle3cli.evaluate.tasks import load_turns_file

    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"turns": ["Hi"]}).encode() + b"\n")
    assert [x.turns for x in load_turns_file(p)] == [["Hi"]]
    p.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    with pytest.raises(EvalError,
                       match=r"t.jsonl: not UTF-8 text \(invalid continuation byte at byte 15\): save it as UTF-8"):
        load_turns_file(p)
