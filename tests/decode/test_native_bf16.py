"""The native kernels for bf16 weights (fp32 activations, fp32 sums): bitwise the fp32 kernels run
on the same weights rounded to bf16, on this CPU's build and the AVX2 build; and the fast path of a
bf16 target over them (``Decoder.mixed``), exact as fp32 is: a verification is bitwise one-token
decoding, so speculative output is plain decoding token for token."""

import platform

import pytest
import torch

from eagle3cli.decode import native
from eagle3cli.decode.fast_target import Decoder, FastTarget
from eagle3cli.decode.fast_tuning import row_invariant
from tests.helpers.decoding import accepted_on_fast_path, prompt
from tests.helpers.tiny import tiny_model

BUILDS = ["native", "haswell"]


@pytest.fixture(params=BUILDS)
def build(request):
    """This CPU's build, then the AVX2 build (on an AVX-512 CPU too), this CPU's back in use after."""
    march = request.param
    if native.kernel() is None:
        pytest.skip(f"no native kernels here: {native.status()}")
    if march != "native" and (platform.machine() not in ("x86_64", "AMD64") or "avx2" not in
                              open("/proc/cpuinfo").read()):
        pytest.skip("this CPU does not run the AVX2 build")
    try:
        assert native.use(march), native.status()
        assert native.available_bf16(), native.status_bf16()
        yield march
    finally:
        native.use()


def test_the_bf16_build_is_its_own_library(build):
    assert native.status_bf16().startswith("built with ") and "kernels-wbf16-" in native.status_bf16()
    assert native.library_path("cc", build, bf16=True) != native.library_path("cc", build)


@pytest.mark.parametrize("rows,cols", [(960, 576), (13, 48), (7, 33), (5, 16), (1, 1)])
def test_bf16_weights_give_bitwise_the_fp32_kernel_on_the_rounded_weights(build, rows, cols):
    """One row and 2..8 (and 16) rows at once, with a bias and a residual added: the widened bf16
    weights go through the same tiles in the same order as fp32 weights of the same values."""
    g = torch.Generator().manual_seed(rows * cols)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    b, x = torch.randn(rows, generator=g), torch.randn(native.MAX_ROWS, cols, generator=g)
    add = torch.randn(native.MAX_ROWS, rows, generator=g)
    bf16, fp32 = native.Matrix(w, b), native.Matrix(w.float(), b)
    assert bf16.bf16 and not fp32.bf16
    for m in [*range(1, 9), native.MAX_ROWS]:
        out = bf16(x[:m])
        assert torch.equal(out, fp32(x[:m])), m
        assert torch.equal(bf16(x[:m], add[:m]), fp32(x[:m], add[:m])), m
        assert torch.equal(out[-1:], bf16(x[m - 1:m]))  # a row alone is the row in a batch
    torch.testing.assert_close(bf16(x).double(), x.double() @ w.double().T + b.double(), atol=1e-4 * cols ** 0.5,
                               rtol=1e-5)


def test_a_bf16_matrix_refuses_bf16_inputs():
    if not native.available_bf16():
        pytest.skip(native.status_bf16())
    m = native.Matrix(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match="at most 16 fp32 rows"):
        m(torch.randn(2, 16).bfloat16())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_targets_fast_path_is_the_fp32_one_on_its_weights(build, arch):
    """The mixed fast path of a bf16 target (matrices bf16 in the native kernels, the rest fp32)
    decodes bitwise what the fp32 fast path decodes on the same model upcast: one row at a time and
    four rows at once."""
    target = tiny_model(arch).to(torch.bfloat16)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(7))

    def steps(fast):
        assert fast._native_layers(1) and fast._native_layers(4)
        out = [fast.forward(ids[i:i + 1], torch.tensor([i]), i)[0] for i in range(16)]
        return torch.cat(out + [fast.forward(ids[16:], torch.arange(16, 20), 16)[0]])

    mixed = FastTarget(target, 64)
    assert mixed.decoder.mixed and mixed.head.weight.dtype == torch.bfloat16
    assert mixed.embed.dtype == mixed.k.dtype == mixed.layers[0].ln1.dtype == torch.float32
    assert all(lin.weight.dtype == torch.bfloat16 for lin in mixed.decoder.linears())
    fp32 = FastTarget(tiny_model(arch).to(torch.bfloat16).float(), 64, packed_rows=("native",))
    assert not fp32.decoder.mixed
    assert torch.equal(steps(mixed), steps(fp32))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_weights_speculative_decoding_is_plain_decoding(build, arch):
    """Exact like fp32 (not ``low_precision``: eval's start-up check has nothing to check): a chain
    or tree verification of up to 16 rows gives bitwise the logits of one-token decoding, and greedy
    speculative output is plain decoding token for token. A prompt of more rows than the kernel
    serves goes in chunks of them."""
    target = tiny_model(arch).to(torch.bfloat16)
    fast = FastTarget(target, 128)
    assert fast.decoder.mixed and not fast.low_precision
    assert all(row_invariant(fast, rows) for rows in (2, 3, 4, 5, 8, native.MAX_ROWS))
    accepted = sum(accepted_on_fast_path(target, fast, prompt(40 + i, n=12 + 11 * i), 30, f"prompt {i}")
                   for i in range(2))  # the second prompt's 23 rows: more than the kernel's 16
    assert accepted > 5


