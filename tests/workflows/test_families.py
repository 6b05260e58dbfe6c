"""Every target family through every stage, on tiny random targets (tests/helpers/families.py) with
SmolLM2's real tokenizer: `layers`, gen-data (the dataset's answers, and regenerated), train
with --warm-start head,fc,layer, eval, inspect, export-gguf, push --dry-run. Each stage is checked
by what it must produce, not by its exit code alone; eval, chain and tree, must give the
target's own greedy tokens (the generator's own tests cover sampling and long windows).

Also here, across families: the teacher is the target's own distribution (logit scaling and
soft caps included), and every key of the exported draft config that an engine reads says
what the draft computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eagle3cli.cli import app
from eagle3cli.config.options import GenDataOptions
from eagle3cli.core.hf_utils import text_config
from eagle3cli.data.features import FeatureStore
from eagle3cli.data.gen_data import run as gen_data
from eagle3cli.engines import engine_support
from eagle3cli.model import warm_start
from eagle3cli.model.draft import DraftConfig, Eagle3Draft
from eagle3cli.model.layers import default_layer_ids
from eagle3cli.model.target import TargetSpec, capture, lm_logits
from eagle3cli.publish.export import draft_config_from_json, engine_config, read_tensors
from eagle3cli.train.setup import TargetHead
from eagle3cli.train.ttt import teacher_from_final
from tests.helpers.families import available, family_config, family_model, save_family
from tests.helpers.tiny import SMOLLM2_TOKENIZER

FAMILIES = available()
runner = CliRunner()


# ---- the teacher and the exported config, per family (no files) ------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_is_the_target_own_distribution(family):
    """Granite's logits_scaling (8 here) and Gemma's soft cap (0.5 here, so that it bites) included."""
    target = family_model(family)
    ids = torch.randint(3, target.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = target(input_ids=ids).logits
    _, final = capture(target, ids, default_layer_ids(target.config.num_hidden_layers))
    torch.testing.assert_close(lm_logits(target, final), logits, atol=1e-5, rtol=1e-5)
    vocab = torch.arange(0, target.config.vocab_size, 2)  # a draft vocabulary of every other token
    teacher = teacher_from_final(TargetHead(target), final, vocab)  # what offline training reads
    torch.testing.assert_close(teacher.probs.view(2, 11, -1), logits[..., vocab].softmax(-1), atol=1e-6, rtol=1e-5)
    top = logits.argmax(-1)
    assert torch.equal(teacher.index, torch.where(top % 2 == 0, top // 2, -1))
    fast = teacher_from_final(TargetHead(target), final, vocab, full_argmax=False)  # the live accuracy's path
    torch.testing.assert_close(fast.probs, teacher.probs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_config_describes_the_trained_draft(family):
    """An engine builds the draft's layer from config.json: its RoPE (theta and scaling, read
    here by transformers' own Llama rotary embedding; a partial_rotary_factor, which vLLM's
    get_rope would honour, must not be there at all) and its geometry must be those the draft
    was trained with."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    tcfg = text_config(family_config(family))
    cfg = DraftConfig.from_target(tcfg, 64, default_layer_ids(tcfg.num_hidden_layers))
    draft = Eagle3Draft(cfg)
    exported = engine_config(cfg, torch.float32)
    assert "partial_rotary_factor" not in json.dumps(exported)
    assert draft_config_from_json(json.loads(json.dumps(exported))) == cfg
    engine = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in exported.items() if k != "eagle_config"}))
    pos = torch.arange(40)[None]
    x = torch.zeros(1, 40, cfg.hidden_size)
    cos, sin = engine(x, pos)
    mine_cos, mine_sin = draft.rotary(pos, torch.float32)
    torch.testing.assert_close(mine_cos[:, 0], cos)
    torch.testing.assert_close(mine_sin[:, 0], sin)
    sd = draft.state_dict()
    h, nh, nkv, hd = (exported[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (nh * hd, 2 * h)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (nkv * hd, 2 * h)
    assert sd["midlayer.mlp.down_proj.weight"].shape == (h, exported["intermediate_size"])
    assert exported["rms_norm_eps"] == draft.midlayer.hidden_norm.eps
    assert exported["hidden_act"] == cfg.hidden_act


def test_train_warning_points_to_eval_only_when_eval_runs_it():
    from eagle3cli.decode.generator import UnsupportedTarget, check_supported
    from eagle3cli.train.setup import eval_refusal

    gemma = family_config("gemma3_text")
    try:
        check_supported(gemma)
        refused = None
    except UnsupportedTarget as e:
        refused = str(e)
    assert eval_refusal(gemma) == refused
    lines = engine_support.warnings(gemma, (), eval_refusal(gemma))
    assert lines[0].startswith("vLLM 0.32.0 refuses EAGLE-3 for Gemma3ForCausalLM")
    if refused is None:
        assert lines[0].endswith("; the draft still runs in `eagle3 eval`") and len(lines) == 1
    else:
        assert "eagle3 eval" not in lines[0]
        assert lines[1] == f"`eagle3 eval` cannot measure this draft yet: {refused}"
    refusal = "x has sliding-window attention layers"
    assert engine_support.warnings(gemma, (), refusal) == [
        lines[0].removesuffix("; the draft still runs in `eagle3 eval`"),
        f"`eagle3 eval` cannot measure this draft yet: {refusal}"]


# ---- the stage matrix ------------------------------------------------------------------------

CONVERSATIONS = [
    [("human", "What is two plus two?"), ("gpt", "Four. Two plus two is four.")],
    [("human", "Name a colour."), ("gpt", "Blue."), ("human", "Another one?"), ("gpt", "Green, like grass.")],
    [("human", "Say hello in French."), ("gpt", "Bonjour! That is hello in French.")],
    [("human", "Count to three."), ("gpt", "One, two, three.")],
]


@dataclass
class Run:
    family: str
    root: Path
    target: Path
    store: Path
    manifest: dict


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = [{"id": str(i), "conversations": [{"from": r, "value": v} for r, v in c]}
            for i, c in enumerate(CONVERSATIONS)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory, data_file) -> Run:
    """One tiny target and one feature store (the dataset's answers) per family, shared by its tests."""
    root = tmp_path_factory.mktemp(request.param)
    target = save_family(root / "target", request.param, SMOLLM2_TOKENIZER)
    opts = GenDataOptions(out=root / "store", data=str(data_file), regenerate=False, max_length=64, shard_size=4,
                          batch_size=4)
    man = gen_data(opts, TargetSpec(str(target), device="cpu"))
    return Run(request.param, root, target, root / "store", man)


def cli(*args) -> str:
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output, res.output
    assert res.exit_code == 0, res.output
    return res.output


def load(path: Path, dtype: str | None = None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype or "float32")).eval()


def test_layers(fam):
    out = cli("layers", "-m", fam.target).splitlines()
    ids = default_layer_ids(4)
    assert fam.manifest["layer_ids"] == list(ids) == [1, 2, 3]
    assert f"({fam.family})" in out[0] and "N = 4" in out[1]
    assert [ln.split()[2:5] for ln in out if ln.startswith("layers j ")] == [["1,", "2,", "3"]]


def test_gen_data_stores_the_target_streams(fam):
    """The stored streams are the target's: the final one gives the target's own logits."""
    man, store = fam.manifest, FeatureStore(fam.store)
    assert man["model_type"] == fam.family and man["num_samples"] == len(CONVERSATIONS) == len(store)
    assert man["hidden_size"] == 64 and man["num_layers"] == 4
    # in the dtype gen-data captured in (--capture-dtype auto: bf16 where the CPU multiplies bf16)
    target = load(fam.target, man["run"].get("capture_dtype"))
    s = store[0]
    ids = s["input_ids"][None].long()
    with torch.no_grad():
        logits = target(input_ids=ids).logits.float()
    aux, final = capture(target, ids, man["layer_ids"])
    # stored in bf16; a bf16 capture's batched forward rounds differently from this one's (a layer
    # off by one differs by the whole layer's update, far beyond either tolerance)
    tol = dict(atol=0.02, rtol=0.02) if target.dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(s["aux"][None].float(), aux.float(), **tol)
    torch.testing.assert_close(s["final"][None].float(), final.float(), **tol)
    head_in = s["final"][None].to(target.dtype)
    torch.testing.assert_close(lm_logits(target, head_in).float(), logits, atol=0.01, rtol=0.01)


def test_gen_data_regenerated(fam, data_file):
    """Regeneration: every user turn answered by the target itself (greedy, 4 new tokens)."""
    opts = GenDataOptions(out=fam.root / "regen", data=str(data_file), max_new_tokens=4, max_length=64,
                          shard_size=4, batch_size=4, temperature=0.0, features="none")
    man = gen_data(opts, TargetSpec(str(fam.target), device="cpu"))
    assert man["source"]["regenerated"] and man["num_samples"] == len(CONVERSATIONS)
    users = sum(r == "human" for c in CONVERSATIONS for r, _ in c)
    assert 0 < man["num_masked_tokens"] <= users * 5  # at most 4 new tokens + an end of turn per answer


def train_args(fam, out, *extra):
    return ["train", "--data", fam.store, "--model", fam.target, "--out", out, "--draft-vocab-size", "256",
            "--ttt-steps", "2", "--max-tokens", "256", "--val-fraction", "0", "--warmup-ratio", "0", *extra]


@pytest.fixture(scope="module")
def trained(fam) -> tuple[Path, str]:
    """(the draft, train's output): two steps from a head,fc,layer warm start at a learning rate
    that leaves the copied weights as they were to within the export's bf16 rounding."""
    out = fam.root / "draft"
    log = cli(*train_args(fam, out, "--warm-start", "head,fc,layer", "--max-steps", "2", "--lr", "1e-9"))
    return out, log


def test_train_exports_a_config_of_the_target(fam, trained):
    out, _ = trained
    cfg = json.loads((out / "config.json").read_text())
    tcfg = text_config(load(fam.target).config)
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["vocab_size"], cfg["intermediate_size"], cfg["eagle_aux_hidden_state_layer_ids"]) == \
        (tcfg.hidden_size, tcfg.num_attention_heads, tcfg.num_key_value_heads, head_dim, tcfg.vocab_size,
         tcfg.intermediate_size, fam.manifest["layer_ids"])
    assert cfg["eagle3_training"]["steps"] == 2
    assert "partial_rotary_factor" not in json.dumps(cfg)


