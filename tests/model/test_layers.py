import pytest
import torch

from eagle3cli.config.options import parse_layer_ids
from eagle3cli.core.hf_utils import text_config
from eagle3cli.model.layers import choose_layers, default_layer_ids
from eagle3cli.model.target import capture
from tests.helpers.tiny import ARCHS, tiny_config, tiny_model


@pytest.mark.parametrize("n,expected", [(32, (2, 16, 29)), (30, (2, 15, 27)), (24, (2, 12, 21)), (18, (2, 9, 15)),
                                        (8, (2, 4, 5))])
def test_default_layers_match_engines(n, expected):
    assert default_layer_ids(n) == expected


def test_toy_depths_still_distinct():
    assert default_layer_ids(4) == (1, 2, 3)
    assert default_layer_ids(6) == (1, 3, 5)
    with pytest.raises(ValueError):
        default_layer_ids(2)


def test_override_validation_and_warning():
    cfg = tiny_config("llama", num_hidden_layers=8)
    assert choose_layers(cfg).ids == (2, 4, 5)
    assert choose_layers(cfg).output_ids == (1, 3, 4)
    with pytest.warns(UserWarning, match="differ from the engines' default"):
        assert choose_layers(cfg, (1, 3, 6)).ids == (1, 3, 6)
    for bad in [(1, 2), (3, 2, 1), (0, 4, 8), (2, 2, 5)]:
        with pytest.raises(ValueError):
            choose_layers(cfg, bad)
    assert parse_layer_ids("2, 15,27") == (2, 15, 27)
    assert parse_layer_ids(None) is None


def test_nested_text_config_resolves():
    from transformers import Gemma3Config

    inner = tiny_config("gemma3_text", num_hidden_layers=12)
    cfg = Gemma3Config(text_config=inner.to_dict())
    assert text_config(cfg).num_hidden_layers == 12
    assert choose_layers(cfg).ids == (2, 6, 9)


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_equals_hidden_states(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 250, (2, 11))
    layer_ids = choose_layers(model.config).ids
    aux, final = capture(model, ids, layer_ids)
    ref = model(ids, output_hidden_states=True).hidden_states
    assert aux.shape == (2, 11, 3 * 64)
    for i, j in enumerate(layer_ids):
        torch.testing.assert_close(aux[..., i * 64:(i + 1) * 64], ref[j], rtol=0, atol=0)
    torch.testing.assert_close(final, ref[-1], rtol=0, atol=0)
    # the final-normed state is what the LM head reads: logits are recomputable from it
    torch.testing.assert_close(model.lm_head(final), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_dflash_layers_follow_z_lab_spacing_in_both_counts():
    from eagle3cli.model.layers import dflash_layer_ids, dflash_output_layer_ids

    assert dflash_output_layer_ids(36) == (1, 9, 17, 25, 33)  # Qwen3-8B, z-lab's drafts
    assert dflash_output_layer_ids(32) == (1, 8, 15, 22, 29)
    assert dflash_output_layer_ids(30) == (1, 8, 14, 20, 27)  # SmolLM2: Python's rounding (20.5 -> 20)
    assert dflash_layer_ids(30) == (2, 9, 15, 21, 28)  # hidden_states[k + 1]
    assert dflash_output_layer_ids(30, 1) == (15,)
