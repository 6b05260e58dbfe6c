"""The compiled fp32 kernel of the fast path's few-row matmuls: its products, its row- and
thread-invariance, and what happens where it cannot be built."""

import pytest
import torch

from eagle3cli.decode import native

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.status()}")

# rows and cols around the kernel's blocks: 4 weight rows, 32 and 16 columns, leftovers of each
SHAPES = [(960, 576), (64, 1536), (7, 33), (13, 48), (5, 16), (3, 7), (4, 32), (1, 1)]


@needs_kernel
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_float64_and_f_linear(rows, cols, bias):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    w = torch.randn(rows, cols, generator=g)
    b = torch.randn(rows, generator=g) if bias else None
    for m in (1, 2, 5, native.MAX_ROWS):
        x = torch.randn(m, cols, generator=g)
        y = native.linear(x, w, b)
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        assert y.shape == (m, rows) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref, atol=1e-4 * cols ** 0.5, rtol=1e-5)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), atol=1e-4 * cols ** 0.5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows,cols", [(960, 576), (13, 48), (7, 33)])
def test_each_row_is_bitwise_the_same_alone_in_a_batch_and_on_any_thread_count(rows, cols):
    """A verification's rows get exactly the products one-row decoding gets."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
    x = torch.randn(native.MAX_ROWS, cols, generator=g)
    batch = native.linear(x, w, b)
    for i in range(x.shape[0]):
        assert torch.equal(native.linear(x[i:i + 1], w, b), batch[i:i + 1])
    for m in range(2, x.shape[0]):  # every grouping of the inputs into the kernel's tiles
        assert torch.equal(native.linear(x[:m], w, b), batch[:m])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(native.linear(x, w, b), batch)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_refuses_more_rows_than_it_serves_or_a_wrong_width():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="rows"):
        native.linear(torch.randn(native.MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="weight of"):
        native.linear(torch.randn(1, 15), w)


@needs_kernel
def test_non_contiguous_input_is_read_as_its_values():
    w = torch.randn(12, 40)
    x = torch.randn(40, 3).T  # [3, 40], not contiguous
    assert torch.equal(native.linear(x, w), native.linear(x.contiguous(), w))


def test_off_switch_and_missing_compiler_leave_the_fast_path_on_its_other_kernels(monkeypatch, tmp_path):
    from eagle3cli.decode.fast_target import NATIVE, Linear

    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    try:
        native.reset()
        monkeypatch.setenv("EAGLE3_NATIVE", "0")
        assert not native.available() and native.status() == "off (EAGLE3_NATIVE=0)"
        assert not Linear.can_pack(torch.randn(4, 4), NATIVE)
        lin = Linear(torch.randn(4, 4), None, (NATIVE,))
        assert lin.packed == {}  # skipped, not an error
        native.reset()
        monkeypatch.delenv("EAGLE3_NATIVE")
        monkeypatch.setattr(native.shutil, "which", lambda name: None)
        assert native.kernel() is None and native.status() == "no C compiler (set CC)"
        native.reset()
        monkeypatch.setattr(native.shutil, "which", lambda name: "/bin/false")
        monkeypatch.setenv("CC", "/bin/false")
        assert native.kernel() is None and native.status().startswith("not built: /bin/false failed")
        assert not list((tmp_path / "native").iterdir())  # neither a library nor its source left
    finally:
        native.reset()


@needs_kernel
def test_a_build_that_fails_its_self_test_is_not_used_nor_kept(monkeypatch, tmp_path):
    """A fresh build runs small products in a child process first (a CPU or VM that does not run
    its instructions kills the child); one that fails is discarded and the fast path keeps oneDNN."""
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    try:
        native.reset()
        monkeypatch.setattr(native, "SELF_TEST", "import os; os.abort()")
        assert native.kernel() is None and native.status().startswith("not built: self-test failed (-6)")
        assert not list((tmp_path / "native").iterdir())
        native.reset()
        monkeypatch.setattr(native, "SELF_TEST", "import sys; sys.exit('products off by 1.0')")
        assert native.kernel() is None and native.status().endswith("products off by 1.0")
    finally:
        native.reset()


@needs_kernel
def test_the_library_is_cached_per_cpu_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path))
    try:
        native.reset()
        assert native.available()
        built = list((tmp_path / "native").iterdir())
        assert [p.suffix for p in built] == [".so"]  # the source file is not left behind
        mtime = built[0].stat().st_mtime_ns
        native.reset()
        assert native.available() and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
        monkeypatch.setattr(native, "_cpu_id", lambda: "another CPU")
        assert native.library_path("cc") != built[0]
    finally:
        native.reset()


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_a_residual_added_in_the_kernel_rounds_as_the_separate_sum(bias):
    """``Matrix(w, b)(x, add=r)`` is bitwise ``r + Matrix(w, b)(x)``: the fast path folds its two
    residual adds a layer into o_proj and down_proj without changing a bit."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 70, generator=g)
    b = torch.randn(37, generator=g) if bias else None
    mat = native.Matrix(w, b)
    for m in (1, 3, native.MAX_ROWS):
        x, r = torch.randn(m, 70, generator=g), torch.randn(m, 37, generator=g) * 50
        assert torch.equal(mat(x, add=r), r + mat(x))
    with pytest.raises(ValueError, match="cannot run"):
        native.Matrix(w.double())
    with pytest.raises(ValueError, match="fp32 rows"):
        mat(torch.randn(1, 70, dtype=torch.float64))
    with pytest.raises(ValueError, match="add"):
        mat(torch.randn(2, 70), add=torch.randn(1, 37))  # never broadcast
    x = torch.randn(2, 70)
    before = mat(x)
    native.reset()  # a Matrix made before a reset loads the kernel again
    assert torch.equal(mat(x), before)
    r = torch.randn(37, 2).T  # [2, 37], not contiguous: read as its values
    x = torch.randn(2, 70)
    assert torch.equal(mat(x, add=r), r + mat(x))


