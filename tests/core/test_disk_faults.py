"""A disk that fills or turns read-only part-way (issue 46): every writer gives one ``error:`` line
and exit 1, no traceback, no temporary file left behind, and the same command run again once the
fault is gone ends equal to an uninterrupted run.

The fault is injected where every writer commits a finished temporary file or folder
(``io_utils._commit``): the n-th commit (of the files whose name matches) cuts the temporary
file to half, as a full disk leaves it, and raises ``OSError(ENOSPC)`` or ``OSError(EROFS)``.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.core import io_utils
from eagle3cli.core.errors import WriteError
from tests.helpers.quickstart import write_prompts
from tests.helpers.tiny import tiny_config

PHRASE = {errno.ENOSPC: "no space left on the device", errno.EROFS: "read-only file system"}
CODES = [errno.ENOSPC, errno.EROFS]
IDS = ["ENOSPC", "EROFS"]


class Faults:
    """Count every commit of a finished temporary file or folder; fail the ``n``-th one whose
    name matches ``match`` with OSError(``code``). ``n=None``: only count (``paths``)."""

    def __init__(self, n: int | None = None, code: int = errno.ENOSPC, match: str = "*"):
        self.n, self.code, self.match = n, code, match
        self.paths: list[Path] = []
        self.hit: Path | None = None
        self._seen = 0

    def __enter__(self):
        self._mp = pytest.MonkeyPatch()
        real = io_utils._commit

        def commit(tmp, path):
            path = Path(path)
            self.paths.append(path)
            if self.n is not None and self.hit is None and fnmatch.fnmatch(path.name, self.match):
                self._seen += 1
                if self._seen == self.n:
                    self.hit = path
                    if Path(tmp).is_file():
                        os.truncate(tmp, Path(tmp).stat().st_size // 2)  # what a full disk leaves
                    raise OSError(self.code, os.strerror(self.code), str(tmp))
            return real(tmp, path)

        self._mp.setattr(io_utils, "_commit", commit)
        return self

    def __exit__(self, *exc):
        self._mp.undo()


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})


def assert_one_line(res, faults: Faults):
    """Exit 1, one ``error:`` line (the last) naming the file and the OS error, no traceback."""
    assert faults.hit is not None, f"the fault was never reached: {[p.name for p in faults.paths]}"
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.output
    assert f"writing {faults.hit}: " in errors[0] and PHRASE[faults.code] in errors[0], errors[0]
    assert "run the same command again" in errors[0]


def temp_files(*roots: Path) -> list[Path]:
    return [p for r in roots if r.exists() for p in r.rglob("*") if ".tmp" in p.name]


def tree_bytes(root: Path, pattern: str = "*") -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob(pattern)) if p.is_file()}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the helper itself

@pytest.mark.parametrize("code", CODES, ids=IDS)
def test_helper_keeps_the_old_file_and_leaves_no_temporary(tmp_path, code):
    target = tmp_path / "a.json"
    io_utils.write_json(target, {"v": 1})
    before = target.read_bytes()
    with Faults(1, code) as f, pytest.raises(WriteError) as e:
        io_utils.write_json(target, {"v": 2, "pad": "x" * 10000})
    assert f.hit == target and target.read_bytes() == before and not temp_files(tmp_path)
    assert str(e.value) == (f"{PHRASE[code]} writing {target}: "
                            + {errno.ENOSPC: "free some space (or choose another --out)",
                               errno.EROFS: "choose another --out on a writable disk (or remount it read-write)"}[code]
                            + " and run the same command again; finished shards and checkpoints are kept")


def test_helper_names_a_file_in_the_way_and_a_real_size_limit(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(WriteError, match=r"^not a directory writing .*/f/sub: a part of that path is a file"):
        io_utils.write_json(tmp_path / "f" / "sub" / "a.json", {})
    with pytest.raises(WriteError, match=r"^file exists writing .*/f: a file is where a folder should be"):
        io_utils.ensure_dir(tmp_path / "f")
    # a real write failure inside safetensors' Rust writer and torch.save (no patch): the file-size
    # limit makes the kernel refuse the write (EFBIG) part-way, as a full disk would (ENOSPC)
    import resource
    import subprocess
    import sys

    script = (
        "import resource, sys, torch\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n"
        "from eagle3cli.core import io_utils\n"
        "from eagle3cli.core.errors import WriteError\n"
        "for fn, name in ((io_utils.save_safetensors, 'w.safetensors'), (io_utils.save_torch, 'o.pt')):\n"
        "    try:\n"
        "        fn({'w': torch.ones(100000)}, sys.argv[1] + '/' + name)\n"
        "    except WriteError as e:\n"
        "        print(e)\n")
    assert resource.RLIMIT_FSIZE
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split(" writing ")[1].split(":")[0] for ln in lines] == [str(tmp_path / "w.safetensors"),
                                                                       str(tmp_path / "o.pt")]
    assert all(ln.startswith("file too large for the file system") for ln in lines)
    assert not temp_files(tmp_path) and not (tmp_path / "w.safetensors").exists()


def test_boundary_maps_a_disk_error_wherever_it_surfaces():
    """An OSError(EROFS) or safetensors' text-only ENOSPC raised outside the helper is one line too;
    an OSError no write can cause (a missing input) is left to the command."""
    from safetensors import SafetensorError

    from eagle3cli.core.errors import message_for

    line, code = message_for(OSError(errno.EROFS, "Read-only file system", "/data/x"))
    assert code == 1 and line.startswith("read-only file system writing /data/x: choose another --out")
    line, code = message_for(SafetensorError("Error while serializing: I/O error: No space left on device "
                                             "(os error 28)"))
    assert code == 1 and line.startswith("no space left on the device: free some space")
    assert message_for(OSError(errno.ENOENT, "No such file or directory", "/data/x")) is None
    assert message_for(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None


# ---------------------------------------------------------------- gen-data (and the store for train)

def gen_args(model, data, out):
    return ["gen-data", "-m", model, "--data", data, "-o", out, "--max-new-tokens", "6", "--max-length", "96",
            "--shard-size", "2", "--batch-size", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def gen_ref(smol_tiny_dir, tmp_path_factory):
    """(data file, an uninterrupted store, the files it committed in order)."""
    root = tmp_path_factory.mktemp("gen")
    data = root / "chats.jsonl"
    write_prompts(data, 6)
    with Faults() as f:
        res = cli(*gen_args(smol_tiny_dir, data, root / "ref"))
    assert res.exit_code == 0, res.output
    return data, root / "ref", f.paths


def store_content(out: Path) -> dict:
    man = json.loads((out / "manifest.json").read_text())
    return {"shards": tree_bytes(out / "shards", "*.safetensors"), "regenerated": tree_bytes(out, "*.jsonl"),
            "manifest": {k: man[k] for k in ("num_samples", "num_tokens", "num_masked_tokens", "bytes", "complete",
                                              "shards_done", "shards_planned")}}


@pytest.mark.parametrize("code,match,n", [(errno.ENOSPC, "shard-*.safetensors", 2),
                                          (errno.EROFS, "shard-*.json", 3),
                                          (errno.ENOSPC, "part-*.jsonl", 2)],
                         ids=["ENOSPC-second-shard", "EROFS-third-sidecar", "ENOSPC-regenerated-answers"])
def test_gen_data_stops_in_one_line_and_resumes_to_the_same_store(gen_ref, smol_tiny_dir, tmp_path, code, match, n):
    data, ref, committed = gen_ref
    assert sum(fnmatch.fnmatch(p.name, match) for p in committed) >= n
    out = tmp_path / "store"
    with Faults(n, code, match) as f:
        res = cli(*gen_args(smol_tiny_dir, data, out))
    assert_one_line(res, f)
    assert not temp_files(out) and not f.hit.exists()
    man = json.loads((out / "manifest.json").read_text())
    assert not man["complete"] and man["shards_done"] < man["shards_planned"] == 3
    res = cli(*gen_args(smol_tiny_dir, data, out))  # the same command, the fault gone
    assert res.exit_code == 0, res.output
    assert "resum" in res.output.lower()
    assert store_content(out) == store_content(ref)
    assert not temp_files(out)


# ---------------------------------------------------------------- train (--resume)

def train_args(model, store, out, *extra):
    return ["train", "--data", store, "--model", model, "--out", out, "--draft-vocab-size", "256", "--ttt-steps",
            "2", "--epochs", "2", "--max-tokens", "160", "--val-fraction", "0", "--save-every", "1",
            "--warmup-ratio", "0", "--seed", "0", *extra]


@pytest.fixture(scope="module")
def train_ref(gen_ref, smol_tiny_dir, tmp_path_factory):
    _, store, _ = gen_ref
    out = tmp_path_factory.mktemp("train") / "ref"
    with Faults() as f:
        res = cli(*train_args(smol_tiny_dir, store, out))
    assert res.exit_code == 0, res.output
    return out, f.paths


@pytest.mark.parametrize("code,match,n", [(errno.ENOSPC, "model.safetensors", 2),
                                          (errno.EROFS, "step-*", 2),
                                          (errno.ENOSPC, "config.json", 1)],
                         ids=["ENOSPC-second-checkpoint-weights", "EROFS-second-checkpoint-rename",
                              "ENOSPC-exported-config"])
def test_train_stops_in_one_line_and_resumes_to_the_same_draft(gen_ref, train_ref, smol_tiny_dir, tmp_path, code,
                                                               match, n):
    from eagle3cli.train.checkpoints import checkpoint_dirs

    _, store, _ = gen_ref
    ref, committed = train_ref
    steps = [p.name for p in committed if p.name.startswith("step-")]
    assert len(steps) >= 3, steps
    out = tmp_path / "o"
    with Faults(n, code, match) as f:
        res = cli(*train_args(smol_tiny_dir, store, out))
    assert_one_line(res, f)
    assert not temp_files(out)
    kept = [p.name for p in checkpoint_dirs(out)]
    if match != "config.json":  # the second checkpoint never became one: the first is the last
        assert kept == steps[:1]
        assert not (out / "model.safetensors").exists()
    else:
        assert kept and not (out / "config.json").exists()
    res = cli(*train_args(smol_tiny_dir, store, out, "--resume"))
    assert res.exit_code == 0, res.output
    assert same_tensors(tensors(out / "model.safetensors"), tensors(ref / "model.safetensors"))
    assert [p.name for p in checkpoint_dirs(out)] == [p.name for p in checkpoint_dirs(ref)]
    assert not temp_files(out)


# ---------------------------------------------------------------- merge-data

@pytest.fixture(scope="module")
def writers(gen_ref, smol_tiny_dir, tmp_path_factory):
    data, _, _ = gen_ref
    root = tmp_path_factory.mktemp("writers")
    for i in range(2):
        res = cli("gen-data", "-m", smol_tiny_dir, "--data", data, "-o", root / f"w{i}", "--no-regenerate",
                  "--max-length", "96", "--shard-size", "2", "--device", "cpu", "--shard", f"{i}/2")
        assert res.exit_code == 0, res.output
    out = root / "merged"
    res = cli("merge-data", out, "--from", root / "w0", "--from", root / "w1")
    assert res.exit_code == 0, res.output
    return [root / "w0", root / "w1"], out


@pytest.mark.parametrize("code,match,n", [(errno.ENOSPC, "shard-*.safetensors", 2), (errno.EROFS, "shard-*.json", 1)],
                         ids=["ENOSPC-second-shard", "EROFS-first-sidecar"])
def test_merge_data_stops_in_one_line_and_finishes_on_rerun(writers, tmp_path, code, match, n):
    (w0, w1), ref = writers
    out = tmp_path / "m"
    with Faults(n, code, match) as f:
        res = cli("merge-data", out, "--from", w0, "--from", w1)
    assert_one_line(res, f)
    assert not temp_files(out) and not f.hit.exists()
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    res = cli("merge-data", out, "--from", w0, "--from", w1)
    assert res.exit_code == 0, res.output
    assert tree_bytes(out / "shards") == tree_bytes(ref / "shards")
    assert json.loads((out / "manifest.json").read_text())["complete"]
    assert not temp_files(out)


# ---------------------------------------------------------------- eval

def eval_draft(target_dir: Path, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3cli.model.draft import DraftConfig, Eagle3Draft
    from eagle3cli.model.layers import default_layer_ids
    from eagle3cli.publish.export import save_draft

    cfg = AutoConfig.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    d = Eagle3Draft(DraftConfig.from_target(cfg, 2048, default_layer_ids(cfg.num_hidden_layers)),
                    embed_weight=target.get_input_embeddings().weight)
    d.init_weights(seed=0)
    d.set_vocab(torch.arange(2048))
    return save_draft(d, out)


def measured(results: dict) -> dict:
    """results.json without what a clock decides."""
    t = results["tasks"]["mini"]
    return {"tau": t["tau"], "n_alpha": t["n_alpha"], "lossless": t["lossless"], "num_prompts": t["num_prompts"],
            "settings": {k: v for k, v in results["settings"].items() if "time" not in k and "second" not in k}}


@pytest.mark.parametrize("code,match", [(errno.ENOSPC, "results.json"), (errno.EROFS, "results.png")], ids=IDS)
def test_eval_results_fault_is_one_line_and_the_rerun_writes_them(smol_tiny_dir, tmp_path, code, match):
    draft = eval_draft(smol_tiny_dir, tmp_path / "draft")
    turns = tmp_path / "mini.jsonl"
    turns.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 12 times 7?"]}) + "\n")
    args = ["eval", "--model", smol_tiny_dir, "--draft", draft, "--task", "mini", "--data", turns,
            "--max-new-tokens", "8", "--mode", "chain", "--steps", "2"]
    res = cli(*args, "--out", tmp_path / "ref")
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    with Faults(1, code, match) as f:
        res = cli(*args, "--out", out)
    assert_one_line(res, f)
    assert not temp_files(out) and not (out / match).exists()
    res = cli(*args, "--out", out)
    assert res.exit_code == 0, res.output
    assert measured(json.loads((out / "results.json").read_text())) == \
        measured(json.loads((tmp_path / "ref" / "results.json").read_text()))
    assert (out / "results.png").stat().st_size > 1000 and not temp_files(out)


# ---------------------------------------------------------------- convert, export-gguf, push --dry-run

@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from eagle3cli.model.draft import DraftConfig, Eagle3Draft
    from eagle3cli.publish.export import save_draft

    cfg = tiny_config("llama")
    d = Eagle3Draft(DraftConfig.from_target(cfg, 64, (2, 4, 5)))
    d.init_weights(seed=0)
    d.set_vocab(torch.arange(0, 256, 4))
    meta = {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "layer_ids": [2, 4, 5]}
    return save_draft(d, tmp_path_factory.mktemp("draft") / "draft", metadata=meta)


@pytest.mark.parametrize("n", [1, 2], ids=["weights", "config"])
@pytest.mark.parametrize("code", CODES, ids=IDS)
def test_convert_fault_is_one_line_and_the_rerun_is_byte_equal(draft_dir, tmp_path, code, n):
    args = ["convert", draft_dir, "--to", "speculators"]
    res = cli(*args, "--out", tmp_path / "ref")
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    with Faults(n, code) as f:
        res = cli(*args, "--out", out)
    assert_one_line(res, f)
    assert f.hit.name == ("model.safetensors", "config.json")[n - 1] and not f.hit.exists()
    assert not temp_files(out)
    res = cli(*args, "--out", out)
    assert res.exit_code == 0, res.output
    assert tree_bytes(out) == tree_bytes(tmp_path / "ref")


def tiny_target_gguf(path: Path, vocab: int) -> Path:
    """Just what the draft's GGUF takes from its target's: the architecture, the layer count and
    the tokenizer."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(8)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("code", CODES, ids=IDS)
