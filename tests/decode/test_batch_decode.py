"""Continuous batching (batch_decode): the model's own logits per slot, and regeneration equal
to the static-batch loop token for token."""

import pytest
import torch

from eagle3cli.data.chat_mask import end_of_turn_ids
from eagle3cli.data.regenerate import GenSettings, regenerate_local
from eagle3cli.decode.batch_decode import SlotTarget, common_prefix
from eagle3cli.model.target import TargetSpec, load_target, load_tokenizer
from tests.helpers.tiny import tiny_model


def hf_last_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "mistral-window"])
def test_slot_target_matches_hf_forward(arch):
    """Prefill and decode equal the model's own forward; a windowed target (a Mistral window of 4,
    sequences of up to 14) attends only inside its window, as HF's forward does."""
    if arch == "mistral-window":
        model = tiny_model("mistral", sliding_window=4)
    else:
        model = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 2)]
    slots = SlotTarget(model, slots=3, max_len=4)  # too small on purpose: the cache must grow
    for s, ids in enumerate(seqs):
        if s == 1:  # a kept prefix, then the rest: as a conversation's next turn is prefilled
            slots.prefill(s, ids[:6], 0)
            got = slots.prefill(s, ids[6:], 6)
        else:
            got = slots.prefill(s, ids, 0)
        torch.testing.assert_close(got, hf_last_logits(model, ids), atol=1e-5, rtol=1e-4)
    for _ in range(3):  # decode steps: every slot at its own position
        new = torch.randint(0, 256, (3,), generator=g)
        lengths = torch.tensor([len(x) for x in seqs])
        got = slots.decode(new, lengths)
        for s in range(3):
            seqs[s].append(int(new[s]))
            torch.testing.assert_close(got[s], hf_last_logits(model, seqs[s]), atol=1e-5, rtol=1e-4)
    # Compaction: slot 2 moves into slot 0; decoding two slots goes on from the moved entries.
    slots.move(2, 0, len(seqs[2]))
    seqs = [seqs[2], seqs[1]]
    new = torch.tensor([7, 9])
    got = slots.decode(new, torch.tensor([len(x) for x in seqs]))
    for s in range(2):
        torch.testing.assert_close(got[s], hf_last_logits(model, seqs[s] + [int(new[s])]), atol=1e-5, rtol=1e-4)


def test_slot_target_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="does not support"):
        SlotTarget(tiny_model("gemma3_text"), 2, 8)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


