"""The native kernels built for another instruction set than this CPU's best: the AVX2 build
(-march=haswell, its tiles shaped for 16 vector registers) on an AVX-512 machine, checked for the
same products and the same bitwise row-invariance as this CPU's own build."""

import platform

import pytest
import torch

from eagle3cli.decode import native

AVX2 = "haswell"


@pytest.fixture
def avx2_build():
    """The AVX2 build in use for the test, this CPU's own build back in use after it."""
    if platform.machine() not in ("x86_64", "AMD64") or native.kernel() is None:
        pytest.skip(f"an x86 build of the native kernels: {platform.machine()}, {native.status()}")
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU does not run AVX2")
    try:
        assert native.use(AVX2), native.status()
        yield native.tiles()
    finally:
        native.use()


def test_the_avx2_build_has_its_own_tiles_and_library(avx2_build):
    assert avx2_build == {"march": AVX2, "lanes": 8, "block_rows": 4, "inputs": 4,
                          "tile_rows": {1: 4, 2: 2, 3: 2, 4: 1}}
    assert native.status().endswith(f", -march={AVX2})")
    assert native.library_path("cc", AVX2) != native.library_path("cc")


@pytest.mark.parametrize("rows,cols", [(960, 576), (13, 48), (7, 33), (5, 16), (1, 1)])
def test_avx2_products_are_row_invariant_and_the_native_builds(avx2_build, rows, cols):
    """Each row of a batch is bitwise the row alone, for every grouping of the inputs into the
    AVX2 tiles (1-4 inputs a pass, 4, 2 or 1 weight rows a tile); the products match float64; and
    the two builds give the same bits (the same sums in the same order, FMA in both)."""
    g = torch.Generator().manual_seed(rows + cols)
    w, b = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
    x = torch.randn(native.MAX_ROWS, cols, generator=g)
    batch = native.linear(x, w, b)
    torch.testing.assert_close(batch.double(), x.double() @ w.double().T + b.double(), atol=1e-4 * cols ** 0.5,
                               rtol=1e-5)
    for m in range(1, x.shape[0]):
        assert torch.equal(native.linear(x[:m], w, b), batch[:m])
    for i in range(x.shape[0]):
        assert torch.equal(native.linear(x[i:i + 1], w, b), batch[i:i + 1])
    native.use()
    assert torch.equal(native.linear(x, w, b), batch)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_avx2_verification_is_bitwise_one_token_decoding(avx2_build, arch):
    """The whole forward on the AVX2 build (its layers one call each): a chain or tree of up to
    16 rows gives bitwise the logits of decoding its tokens one at a time."""
    from eagle3cli.decode.fast_target import NATIVE, ONEDNN, FastTarget
    from eagle3cli.decode.fast_tuning import row_invariant
    from tests.helpers.tiny import tiny_model

    fast = FastTarget(tiny_model(arch), 64, packed_rows=(NATIVE, ONEDNN))
    assert fast._native_layers(4)
    assert all(row_invariant(fast, rows) for rows in (2, 3, 4, 5, 8, native.MAX_ROWS))


@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_avx2_build_decodes_bitwise_as_this_cpus_build(avx2_build, head_dim):
    """A whole step (norms, RoPE, attention and its exponentials, silu, the matmuls) on the AVX2 build
    gives bitwise the logits of this CPU's own build, one row at a time and four at once: every loop
    adds the same lanes in the same order on either vector width (head dim 16: the generic
    attention; 64: the one specialised for SmolLM2's heads)."""
    from eagle3cli.decode.fast_target import NATIVE, ONEDNN, FastTarget
    from tests.helpers.tiny import tiny_model

    model = tiny_model("llama", hidden_size=128, intermediate_size=192, num_attention_heads=128 // head_dim,
                       num_key_value_heads=max(1, 32 // head_dim))
    ids = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(head_dim))

    def steps():
        fast = FastTarget(model, 64, packed_rows=(NATIVE, ONEDNN))
        assert fast._native_layers(1) and fast._native_layers(4)
        out = [fast.forward(ids[i:i + 1], torch.tensor([i]), i)[0] for i in range(37)]
        return torch.cat(out + [fast.forward(ids[37:], torch.arange(37, 41), 37)[0]])

    avx2 = steps()
    native.use()
    assert torch.equal(steps(), avx2)


def test_the_march_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert native.default_march() == "native"
    monkeypatch.setenv(native.MARCH_ENV, " x86-64-v3 ")
    assert native.default_march() == "x86-64-v3"
    monkeypatch.setenv(native.MARCH_ENV, "native; rm -rf /")
    try:
        native.reset()
        assert native.kernel() is None
        assert native.status() == ("not built: EAGLE3_NATIVE_MARCH='native; rm -rf /' is not a -march value "
                                   "(say native, haswell or x86-64-v3)")
    finally:
        native.reset()