def test_export_gguf_fault_is_one_line_and_the_rerun_is_byte_equal(draft_dir, tmp_path, code, monkeypatch):
    monkeypatch.delenv("EAGLE3_LLAMA_CPP", raising=False)
    target = tiny_target_gguf(tmp_path / "target.gguf",
                              json.loads((draft_dir / "config.json").read_text())["vocab_size"])
    args = ["export-gguf", draft_dir, "--target-gguf", target, "--outtype", "f32", "--outtype", "q8_0"]
    res = cli(*args, "-o", tmp_path / "ref")
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    with Faults(2, code) as f:  # the second file: draft-f32.gguf is written, draft-q8_0.gguf is not
        res = cli(*args, "-o", out)
    assert_one_line(res, f)
    assert f.hit.name == "draft-q8_0.gguf" and sorted(p.name for p in out.iterdir()) == ["draft-f32.gguf"]
    res = cli(*args, "-o", out)
    assert res.exit_code == 0, res.output
    assert tree_bytes(out) == tree_bytes(tmp_path / "ref") and not temp_files(out)


@pytest.mark.parametrize("n", [1, 3, 4], ids=["config", "card", "folder"])
@pytest.mark.parametrize("code", CODES, ids=IDS)
def test_push_dry_run_fault_is_one_line_and_keeps_the_earlier_folder(draft_dir, tmp_path, code, n):
    args = ["push", draft_dir, "--repo", "someone/smol-eagle3", "--token", "hf_FAKE0123456789"]
    res = cli(*args, "--dry-run", tmp_path / "ref")
    assert res.exit_code == 0, res.output
    ref = tree_bytes(tmp_path / "ref")
    out = tmp_path / "out"
    with Faults(n, code) as f:
        res = cli(*args, "--dry-run", out)
    assert_one_line(res, f)
    assert not out.exists() and not temp_files(tmp_path)
    res = cli(*args, "--dry-run", out)
    assert res.exit_code == 0, res.output
    assert tree_bytes(out) == ref
    # a fault while replacing an earlier dry run leaves that one as it was
    with Faults(n, code) as f:
        res = cli(*args, "--dry-run", out)
    assert_one_line(res, f)
    assert tree_bytes(out) == ref and not temp_files(tmp_path)