def same(exported: torch.Tensor, source: torch.Tensor):
    """Equal up to the export's bf16 rounding (one unit in the last place)."""
    torch.testing.assert_close(exported.float(), source.detach().float(), rtol=2 ** -7, atol=1e-7)


def test_warm_start_copies_the_target_parts(fam, trained):
    from eagle3cli.model.target import logit_scale

    out, log = trained
    t = read_tensors(out)
    target = load(fam.target)
    d2t = t["d2t"].long() + torch.arange(t["d2t"].numel())
    same(t["lm_head.weight"], target.get_output_embeddings().weight[d2t] * logit_scale(target))
    same(t["norm.weight"], warm_start.effective_norm_weight(warm_start.final_norm(target), 64))
    layer = warm_start.decoder_layers(target)[-1]
    h, attn = target.config.hidden_size, layer.self_attn
    notes = [ln.strip() for ln in log.splitlines() if ln.strip().startswith("warm start ")]
    k = t["midlayer.self_attn.k_proj.weight"]
    if isinstance(getattr(attn, "k_proj", None), torch.nn.Linear):
        same(k[:, h:], attn.k_proj.weight)
    elif hasattr(attn, "qkv_proj"):  # Phi-3: k is the second block of rows
        q = t["midlayer.self_attn.q_proj.weight"].shape[0]
        same(k[:, h:], attn.qkv_proj.weight[q:q + k.shape[0]])
    else:
        assert [n for n in notes if n.startswith("warm start layer: attention not copied: ")], log
    if any(n.startswith("warm start layer: attention not copied") for n in notes):
        assert k[:, :h].float().std() > 0.01  # as initialised (std 0.02)
    else:
        assert k[:, :h].abs().max() < 1e-8  # the embedding half starts at zero (two steps at lr 1e-9)
    if fam.family in ("phi3", "glm4"):  # fused gate_up_proj split in two
        same(t["midlayer.mlp.up_proj.weight"], layer.mlp.gate_up_proj.weight.chunk(2)[1])
    if fam.family == "olmo2":
        assert sum("no norm before the" in n for n in notes) == 2, log