def test_mixed_is_off_for_an_explicit_dtype_or_the_switch(monkeypatch):
    """An explicit compute dtype, or ``BF16_NATIVE`` off, keeps the bf16 path of oneDNN matmuls and
    float64 attention (low precision, checked at start-up)."""
    if not native.available_bf16():
        pytest.skip(native.status_bf16())
    target = tiny_model("llama").to(torch.bfloat16)
    assert not Decoder(target, dtype=torch.bfloat16).mixed
    assert not Decoder(tiny_model("llama")).mixed
    for arch in ("qwen3", "granite", "mistral"):  # not run whole by the native layer: the exact bf16 path
        assert not Decoder(tiny_model(arch).to(torch.bfloat16)).mixed, arch
    monkeypatch.setattr(Decoder, "BF16_NATIVE", False)
    fast = FastTarget(target, 32)
    assert not fast.decoder.mixed and fast.low_precision and fast.embed.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("gemm", [True, False])
def test_a_long_prompt_takes_one_bf16_gemm_and_verification_stays_exact(monkeypatch, gemm, arch):
    """A prefill of more rows than the native kernel serves goes through one bf16 GEMM per matrix
    where the CPU multiplies bf16 (``packing.prompt_gemm``; forced both ways here), the native
    kernel's chunks elsewhere; a verification of as many rows never takes the GEMM, so it stays
    bitwise one-token decoding and speculative output stays plain decoding. Both routes give the
    prompt's last logits within bf16 rounding of each other. (Past the kernel's rows a verification
    runs torch's attention, which is not row-invariant here: eval's start-up check refuses such
    trees in bf16.)"""
    from eagle3cli.decode import packing

    if not native.available_bf16():
        pytest.skip(native.status_bf16())
    monkeypatch.setattr(packing, "_prompt_gemm", gemm)
    calls = []
    linear = packing.F.linear
    monkeypatch.setattr(packing, "F", type("F", (), {"linear": staticmethod(
        lambda x, w, *a: calls.append(x.dtype) or linear(x, w, *a))}))
    target = tiny_model(arch).to(torch.bfloat16)  # qwen2: q|k|v with a bias, added in fp32
    fast = FastTarget(target, 160)
    assert fast.decoder.mixed
    n = native.MAX_ROWS + 9
    ids = prompt(3, n=n)
    last = fast.forward(ids[0], torch.arange(n), 0, logits="last")[0]
    layers = len(fast.layers)
    assert calls == ([torch.bfloat16] * 4 * layers if gemm else [])
    calls.clear()
    more = native.MAX_ROWS + 4  # a verification of more rows than the kernel serves: its chunks, never the GEMM
    fast.forward(prompt(4, n=more)[0], torch.arange(n, n + more), n)
    assert calls == []
    assert row_invariant(fast, native.MAX_ROWS)  # behind a 24-row prefix, the prefix through the GEMM
    assert calls == ([torch.bfloat16] * 4 * layers if gemm else [])
    monkeypatch.setattr(packing, "_prompt_gemm", not gemm)
    other = fast.forward(ids[0], torch.arange(n), 0, logits="last")[0]
    assert torch.allclose(last, other, atol=0.05, rtol=0.05) and int(last.argmax()) == int(other.argmax())
    monkeypatch.setattr(packing, "_prompt_gemm", gemm)
    assert accepted_on_fast_path(target, fast, ids, 24) > 3
