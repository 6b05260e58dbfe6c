"""A vision-language target (a tiny random Qwen2.5-VL with the real Qwen2.5 tokenizer): gen-data
on text and on image conversations, train, and a lossless eval of its draft."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from eagle3cli.cli import app
from tests.helpers.tiny import QWEN_TOKENIZER

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
runner = CliRunner()


def tiny_processor(path):
    """Qwen2.5-VL's processor from transformers classes: the tokenizer and a small image processor
    (28x28 to 56x56 pixels: 1 to 4 image tokens). Its video processor needs torchvision, which a
    test environment may lack, so the processor is built without one (images need none)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor
    tok = AutoTokenizer.from_pretrained(path)
    ip = ImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None if arg is None else check(self, name,
                                                                                                            arg)
    try:
        return Qwen2_5_VLProcessor(image_processor=ip, tokenizer=tok, video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2_5_VLConfig

    path = tmp_path_factory.mktemp("qwen2_5_vl")
    tok = AutoTokenizer.from_pretrained(QWEN_TOKENIZER)
    tok.chat_template = (TEMPLATES / "qwen2_vl.jinja").read_text()
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         eos_token_id=ids("<|im_end|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("vlm_data")
    rng = np.random.RandomState(0)
    Image.fromarray((rng.rand(40, 50, 3) * 255).astype("uint8")).save(d / "cat.png")
    Image.fromarray((rng.rand(28, 28, 3) * 255).astype("uint8")).save(d / "dot.png")
    text = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                          {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}]}
            for n in range(3, 9)]
    images = [{"messages": [
        {"role": "user", "content": [{"type": "image", "path": name}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": f"A picture of noise, {n} colours."}]}
        for n, name in enumerate(["cat.png", "dot.png", "cat.png"])]
    (d / "text.jsonl").write_text("\n".join(json.dumps(r) for r in text) + "\n")
    (d / "images.jsonl").write_text("\n".join(json.dumps(r) for r in text[:3] + images) + "\n")
    return d


@pytest.fixture()
def processor(vlm_dir, monkeypatch):
    import eagle3cli.model.target as target

    proc = tiny_processor(vlm_dir)
    monkeypatch.setattr(target, "load_processor", lambda spec: proc)
    return proc


def test_a_vlm_target_loads_whole_with_its_language_models_streams(vlm_dir):
    from eagle3cli.model.target import TargetSpec, capture, is_vision_language, load_config, load_target

    spec = TargetSpec(model=str(vlm_dir), device="cpu")
    assert is_vision_language(load_config(spec))
    model = load_target(spec)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    ids = torch.tensor([[9707, 11, 1879, 0, 374, 264, 1273]])
    aux, final = capture(model, ids, [1, 2, 3])
    full = model(input_ids=ids, output_hidden_states=True)
    assert aux.shape == (1, 7, 3 * 64)
    assert torch.equal(final, full.hidden_states[-1])
    assert torch.equal(model.get_output_embeddings()(final), full.logits)


def gen_data(vlm_dir, data_file, out, *extra):
    return runner.invoke(app, ["gen-data", "--model", str(vlm_dir), "--data", str(data_file), "--out", str(out),
                               "--no-regenerate", "--max-length", "128", *extra])


def test_image_conversations_store_the_image_tokens_unlearned_with_vision_features(vlm_dir, data, processor,
                                                                                   tmp_path):
    from safetensors.torch import load_file

    from eagle3cli.data.samples import build_sample
    from eagle3cli.data.sources import load_conversations
    from eagle3cli.model.target import TargetSpec, capture, load_target

    r = gen_data(vlm_dir, data / "images.jsonl", tmp_path / "store")
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert man["num_samples"] == 6 and man["complete"]
    shard = load_file(next((tmp_path / "store" / "shards").glob("*.safetensors")))
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    tok = processor.tokenizer
    rows = {int(i): k for k, i in enumerate(shard["sample_ids"].tolist())}
    offsets = shard["offsets"].tolist() if "offsets" in shard else None
    assert offsets is not None
    # in the dtype gen-data captured in (--capture-dtype auto: bf16 where the CPU multiplies bf16)
    model = load_target(TargetSpec(model=str(vlm_dir), device="cpu", dtype=man["run"].get("capture_dtype") or "auto"))
    convs = {c.id: c for c in load_conversations(str(data / "images.jsonl"))[0]}
    for sid, n_img in ((3, 2), (4, 1)):  # cat.png 40x50 -> 28x56 px: 2x4 patches, 2 tokens; dot.png 28x28: 1
        k = rows[sid]
        ids = shard["input_ids"][offsets[k]:offsets[k + 1]].long()
        mask = shard["loss_mask"][offsets[k]:offsets[k + 1]]
        assert int((ids == pad).sum()) == n_img and not mask[ids == pad].any()
        learned = tok.decode(ids[mask])
        assert learned == f"A picture of noise, {sid - 3} colours.<|im_end|>"
        # the stored features are the whole model's forward with the images: exactly, and not a text-only one's
        sample, _ = build_sample(processor.tokenizer, convs[sid], 128, processor=processor)
        assert sample["input_ids"] == ids.tolist() and sample["loss_mask"] == mask.tolist()
        aux, _ = capture(model, ids[None], man["layer_ids"], media=sample["media"])
        text_aux, _ = capture(model, ids[None], man["layer_ids"])
        stored = shard["aux"][offsets[k]:offsets[k + 1]]
        assert torch.equal(stored, aux[0].to(stored.dtype))
        after = int(torch.nonzero(ids == pad)[0])
        assert torch.equal(stored[:after], text_aux[0, :after].to(stored.dtype))  # before the image: text only
        assert not torch.equal(stored[after:], text_aux[0, after:].to(stored.dtype))


def test_images_need_a_vision_language_target_and_the_datasets_answers(vlm_dir, data, tmp_path, smol_tiny_dir):
    r = gen_data(smol_tiny_dir, data / "images.jsonl", tmp_path / "a")
    assert r.exit_code != 0 and "not a vision-language model" in r.output
    r = runner.invoke(app, ["gen-data", "--model", str(vlm_dir), "--data", str(data / "images.jsonl"),
                            "--out", str(tmp_path / "b")])
    assert r.exit_code != 0 and "pass --no-regenerate" in r.output


def test_text_and_image_data_train_a_draft_that_evals_lossless(vlm_dir, data, processor, tmp_path):
    r = gen_data(vlm_dir, data / "images.jsonl", tmp_path / "store")  # 3 text and 3 image conversations
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["train", "--data", str(tmp_path / "store"), "--model", str(vlm_dir), "--out",
                            str(tmp_path / "draft"), "--draft-vocab-size", "256", "--ttt-steps", "2", "--max-tokens",
                            "256", "--val-fraction", "0", "--warmup-ratio", "0", "--max-steps", "3"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    meta = cfg["eagle3_training"]
    assert meta["target_architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert meta["target_model_type"] == "qwen2_5_vl"
    assert cfg["hidden_size"] == 64 and cfg["vocab_size"] == 151936
    turns = tmp_path / "q.jsonl"
    turns.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Count to 5.", "Now to 7."]}) + "\n")
    for mode in (["--mode", "chain", "--steps", "3"], ["--tree", "6,3,2"]):
        r = runner.invoke(app, ["eval", "--model", str(vlm_dir), "--draft", str(tmp_path / "draft"), "--task", "q",
                                "--data", str(turns), "--out", str(tmp_path / "eval"), "--max-new-tokens", "24",
                                *mode])
        assert r.exit_code == 0, r.output
        t = json.loads((tmp_path / "eval" / "results.json").read_text())["tasks"]["q"]
        assert t["lossless"] is True and t["mismatches"] == [] and t["num_prompts"] == 1
