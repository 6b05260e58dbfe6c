"""Every draft reader against hundreds of damaged copies of one valid draft (a mutation test).

From a tiny valid draft, each variant damages one thing the way files get damaged or
hand-edited: the safetensors file truncated or with one bit flipped, each config.json key
deleted or set to a wrong type, zero, a negative or a huge value, each tensor removed,
reshaped, cast or given a NaN / inf, the vocabulary maps shuffled, shortened, out of range.
For every variant, every reader (inspect, convert, eval's draft loading, push --dry-run,
train --init-from, and export.load_draft under them) must either refuse it with an
Eagle3Error (one line; inspect: a report that is not ok) or give exactly what it gives for
the valid draft. A sample goes through the CLI: exit code 1, one ``error:`` line, no traceback.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.core.errors import Eagle3Error
from eagle3cli.evaluate.evaluate import check_draft
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.vocab import DraftVocab
from eagle3cli.publish import push as push_lib
from eagle3cli.publish.export import load_draft, save_draft
from eagle3cli.publish.formats.readers import read_draft
from eagle3cli.publish.formats.writers import as_ours, convert
from eagle3cli.publish.inspector import inspect_any
from eagle3cli.train.init_from import init_from
from tests.helpers.tiny import save_tiny, tiny_config

torch.set_num_threads(1)

IDS = torch.arange(0, 200, 2)  # the draft vocabulary: 100 even target ids (2, the end token, among them)
META = {"target": "org/tiny", "layer_ids": [2, 4, 5], "end_token_ids": [2], "steps": 3}
TENSORS = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
           "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
           "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
           "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
           "norm.weight", "lm_head.weight", "d2t", "t2d"]


def make_valid(path: Path) -> Path:
    cfg = DraftConfig.from_target(tiny_config("llama"), IDS.numel(), (2, 4, 5))
    d = Eagle3Draft(cfg)
    d.init_weights(seed=3)
    d.set_vocab(IDS)
    return save_draft(d, path, metadata=dict(META))


# ---------------------------------------------------------------------------- the variants

def _config(fn):
    def apply(d: Path):
        p = d / "config.json"
        cfg = json.loads(p.read_text())
        fn(cfg)
        p.write_text(json.dumps(cfg))
    return apply


def _tensors(fn):
    def apply(d: Path):
        p = d / "model.safetensors"
        t = load_file(str(p))
        save_file(fn(t), str(p))  # without the export digest: the tensor checks alone must catch it
    return apply


def _bytes(fn):
    def apply(d: Path):
        p = d / "model.safetensors"
        p.write_bytes(fn(p.read_bytes()))
    return apply


def _flip(pos: int, bit: int = 0):
    def fn(b: bytes) -> bytes:
        b = bytearray(b)
        b[pos % len(b)] ^= 1 << bit
        return bytes(b)
    return fn


def _wrong_type(v):
    if isinstance(v, bool):
        return "true"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, str):
        return 7
    if isinstance(v, list):
        return ",".join(map(str, v))
    if isinstance(v, dict):
        return [v]
    return "x"


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _nested(outer, key, value):
    return lambda c: c[outer].__setitem__(key, value)


def _replace(name, fn):
    return lambda t: {**t, name: fn(t[name])}


def _poison(value):
    def fn(x):
        x = x.clone()
        x.view(-1)[x.numel() // 2] = value
        return x
    return fn


def _vocab(ids):
    """d2t/t2d for another (consistent) vocabulary: tests the end-token rule."""
    def fn(t):
        t2d = torch.zeros(256, dtype=torch.bool)
        t2d[ids] = True
        return {**t, "d2t": ids - torch.arange(ids.numel()), "t2d": t2d}
    return fn


def _perm(x, seed):
    return x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))]


def variants(valid: Path) -> dict:
    out = {}
    cfg = json.loads((valid / "config.json").read_text())
    for key, value in cfg.items():
        out[f"config-{key}-deleted"] = _config(lambda c, k=key: c.pop(k))
        out[f"config-{key}-wrong-type"] = _config(_set(key, _wrong_type(value)))
        for label, v in (("zero", 0), ("negative", -1), ("huge", 10 ** 15)):
            out[f"config-{key}-{label}"] = _config(_set(key, v))
    for label, v in (("short", [1, 3]), ("huge", [1, 3, 400000]), ("negative", [-2, 3, 4]), ("str", ["1", 3, 4]),
                     ("other", [1, 3, 5])):
        out[f"config-eagle_config-ids-{label}"] = _config(_nested("eagle_config", "eagle_aux_hidden_state_layer_ids",
                                                                  v))
    for key in ("hidden_size", "rms_norm_eps", "rope_theta", "draft_vocab_size"):  # JSON allows both
        out[f"config-{key}-enormous"] = _config(_set(key, 10 ** 400))
        out[f"config-{key}-nan"] = _config(_set(key, float("nan")))
    for label, v in (("outside", [300]), ("not-in-vocab", [3]), ("str", "2"), ("negative", [-2]),
                     ("enormous", [10 ** 30])):
        out[f"config-end_token_ids-{label}"] = _config(_nested("eagle3_training", "end_token_ids", v))
    out["config-training-layer_ids-other"] = _config(_nested("eagle3_training", "layer_ids", [2, 4, 6]))
    out["config-training-target-int"] = _config(_nested("eagle3_training", "target", 5))
    for label, v in (("zero", 0), ("negative", -1.0), ("str", "1e4"), ("huge", 1e30), ("other", 5000.0)):
        out[f"config-rope_parameters-theta-{label}"] = _config(_nested("rope_parameters", "rope_theta", v))
    out["config-draft_vocab_size-98304"] = _config(_set("draft_vocab_size", 98304))  # > vocab: d2t holds 100
    out["config-draft_vocab_size-200"] = _config(_set("draft_vocab_size", 200))  # <= vocab, d2t still 100
    out["config-vocab_size-49152"] = _config(_set("vocab_size", 49152))
    out["config-heads-3"] = _config(_set("num_attention_heads", 3))
    out["config-kv-heads-4"] = _config(_set("num_key_value_heads", 4))
    for label, text in (("truncated", None), ("not-json", "{eagle"), ("list", "[1, 2]"), ("empty", ""),
                        ("latin1", b'{"hidden_size": "\xe9"}')):
        def raw(d, text=text):
            p = d / "config.json"
            if text is None:
                p.write_bytes(p.read_bytes()[:40])
            elif isinstance(text, bytes):
                p.write_bytes(text)
            else:
                p.write_text(text)
        out[f"config-file-{label}"] = raw

    for name in TENSORS:
        out[f"tensor-{name}-removed"] = _tensors(lambda t, n=name: {k: v for k, v in t.items() if k != n})
        out[f"tensor-{name}-flattened"] = _tensors(_replace(name, lambda x: x.reshape(-1)[None]))
        out[f"tensor-{name}-shortened"] = _tensors(_replace(name, lambda x: x[:-1].contiguous()))
        for dtype in (torch.float32, torch.float16, torch.int32, torch.float64):
            out[f"tensor-{name}-as-{dtype}"] = _tensors(_replace(name, lambda x, dt=dtype: x.to(dt)))
        if name not in ("d2t", "t2d"):
            for label, v in (("nan", float("nan")), ("inf", float("inf"))):
                out[f"tensor-{name}-{label}"] = _tensors(_replace(name, _poison(v)))
    for name in ("fc.weight", "d2t", "lm_head.weight"):
        out[f"tensor-{name}-model-prefix"] = _tensors(lambda t, n=name: {("model." + k if k == n else k): v
                                                                         for k, v in t.items()})
    out["tensor-t2d-as-uint8"] = _tensors(_replace("t2d", lambda x: x.to(torch.uint8)))
    out["tensor-fc.weight-transposed"] = _tensors(_replace("fc.weight", lambda x: x.t().contiguous()))
    out["tensor-extra-name"] = _tensors(lambda t: {**t, "layers.1.weight": torch.zeros(2, dtype=torch.bfloat16)})
    bias = torch.zeros(64, dtype=torch.bfloat16)
    out["tensor-bias"] = _tensors(lambda t: {**t, "midlayer.self_attn.q_proj.bias": bias})
    out["tensor-all-float32"] = _tensors(lambda t: {k: v.float() if v.is_floating_point() else v for k, v in t.items()})
    out["tensor-resaved"] = _tensors(lambda t: t)  # the digest dropped, nothing else changed

    d2t = lambda fn: _tensors(_replace("d2t", fn))  # noqa: E731
    t2d = lambda fn: _tensors(_replace("t2d", fn))  # noqa: E731
    for seed in range(3):
        out[f"vocab-d2t-shuffled-{seed}"] = d2t(lambda x, s=seed: _perm(x, s))
        out[f"vocab-t2d-shuffled-{seed}"] = t2d(lambda x, s=seed: _perm(x, s))
    out["vocab-both-shuffled"] = _tensors(lambda t: {**t, "d2t": _perm(t["d2t"], 5), "t2d": _perm(t["t2d"], 5)})
    out["vocab-d2t-indices"] = d2t(lambda x: x + torch.arange(x.numel()))
    out["vocab-d2t-zeros"] = d2t(torch.zeros_like)
    out["vocab-d2t-last-outside"] = d2t(lambda x: torch.cat([x[:-1], x[-1:] + 1000]))
    out["vocab-d2t-first-negative"] = d2t(lambda x: torch.cat([x[:1] - 5, x[1:]]))
    out["vocab-d2t-duplicate"] = d2t(lambda x: torch.cat([x[:1], x[:1] - 1, x[2:]]))
    out["vocab-d2t-huge"] = d2t(lambda x: torch.full_like(x, 2 ** 62))
    out["vocab-t2d-extra"] = t2d(lambda x: torch.cat([x[:1], torch.ones(1, dtype=torch.bool), x[2:]]))
    out["vocab-t2d-missing"] = t2d(lambda x: torch.cat([x[:2], torch.zeros(1, dtype=torch.bool), x[3:]]))
    out["vocab-t2d-all"] = t2d(torch.ones_like)
    out["vocab-t2d-values-2"] = t2d(lambda x: x.to(torch.uint8) * 2)
    out["vocab-without-end-token"] = _tensors(_vocab(torch.tensor([1] + list(range(4, 200, 2)))))

    size = (valid / "model.safetensors").stat().st_size
    header = struct.unpack("<Q", (valid / "model.safetensors").read_bytes()[:8])[0]
    for cut in sorted({0, 1, 7, 8, 9, header // 2, header + 7, header + 8, header + 9, size // 2, size - 1}):
        out[f"file-truncated-{cut}"] = _bytes(lambda b, c=cut: b[:c])
    out["file-extended"] = _bytes(lambda b: b + b"\0" * 16)
    out["file-empty"] = _bytes(lambda b: b"")
    out["file-header-length-huge"] = _bytes(lambda b: struct.pack("<Q", 1 << 60) + b[8:])
    g = torch.Generator().manual_seed(0)
    for pos in torch.randint(0, 8 + header, (30,), generator=g).tolist():  # header: JSON, names, shapes, offsets
        out[f"file-header-bitflip-{pos}"] = _bytes(_flip(pos, pos % 8))
    for pos in torch.randint(8 + header, size, (20,), generator=g).tolist():  # tensor data: the export digest
        out[f"file-data-bitflip-{pos}"] = _bytes(_flip(pos, pos % 8))
    for name in ("config.json", "model.safetensors"):
        out[f"file-{name}-missing"] = lambda d, n=name: (d / n).unlink()
    return out


# ---------------------------------------------------------------------------- the readers

def same_draft(a: Eagle3Draft, b: Eagle3Draft) -> bool:
    """Equal weights and maps (compared in float32) and equal architecture. Not compared: the
    embedding (this draft ships none: a reader takes the target's or a placeholder) and the token
    ids the config copies from the target (pad/bos/eos), which play no part in drafting."""
    sa, sb = a.state_dict(), b.state_dict()
    sa.pop("embed_tokens.weight"), sb.pop("embed_tokens.weight")
    if sa.keys() != sb.keys():
        return False
    if any(not torch.equal(sa[k].float(), sb[k].float()) for k in sa):
        return False
    ca, cb = a.config.to_dict(), b.config.to_dict()
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ca.pop(k), cb.pop(k)
    return ca == cb


def read_inspect(d: Path, ctx):
    rep, _ = inspect_any(d)
    if not rep.ok:
        raise Eagle3Error("; ".join(rep.problems))  # a refusal (the CLI exits 1 with these lines)
    return read_draft(d)[0]  # inspect says ok: what it vouches for must be the valid draft


def read_convert(d: Path, ctx):
    out = ctx.tmp / f"converted-{ctx.n()}"
    convert(d, out, "vllm")
    return load_draft(out, dtype=None)[0]


def read_eval(d: Path, ctx):
    """What `eagle3 eval` does before decoding (commands/evaluate.py _run_ours)."""
    loaded = as_ours(d, ctx.target.config)
    check_draft(loaded, ctx.target.config)
    return read_draft(loaded, target=ctx.target, dtype=torch.float32)[0]


def read_push(d: Path, ctx):
    """`eagle3 push --dry-run` (commands/push.py): the published folder, read back."""
    out = ctx.tmp / f"push-{ctx.n()}"
    push_lib.dry_run(Path(as_ours(d)), out, "org/tiny-eagle3", base_model="org/tiny")
    return load_draft(out, dtype=None)[0]


def read_init_from(d: Path, ctx):
    """`train --init-from` (train/init_from.py, as the trainer calls it with a fresh draft)."""
    vocab = DraftVocab(ids=torch.arange(128), coverage=1.0)
    cfg = SimpleNamespace(init_from=str(d), init_vocab="keep")
    return init_from(ctx.fresh, vocab, torch.ones(256, dtype=torch.long), cfg, ctx.target.config)[0]


def read_load_draft(d: Path, ctx):
    return load_draft(d, dtype=None)[0]


READERS = {"inspect": read_inspect, "convert": read_convert, "eval": read_eval, "push": read_push,
           "init_from": read_init_from, "load_draft": read_load_draft}


class Ctx:
    def __init__(self, tmp, target):
        self.tmp, self.target, self.i = tmp, target, 0
        # What the trainer holds when it reads --init-from: a fresh draft on the store's vocabulary
        # (init_from builds a new draft from it and leaves it as it is).
        self.fresh = Eagle3Draft(DraftConfig.from_target(target.config, 128, (2, 4, 5)),
                                 embed_weight=target.get_input_embeddings().weight)
        self.fresh.init_weights(seed=0)
        self.fresh.set_vocab(torch.arange(128))

    def n(self) -> int:
        self.i += 1
        return self.i


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.helpers.tiny import tiny_model

    root = tmp_path_factory.mktemp("mutations")
    valid = make_valid(root / "valid")
    ctx = Ctx(root, tiny_model("llama"))
    expected = {name: fn(valid, ctx) for name, fn in READERS.items()}
    return valid, ctx, expected


def test_valid_draft_reads_the_same_everywhere(world):
    valid, ctx, expected = world
    ref = expected["load_draft"]
    assert ref.config.draft_vocab_size == 100 and torch.equal(ref.draft_to_target(torch.arange(100)), IDS)
    for name in ("inspect", "convert", "push"):
        assert same_draft(expected[name], ref), name
    assert inspect_any(valid)[0].ok


def _variant_names():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return sorted(variants(make_valid(Path(tmp) / "v")))


VARIANTS = _variant_names()


def test_there_are_hundreds_of_variants():
    assert len(VARIANTS) >= 300, len(VARIANTS)
    kinds = {n.split("-")[0] for n in VARIANTS}
    assert kinds == {"config", "tensor", "vocab", "file"}


def outcomes(world, name, tmp_path) -> dict[str, str]:
    """reader -> "refused" | "same" (anything else fails the test with what was read)."""
    valid, ctx, expected = world
    d = tmp_path / "draft"
    shutil.copytree(valid, d)
    variants(valid)[name](d)
    found = {}
    for reader, fn in READERS.items():
        try:
            got = fn(d, ctx)
        except Eagle3Error as e:
            assert str(e).strip(), (reader, name)
            found[reader] = "refused"
            continue
        assert same_draft(got, expected[reader]), f"{reader} read variant {name} as a different draft"
        found[reader] = "same"
    return found


@pytest.mark.parametrize("name", VARIANTS)
def test_every_reader_refuses_or_reads_the_valid_draft(world, name, tmp_path):
    found = outcomes(world, name, tmp_path)
    # A variant no reader refuses must be harmless to all of them (checked above: same draft).
    assert set(found.values()) <= {"refused", "same"}


# ---------------------------------------------------------------------------- what must be refused

MUST_REFUSE = ["config-draft_vocab_size-98304", "config-draft_vocab_size-200", "tensor-fc.weight-nan",
               "tensor-lm_head.weight-inf", "vocab-d2t-duplicate", "vocab-t2d-missing", "vocab-without-end-token",
               "config-hidden_size-huge", "config-hidden_size-wrong-type", "config-rms_norm_eps-zero",
               "config-eagle_config-ids-other", "file-truncated-9"] + \
              [n for n in VARIANTS if n.startswith("file-data-bitflip-")]


@pytest.mark.parametrize("name", MUST_REFUSE)
def test_corruptions_are_refused_by_every_reader(world, name, tmp_path):
    assert set(outcomes(world, name, tmp_path).values()) == {"refused"}


# ---------------------------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("target") / "m", "llama")


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "500"})
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and len(errors) == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return errors[0]


def test_the_two_reported_cases_are_one_line(world, tmp_path):
    valid, _, _ = world
    nan = tmp_path / "nan"
    shutil.copytree(valid, nan)
    _tensors(lambda t: {**t, "fc.weight": _poison(float("nan"))(t["fc.weight"])})(nan)
    assert cli("inspect", nan) == (f"error: {nan / 'model.safetensors'}: tensor fc.weight: 1 non-finite value(s) "
                                   "(first nan at [32, 0]); a draft's weights are all finite")
    vocab = tmp_path / "vocab"
    shutil.copytree(valid, vocab)
    _config(_set("draft_vocab_size", 200))(vocab)
    assert cli("inspect", vocab) == (f"error: {vocab / 'model.safetensors'}: shape of d2t: (100,), config implies "
                                     "(200,) (draft_vocab_size) (+1 more)")


def test_the_reported_cases_on_a_smollm2_sized_vocabulary(smol_tiny_dir, tmp_path):
    """As reported: `inspect DRAFT --model SmolLM2` on a draft of 8,000 tokens over SmolLM2's 49,152."""
    from transformers import AutoConfig

    from eagle3cli.model.layers import default_layer_ids

    tc = AutoConfig.from_pretrained(smol_tiny_dir)
    d = Eagle3Draft(DraftConfig.from_target(tc, 8000, default_layer_ids(tc.num_hidden_layers)))
    d.init_weights(seed=0)
    d.set_vocab(torch.arange(8000) * 6)
    valid = save_draft(d, tmp_path / "valid", metadata={"target": str(smol_tiny_dir)})
    assert tc.vocab_size == 49152
    assert CliRunner().invoke(app, ["inspect", str(valid), "--model", str(smol_tiny_dir)]).exit_code == 0
    nan, vocab = tmp_path / "nan", tmp_path / "vocab"
    shutil.copytree(valid, nan)
    shutil.copytree(valid, vocab)
    def poison(t):
        t["fc.weight"][3, 7] = float("nan")
        return t

    _tensors(poison)(nan)
    assert cli("inspect", nan, "--model", smol_tiny_dir) == (
        f"error: {nan / 'model.safetensors'}: tensor fc.weight: 1 non-finite value(s) (first nan at [3, 7]); "
        "a draft's weights are all finite")
    _config(_set("draft_vocab_size", 98304))(vocab)
    assert cli("inspect", vocab, "--model", smol_tiny_dir) == (
        f"error: {vocab / 'model.safetensors'}: shape of d2t: (8000,), config implies (98304,) (draft_vocab_size) "
        "(+1 more)")


CLI_SAMPLE = ["tensor-fc.weight-nan", "config-draft_vocab_size-98304", "config-hidden_size-wrong-type",
              "config-rms_norm_eps-negative", "vocab-d2t-duplicate", "vocab-without-end-token",
              "tensor-lm_head.weight-as-torch.float64", "config-eagle_config-ids-other"] + \
             [n for n in VARIANTS if n.startswith("file-data-bitflip-")][:2]


@pytest.mark.parametrize("name", CLI_SAMPLE)
def test_cli_refuses_in_one_line(world, name, target_dir, tmp_path, monkeypatch):
    import eagle3cli.model.target as target

    monkeypatch.setattr(target, "load_target", lambda spec: pytest.fail("the draft was checked after the model"))
    valid, _, _ = world
    d = tmp_path / "draft"
    shutil.copytree(valid, d)
    variants(valid)[name](d)
    cli("inspect", d)
    cli("convert", d, "--to", "vllm", "--out", tmp_path / "c")
    cli("push", d, "--repo", "org/x", "--base-model", "org/tiny", "--dry-run", tmp_path / "p")
    cli("eval", "-m", target_dir, "-d", d, "-o", tmp_path / "e")
    assert not any((tmp_path / x).exists() for x in ("c", "p", "e"))


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    from tests.helpers.stores import make_store

    return make_store(tmp_path_factory.mktemp("store") / "s")


@pytest.mark.parametrize("name", ["tensor-fc.weight-nan", "config-draft_vocab_size-200", "vocab-t2d-missing",
                                  "file-truncated-9"])
def test_train_init_from_refuses_in_one_line_before_loading_the_target(world, name, store_dir, target_dir,
                                                                       tmp_path, monkeypatch):
    import eagle3cli.train.trainer as trainer

    monkeypatch.setattr(trainer, "load_target_parts", lambda *a, **k: pytest.fail("the target was loaded first"))
    valid, _, _ = world
    d = tmp_path / "draft"
    shutil.copytree(valid, d)
    variants(valid)[name](d)
    line = cli("train", "--data", store_dir, "--model", target_dir, "--out", tmp_path / "o", "--init-from", d)
    assert line.startswith(f"error: --init-from: {d}"), line


def test_finite_check_is_exact_when_the_sum_overflows():
    from eagle3cli.publish.draft_check import _all_finite

    big = torch.full((4,), 3e38, dtype=torch.bfloat16)  # finite, but their float32 sum is inf
    assert _all_finite(big) and not _all_finite(torch.cat([big, torch.tensor([float("nan")], dtype=torch.bfloat16)]))
    assert not _all_finite(torch.tensor([1.0, float("inf"), -float("inf")]))
