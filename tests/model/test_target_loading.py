import pytest
import torch

from eagle3cli.model.target import TargetSpec, capture, load_target, resolve_dtype
from tests.helpers.tiny import save_tiny


def test_dtype_resolution():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("fp8", "cpu")


def test_local_folder_loads_frozen(tmp_path):
    d = save_tiny(tmp_path / "m", "qwen2")
    model = load_target(TargetSpec(str(d), device="cpu"))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32


def test_peft_adapter_changes_hidden_states(tmp_path):
    from peft import LoraConfig, get_peft_model

    from tests.helpers.tiny import tiny_model

    d = save_tiny(tmp_path / "m", "llama")
    base = tiny_model("llama")
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(3, 250, (1, 9))
    plain = load_target(TargetSpec(str(d), device="cpu"))
    adapted = load_target(TargetSpec(str(d), device="cpu", adapter=str(tmp_path / "adapter")))
    a0, _ = capture(plain, ids, (2, 4, 5))
    a1, _ = capture(adapted, ids, (2, 4, 5))
    ref = peft_model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(a1[..., 64:128], ref[4], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a0, a1)


def test_bitsandbytes_8bit_target_gives_hidden_states(tmp_path):
    pytest.importorskip("bitsandbytes")
    d = save_tiny(tmp_path / "m", "llama", hidden_size=128, intermediate_size=256)
    try:
        model = load_target(TargetSpec(str(d), device="cpu", load_in_8bit=True))
    except Exception as e:  # pragma: no cover - depends on the bitsandbytes build
        pytest.skip(f"bitsandbytes 8-bit unavailable here: {e}")
    ids = torch.randint(3, 250, (1, 7))
    aux, final = capture(model, ids, (2, 4, 5))
    assert aux.shape == (1, 7, 3 * 128) and final.shape == (1, 7, 128)
    assert torch.isfinite(aux).all()
    full = load_target(TargetSpec(str(d), device="cpu"))
    ref, _ = capture(full, ids, (2, 4, 5))
    # quantised, so close but not equal to the full-precision streams
    rel = (aux.float() - ref).norm() / ref.norm()
    assert 0 < rel < 0.2
