import torch

from eagle3cli.core import hf_utils, io_utils
from eagle3cli.decode.generator import eos_ids
from eagle3cli.train.setup import as_list


def test_eos_token_ids_normalises_every_spelling():
    assert hf_utils.eos_token_ids(None) == set()
    assert hf_utils.eos_token_ids() == set()
    assert hf_utils.eos_token_ids(2) == {2}
    assert hf_utils.eos_token_ids([2, 7]) == {2, 7}
    assert hf_utils.eos_token_ids((2, None), {9}, 2, None) == {2, 9}
    assert hf_utils.eos_token_ids(torch.tensor(5)) == {5}


def test_old_names_are_thin_aliases():
    class Cfg:
        eos_token_id = [4, 3]

    class Model:
        config = Cfg()
        generation_config = None

    assert eos_ids(Model()) == {3, 4}
    assert eos_ids(Model(), eos_token_id=8) == {8}
    assert as_list(None) == [] and as_list(5) == [5] and as_list([4, 3]) == [3, 4]


def test_synchronize_waits_for_cuda_devices_only(monkeypatch):
    """Timings wait for queued CUDA work on that device; on the CPU there is nothing to wait for."""
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    hf_utils.synchronize(torch.device("cpu"))
    assert waited == []
    hf_utils.synchronize(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]


def test_write_json_is_atomic(tmp_path):
    io_utils.write_json(tmp_path / "a.json", {"x": 1})
    assert (tmp_path / "a.json").read_text() == '{\n  "x": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_cache_kwargs_uses_the_name_each_forward_takes():
    """transformers renamed ``past_key_values`` to ``cache`` in 5.x; a wrong name runs uncached."""

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    marker = object()
    for cls in (Old, New):
        model = cls()
        assert model(None, **hf_utils.cache_kwargs(model, marker)) is marker


def test_cache_kwargs_reaches_the_installed_models_cache():
    """A real model's cached steps equal its uncached forward: the cache was read, not swallowed."""
    from transformers import DynamicCache

    from tests.helpers.tiny import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], use_cache=True, **hf_utils.cache_kwargs(model, cache))
        step = model(input_ids=ids[:, -1:], use_cache=True, **hf_utils.cache_kwargs(model, cache)).logits[0, -1]
        full = model(input_ids=ids).logits[0, -1]
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-5)