CONVS = [
    [{"role": "user", "content": "Hello there, how are you?"}, {"role": "assistant", "content": "x"},
     {"role": "user", "content": "Tell me more."}, {"role": "assistant", "content": "y"},
     {"role": "user", "content": "And a third question."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": "Write a poem about the sea and the wind and the long night."}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "Explain speculative decoding in detail please, step by step."},
     {"role": "user", "content": "Shorter."}],
]


@pytest.fixture(scope="module")
def smol(smol_tiny_dir):
    spec = TargetSpec(str(smol_tiny_dir))
    return load_target(spec), load_tokenizer(spec)


def stops_that_fire(model, tok, settings):
    """End-of-turn ids plus tokens the random model does emit early, so turns end and go on."""
    base = end_of_turn_ids(tok) | {tok.eos_token_id}
    first, _ = regenerate_local(model, tok, CONVS, settings, base, continuous=False)
    emitted = [m["token_ids"] for c in first for m in c if m["role"] == "assistant"]
    return base | {emitted[0][2], emitted[2][4]}


@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_continuous_regeneration_equals_static_batches(smol, batch_size):
    """Same answers, same counts: with fewer slots than conversations (refills, compaction) too."""
    model, tok = smol
    settings = GenSettings(max_new_tokens=10, batch_size=batch_size, max_length=200)
    stops = stops_that_fire(model, tok, settings)
    ref, ref_stats = regenerate_local(model, tok, CONVS, settings, stops, continuous=False)
    got, stats = regenerate_local(model, tok, CONVS, settings, stops, continuous=True)
    assert got == ref
    assert stats == ref_stats
    assert 0 < stats.cut < stats.answers and stats.answers > len(CONVS)  # turns ended and went on


def test_continuous_prefills_only_what_a_slot_lacks(smol, monkeypatch):
    """A conversation's next turn reuses its slot: only the tokens after the common prefix are run."""
    model, tok = smol
    settings = GenSettings(max_new_tokens=10, batch_size=2, max_length=200)
    stops = stops_that_fire(model, tok, settings)
    seen = []
    real = SlotTarget.prefill

    def counting(self, slot, ids, start):
        seen.append((start, len(ids)))
        return real(self, slot, ids, start)

    monkeypatch.setattr(SlotTarget, "prefill", counting)
    got, stats = regenerate_local(model, tok, CONVS, settings, stops)
    assert len(seen) == stats.answers
    later = [(start, n) for start, n in seen if start > 0]
    assert later and all(n < start for start, n in later)  # the kept prefix is the larger part


def test_continuous_sampling_is_a_function_of_the_seed(smol):
    model, tok = smol
    settings = GenSettings(max_new_tokens=8, batch_size=2, temperature=1.0, top_p=0.9)
    stops = end_of_turn_ids(tok) | {tok.eos_token_id}
    a, _ = regenerate_local(model, tok, CONVS, settings, stops, seed=5)
    b, _ = regenerate_local(model, tok, CONVS, settings, stops, seed=5)
    c, _ = regenerate_local(model, tok, CONVS, settings, stops, seed=6)
    assert a == b and a != c


def test_batcher_reports_progress_per_conversation(smol):
    model, tok = smol
    calls = []
    settings = GenSettings(max_new_tokens=4, batch_size=2)
    regenerate_local(model, tok, CONVS, settings, end_of_turn_ids(tok), on_batch=calls.append)
    assert calls[-1] == f"{len(CONVS)}/{len(CONVS)} conversations"
    assert calls == sorted(set(calls), key=lambda c: int(c.split("/")[0]))  # increasing, no repeats


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_slot_target_in_bfloat16_matches_the_bf16_model(arch):
    """dtype=bfloat16 casts the weights once and computes (and caches) in bf16: the logits are the
    HF forward of the model cast to bf16, within bf16 rounding; the fp32 model is left as it was."""
    import copy

    model = tiny_model(arch)
    ref = copy.deepcopy(model).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    slots = SlotTarget(model, slots=2, max_len=16, dtype=torch.bfloat16)
    assert slots.k.dtype == torch.bfloat16 and slots.layers[0].qkv.weight.dtype == torch.bfloat16
    # bf16: oneDNN's prepacked linear where it has bf16 kernels (MKL's packed GEMM is fp32 only)
    from eagle3cli.decode.fast_target import ONEDNN, Linear

    assert set(slots.head.packed) == ({ONEDNN} if Linear.can_pack(slots.head.weight, ONEDNN) else set())
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 3)]
    for s, ids in enumerate(seqs):
        got = slots.prefill(s, ids, 0)
        want = hf_last_logits(ref, ids)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2 ** -6)
    new = torch.tensor([5, 9])
    got = slots.decode(new, torch.tensor([len(x) for x in seqs]))
    for s in range(2):
        torch.testing.assert_close(got[s].float(), hf_last_logits(ref, seqs[s] + [int(new[s])]).float(),
                                   atol=3e-2, rtol=2 ** -6)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_regeneration_in_bfloat16_is_the_bf16_models_greedy_text(smol):
    """GenSettings.dtype bfloat16 on an fp32 model: the answers of the model cast to bf16 (static
    batches on that copy), token for token."""
    import copy

    model, tok = smol
    settings = GenSettings(max_new_tokens=10, batch_size=2, max_length=200)
    stops = end_of_turn_ids(tok) | {tok.eos_token_id}
    ref, ref_stats = regenerate_local(copy.deepcopy(model).to(torch.bfloat16), tok, CONVS, settings, stops,
                                      continuous=False)
    bf16 = GenSettings(**{**settings.__dict__, "dtype": "bfloat16"})
    got, stats = regenerate_local(model, tok, CONVS, bf16, stops)
    assert got == ref and stats == ref_stats
    with pytest.raises(ValueError, match="needs continuous batching"):
        regenerate_local(model, tok, CONVS, bf16, stops, continuous=False)


