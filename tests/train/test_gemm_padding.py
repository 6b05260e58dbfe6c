"""bf16 training on a CPU pads the TTT unroll to few GEMM shapes, with the unpadded results."""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3cli.train.gemm_padding import LENGTH_MULTIPLE, TOKEN_MULTIPLE, cpu_bf16_autocast, grid_shape
from eagle3cli.train.ttt import TTTModel, teacher_from_final, teacher_rows
from tests.helpers.tiny import tiny_model
from tests.helpers.ttt import make_draft

GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.baddbmm.default}


class GemmShapes(TorchDispatchMode):
    """Every GEMM's operand shapes and dtype, as dispatched."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            a, b = (args[1], args[2]) if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) \
                else (args[0], args[1])
            self.shapes.add((tuple(a.shape), tuple(b.shape), a.dtype))
        return func(*args, **(kwargs or {}))


def test_grid_is_the_smallest_of_the_allowed_sizes():
    assert grid_shape(4, 216) == (4, 224)  # 896 tokens: the length alone
    assert grid_shape(1, 300) == (1, 320)  # rows x 304 would need 4 rows
    assert grid_shape(3, 100) == (3, 128)  # 3 x 112 would need a fourth row: 448 > 384
    assert grid_shape(3, 13) == (4, 16)  # a row of its own
    for b, t in itertools.product(range(1, 9), range(1, 200)):
        rows, length = grid_shape(b, t)
        assert rows >= b and length >= t and length % LENGTH_MULTIPLE == 0 and rows * length % TOKEN_MULTIPLE == 0
        smaller = [(rr, ll) for rr in range(b, rows + 1) for ll in range(t, length + 1, 1)
                   if ll % LENGTH_MULTIPLE == 0 and rr * ll % TOKEN_MULTIPLE == 0 and rr * ll < rows * length]
        assert not smaller, (b, t, rows, length, smaller)


def batch(draft, b, t, seed):
    """Inputs as the trainer passes them: a teacher at the rows the loss reads, a padded tail."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * 64, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[-1, t - 3:] = False
    target = tiny_model("llama")
    teacher = teacher_from_final(target, torch.randn(b, t, 64, generator=g), draft.d2t, teacher_rows(mask))
    return ids, aux, mask, teacher.probs, teacher.index, teacher.slot


def run(model, args, autocast=False):
    params = [p for p in model.draft.parameters() if p.requires_grad]
    rec = GemmShapes()
    with rec, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(*args)
        grads = torch.autograd.grad(out.loss, params)
    return out, grads, rec.shapes


@pytest.mark.parametrize("accept_weight", [0.0, 0.3])
def test_padded_unroll_gives_the_unpadded_loss_gradients_and_metrics_in_fp32(accept_weight):
    draft = make_draft()
    args = batch(draft, 3, 13, seed=1)  # grid [4, 16]: a row and 3 positions of padding
    model = TTTModel(draft, steps=3, decay=0.8, accept_weight=accept_weight)
    plain, plain_grads, plain_shapes = run(model, args)
    model.pad_shapes = True
    padded, padded_grads, padded_shapes = run(model, args)
    torch.testing.assert_close(padded.loss, plain.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(padded.step_loss, plain.step_loss, atol=1e-6, rtol=1e-6)
    assert torch.equal(padded.correct, plain.correct) and torch.equal(padded.counted, plain.counted)
    for a, r in zip(padded_grads, plain_grads):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)
    # fp32 without pad_shapes is not padded: the fc reads 39 token rows, the head the loss rows.
    rows = int(plain.counted.sum())
    assert ((39, 3 * 64), (3 * 64, 64), torch.float32) in plain_shapes
    assert any(a[0] == rows for a, _, _ in plain_shapes) and rows % TOKEN_MULTIPLE
    # Padded: 64 token rows (4 x 16), the loss rows rounded up to 64; no GEMM sees 39 or ``rows``.
    assert ((64, 3 * 64), (3 * 64, 64), torch.float32) in padded_shapes
    assert ((TOKEN_MULTIPLE, 64), (64, 64), torch.float32) in padded_shapes  # the head over the loss rows
    assert not any(n in (39, rows) for a, b, _ in padded_shapes for n in (*a, *b))


def test_bf16_autocast_on_a_cpu_pads_to_the_same_shapes_for_different_batches():
    """Two micro-batches of other sizes ([3, 13] and [4, 11], other loss row counts) run the same
    GEMM shapes under CPU bf16 autocast, and fp32 runs their own; the loss is the unpadded bf16 one."""
    draft = make_draft()
    model = TTTModel(draft, steps=3, decay=0.8)
    a, b = batch(draft, 3, 13, seed=1), batch(draft, 4, 11, seed=2)
    assert int(teacher_rows(a[2]).sum()) != int(teacher_rows(b[2]).sum())
    out_a, _, shapes_a = run(model, a, autocast=True)
    _, _, shapes_b = run(model, b, autocast=True)
    assert shapes_a == shapes_b and any(dtype == torch.bfloat16 for *_, dtype in shapes_a)
    assert run(model, a)[2] != run(model, b)[2]
    model.pad_shapes = False
    unpadded, _, _ = run(model, a, autocast=True)
    torch.testing.assert_close(out_a.loss, unpadded.loss, atol=2e-2, rtol=2e-2)
    assert torch.equal(out_a.counted, unpadded.counted)


def test_padding_is_asked_for_only_under_bf16_autocast_on_a_cpu():
    cpu = torch.device("cpu")
    assert not cpu_bf16_autocast(cpu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_bf16_autocast(cpu) and not cpu_bf16_autocast(torch.device("cuda"))
    with torch.autocast("cpu", dtype=torch.float16):
        assert not cpu_bf16_autocast(cpu)


def test_head_loss_under_bf16_autocast_is_the_fp32_loss_of_the_bf16_logits():
    """Autocast would take the <p, z> of the soft cross-entropy (and the weighted sum) in bf16,
    about 1e-2 off per row here; they are fp32. The gradients are those of bf16 GEMMs over
    g = w (softmax(z) - p) rounded once to bf16."""
    from eagle3cli.train.ttt import head_soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 200, 64, 512
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).requires_grad_()
    probs = torch.softmax(torch.randn(50, vocab, generator=g) * 3, -1)
    prow = torch.randint(0, 50, (n,), generator=g)
    rw = torch.rand(n, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head_soft_cross_entropy(h, w, probs, prow, rw, max_elements=64 * vocab)
        gh, gw = torch.autograd.grad(out.loss, (h, w))
    z = (h.detach().bfloat16() @ w.detach().bfloat16().t()).float()
    p = probs[prow]
    row = torch.logsumexp(z, -1) - (p * z).sum(-1)
    torch.testing.assert_close(out.row_loss, row, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.loss, (row * rw).sum(), atol=1e-4, rtol=1e-6)
    grad_z = ((torch.softmax(z, -1) - p) * rw[:, None]).bfloat16()
    torch.testing.assert_close(gh, (grad_z @ w.detach().bfloat16()).float(), atol=1e-4, rtol=1e-2)
    hb = h.detach().bfloat16()
    ref_w = sum((grad_z[i:i + 64].t() @ hb[i:i + 64]).float() for i in range(0, n, 64))  # chunks of 64 rows
    torch.testing.assert_close(gw, ref_w, atol=1e-4, rtol=1e-2)