def test_eval_says_why_the_native_kernels_are_not_used(monkeypatch, tmp_path):
    """Where the kernels cannot be built, eval's packing line is preceded by the reason (and the
    run goes on with the other kernels)."""
    from types import SimpleNamespace

    from eagle3cli.decode.fast_target import FastTarget
    from eagle3cli.evaluate.fast_setup import pack_for_run
    from tests.helpers.tiny import tiny_model

    monkeypatch.setenv("EAGLE3_NATIVE", "0")
    native.reset()
    try:
        lines = []
        settings = SimpleNamespace(shape=lambda: (3, 1, 3))
        tuned = pack_for_run(FastTarget(tiny_model("llama"), 64), settings, log=lines.append)
        assert lines[0] == "native kernels not used: off (EAGLE3_NATIVE=0) (docs/troubleshooting.md)"
        assert tuned is None or "native" not in tuned["ms"]
    finally:
        native.reset()


@needs_kernel
def test_attention_over_a_long_cache_is_the_same_on_any_thread_count():
    """Enough (row, head) pairs over enough keys to be split over the threads: each pair computes
    alike on any thread (so a verification stays bitwise one-token decoding), and the result is
    causal grouped-query attention (float64 reference; RoPE the identity here)."""
    g = torch.Generator().manual_seed(2)
    nh, nkv, hd, past, n = 8, 2, 64, 200, 4
    kv0 = torch.randn(2, nkv, past + n, hd, generator=g)
    qkv0 = torch.randn(n, (nh + 2 * nkv) * hd, generator=g)
    pos, scale = torch.arange(past, past + n), hd ** -0.5
    cos, sin = torch.ones(past + n, hd), torch.zeros(past + n, hd)
    threads, outs = torch.get_num_threads(), []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            kv = kv0.clone()
            outs.append(native.attend(qkv0.clone(), pos, cos, sin, kv, past, nh, scale))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    causal = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    torch.testing.assert_close(outs[0], _float64_attention(qkv0, kv, nh, causal, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[:, :, past:], qkv0[:, nh * hd:].view(n, 2, nkv, hd).permute(1, 2, 0, 3))


@needs_kernel
@pytest.mark.parametrize("hd", [8, 64])  # one element at a time; 16 at a time with vectorised exponentials
@pytest.mark.parametrize("spread", [1.0, 30.0])  # scores far apart: most exponentials underflow to 0
def test_masked_attention_matches_float64(hd, spread):
    g = torch.Generator().manual_seed(3)
    nh, nkv, past, n = 4, 2, 37, 5
    kv = torch.randn(2, nkv, past + n, hd, generator=g)
    qkv = torch.randn(n, (nh + 2 * nkv) * hd, generator=g) * spread
    mask = torch.rand(n, past + n, generator=g) < 0.6
    mask[torch.arange(n), past + torch.arange(n)] = True  # each row sees itself
    cos, sin = torch.ones(past + n, hd), torch.zeros(past + n, hd)
    got = native.attend(qkv.clone(), torch.arange(past, past + n), cos, sin, kv, past, nh, hd ** -0.5, mask=mask)
    torch.testing.assert_close(got, _float64_attention(qkv, kv, nh, mask, hd ** -0.5), atol=1e-5, rtol=1e-5)


def _float64_attention(qkv: torch.Tensor, kv: torch.Tensor, nh: int, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention of qkv's query heads over the cache kv [2, nkv, slots, hd] (the
    kernel has written the new rows' k and v there), in float64: [n, nh * hd] as float32."""
    n, hd = qkv.shape[0], kv.shape[-1]
    q = qkv[:, :nh * hd].view(n, nh, hd).transpose(0, 1).double()  # [nh, n, hd]
    keys, values = kv.double().repeat_interleave(nh // kv.shape[1], 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(n, nh * hd).float()