def test_inspect_the_trained_draft(fam, trained):
    from eagle3cli.publish.inspector import inspect_any

    draft, _ = trained
    target_config = load(fam.target).config
    rep, _ = inspect_any(str(draft), target_config)
    assert rep.problems == [], rep.problems
    assert rep.summary["layers_j"] == fam.manifest["layer_ids"]
    out = cli("inspect", draft, "--model", fam.target)
    assert "EAGLE-3 draft" in out


def write_target_gguf(path: Path, target_dir: Path, n_layers: int):
    """The tokenizer and block count of the target, all write_draft_gguf reads of a target GGUF."""
    gguf = pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tok.convert_ids_to_tokens(i) for i in range(len(tok))])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    """Shared: every family's tiny target has SmolLM2's tokenizer and 4 layers."""
    return write_target_gguf(tmp_path_factory.mktemp("gguf") / "target.gguf", SMOLLM2_TOKENIZER, 4)


EXPORTED_GGUF: dict[tuple, str] = {}  # (RoPE type, head_dim) -> the family whose draft was exported


def test_export_gguf(fam, trained, target_gguf):
    """export-gguf writes what config.json says (gguf_export.write_draft_gguf): drafts that share
    the RoPE type and head geometry give GGUFs of one layout, so one family per layout is written
    (reading SmolLM2's 49,152-token GGUF tokenizer takes 8 s in the gguf package)."""
    draft, _ = trained
    cfg = json.loads((draft / "config.json").read_text())
    layout = (cfg["rope_parameters"].get("rope_type", "default"), cfg["head_dim"], cfg["num_key_value_heads"])
    if layout in EXPORTED_GGUF:
        pytest.skip(f"the same GGUF layout as {EXPORTED_GGUF[layout]}'s draft, exported above")
    EXPORTED_GGUF[layout] = fam.family
    tg = target_gguf
    res = runner.invoke(app, ["export-gguf", str(draft), "--target-gguf", str(tg), "-o", str(fam.root / "gguf"),
                              "--outtype", "f32"], env={"COLUMNS": "400"})
    assert "Traceback" not in res.output
    rope = json.loads((draft / "config.json").read_text())["rope_parameters"].get("rope_type", "default")
    if rope != "default":  # gpt-oss's yarn: only llama.cpp's own converter writes it
        assert res.exit_code == 1
        errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "--llama-cpp" in errors[0]
        return
    assert res.exit_code == 0, res.output
    from eagle3cli.publish.gguf_export import read_gguf_summary

    s = read_gguf_summary(fam.root / "gguf" / "draft-f32.gguf")
    assert list(s["keys"]["eagle3.target_layers"]) == fam.manifest["layer_ids"]
    nkv_hd = cfg["num_key_value_heads"] * cfg["head_dim"]
    assert s["tensors"]["blk.0.attn_k.weight"][1] == (128, nkv_hd) and s["keys"]["eagle3.target_hidden_size"] == 64