def test_regen_dtype_auto_is_bf16_only_for_an_fp32_target_on_a_bf16_cpu(monkeypatch):
    import eagle3cli.data.regenerate as regen

    llama, gemma = tiny_model("llama").config, tiny_model("gemma3_text").config
    monkeypatch.setattr(regen, "has_bf16_matmul", lambda: True)
    assert regen.regen_dtype("auto", llama, "cpu", torch.float32) == "bfloat16"
    assert regen.regen_dtype("auto", llama, "cpu", torch.float32, quantized=True) == "float32"
    assert regen.regen_dtype("auto", gemma, "cpu", torch.float32) == "float32"  # no continuous batching
    assert regen.regen_dtype("auto", llama, "cuda", torch.bfloat16) == "bfloat16"
    assert regen.regen_dtype("auto", llama, "cuda", torch.float32) == "float32"
    assert regen.regen_dtype("float32", llama, "cpu", torch.float32) == "float32"
    monkeypatch.setattr(regen, "has_bf16_matmul", lambda: False)
    assert regen.regen_dtype("auto", llama, "cpu", torch.float32) == "float32"
    assert regen.regen_dtype("bfloat16", llama, "cpu", torch.float32) == "bfloat16"  # asked for: honoured
    with pytest.raises(ValueError, match="needs continuous batching.*gemma3_text"):
        regen.regen_dtype("bfloat16", gemma, "cpu", torch.float32)
    with pytest.raises(ValueError, match="must be auto or one of"):
        regen.regen_dtype("bf16", llama, "cpu", torch.float32)



@pytest.fixture(params=["native", "haswell"])
def native_build(request):
    """The native kernels in use: this CPU's build, and the AVX2 build (x86 with AVX2 only)."""
    from eagle3cli.decode import native

    if not native.available():
        pytest.skip(f"native kernels: {native.status()}")
    if request.param != "native" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU does not run AVX2")
    try:
        assert native.use(request.param), native.status()
        yield request.param
    finally:
        native.use()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_decode_rows_are_bitwise_each_sequence_alone(native_build, arch):
    """On the native kernels a decode step of many slots (20: two calls of 10 rows) gives each
    slot bitwise the logits that slot decoded alone in a one-slot target gets, step after step,
    also after a compaction moved a slot."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (20,), generator=g)]
    many = SlotTarget(model, slots=20, max_len=8)
    alone = [SlotTarget(model, slots=1, max_len=8) for _ in seqs]
    assert many.native is not None and all(a.native is not None for a in alone)
    for s, ids in enumerate(seqs):
        assert torch.equal(many.prefill(s, ids, 0), alone[s].prefill(0, ids, 0))
    for step in range(4):
        if step == 2:  # slot 19 moves into slot 3, and 19 is no longer busy
            many.move(19, 3, len(seqs[19]))
            seqs[3], alone[3] = seqs.pop(), alone.pop()
        new = torch.randint(0, 256, (len(seqs),), generator=g)
        got = many.decode(new, torch.tensor([len(x) for x in seqs]))
        for s, ids in enumerate(seqs):
            one = alone[s].decode(new[s:s + 1], torch.tensor([len(ids)]))
            assert torch.equal(got[s:s + 1], one), (step, s)
            ids.append(int(new[s]))
        torch.testing.assert_close(got[0], hf_last_logits(model, seqs[0]), atol=1e-5, rtol=1e-4)


def test_batched_regeneration_is_one_at_a_time_decoding_token_for_token(smol, native_build):
    """Regeneration with 2, 3 or 16 slots is token for token regeneration one conversation at a
    time (one slot), the turns' ends and cuts included."""
    model, tok = smol
    stops = stops_that_fire(model, tok, GenSettings(max_new_tokens=12, batch_size=1, max_length=200))
    runs = {}
    for batch_size in (1, 2, 3, 16):
        settings = GenSettings(max_new_tokens=12, batch_size=batch_size, max_length=200)
        runs[batch_size] = regenerate_local(model, tok, CONVS, settings, stops, continuous=True)
    for batch_size in (2, 3, 16):
        assert runs[batch_size] == runs[1]
    assert 0 < runs[1][1].cut < runs[1][1].answers