def test_push_dry_run(fam, trained):
    draft, _ = trained
    out = fam.root / "push"
    cli("push", draft, "--repo", "me/tiny-eagle3", "--base-model", "me/tiny", "--dry-run", out)
    pushed, ours = (json.loads((d / "config.json").read_text()) for d in (out, draft))
    assert pushed.pop("eagle3_training")["target"] == "me/tiny"  # --base-model names the published target
    ours.pop("eagle3_training")
    assert pushed == ours
    assert (out / "model.safetensors").read_bytes() == (draft / "model.safetensors").read_bytes()
    assert "me/tiny" in (out / "README.md").read_text()


def test_eval_chain_and_tree_lossless(fam, trained):
    """The trained draft decodes exactly the target's greedy tokens, chain and tree, through the
    path eval takes (the generator refuses in one line what it cannot verify: then that line)."""
    from eagle3cli.decode.generator import UnsupportedTarget, check_supported, greedy_generate, speculative_generate
    from eagle3cli.publish.export import load_draft

    draft_dir, _ = trained
    target = load(fam.target)
    ids = FeatureStore(fam.store)[1]["input_ids"][None, :20].long()
    new = 24
    try:
        check_supported(target.config, ids.shape[1] + new)
    except UnsupportedTarget as e:
        pytest.skip(f"eval refuses {fam.family}: {e}")
    draft, _ = load_draft(draft_dir, target=target)
    ref = greedy_generate(target, ids, new, eos_token_id=[-1])
    for kw in (dict(mode="chain", steps=3), dict(mode="tree", total_tokens=8, depth=3, top_k=2)):
        out = speculative_generate(target, draft, ids, max_new_tokens=new, eos_token_id=[-1], **kw)
        assert out.tokens == ref and len(ref) == new, f"{fam.family} {kw['mode']}"
