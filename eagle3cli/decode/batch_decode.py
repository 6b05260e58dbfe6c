"""Continuous batching over a static, slotted KV cache: how gen-data regenerates answers fast.

Regeneration answers many independent conversations. A static batch (pad, prefill, decode
until the longest answer ends) spends most of its steps on a shrinking batch, and HF's
``DynamicCache`` copies every layer's whole cache on each step. Here the cache is
preallocated as ``slots`` independent rows ([layers, slots, kv heads, max_len, head_dim]);
each slot holds one conversation. One decode step advances every busy slot by one token.
When a slot's answer ends, the slot is refilled at once: with the conversation's next turn
(only the tokens after the longest common prefix with what the slot already holds are
prefilled, so a multi-turn conversation is never re-read from the start) or with the next
conversation. Busy slots are kept at indices 0..m-1, so each step's cache is a plain view.

Per slot the computation is the model's own: same weights and formulas as ``fast_target``
(HF's RoPE tables, RMSNorm in fp32); K/V at a position depend only on the tokens before it,
which is why keeping a common prefix is exact. The schedule depends only on the inputs and
the settings, so the answers are a pure function of them (resume stays byte-identical).

In fp32 on a CPU with the native kernels built (``decode.native``; Llama-shaped layers), a decode
step runs each layer as one compiled call over the busy slots' rows, up to the kernels' 16 rows a
call: the weights are read once for all of them, each row attends to its own slot's cache, and
every row is computed bitwise as it would be alone. Prefills take the same kernels whatever the
slot count. So regeneration with any number of slots is token for token what decoding the
conversations one at a time (one slot) gives, near-ties included, at several times its rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import native
from .attention import kind_masks, layout
from .fast_target import NATIVE, ONEDNN, SUPPORTED_TYPES, Decoder, _rms_norm


class SlotTarget:
    """The target's decoder over a KV cache of ``slots`` independent sequences."""

    def __init__(self, model, slots: int, max_len: int, dtype: torch.dtype | None = None):
        """``dtype``: compute (and cache) in it, the weights cast once; None keeps the model's."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        # fp32: MKL's packed GEMM for a full decode step and a half-full one (rows padded up to the
        # next packed size): the batch thins out once no conversation is left to start. bf16:
        # oneDNN's prepacked linear, one copy for every row count (unpacked, a bf16 matmul reorders
        # its weight on every call). Keys a dtype cannot pack are skipped.
        # fp32 with the native kernels built: those (see the module's docstring), oneDNN for prefills
        # of more rows than they serve, whatever the slot count.
        compute = dtype or model.dtype
        native_ok = compute == torch.float32 and next(model.parameters()).device.type == "cpu" and native.available()
        rows = ((NATIVE, ONEDNN) if native_ok else (ONEDNN,) if compute == torch.bfloat16
                else tuple(sorted({slots, max(2, slots // 2)})))
        d = Decoder(model, rows, purpose="continuous batching", dtype=dtype, families=SUPPORTED_TYPES,
                    mixed=False)
        self.decoder = d
        self.n_heads, self.n_kv, self.head_dim = d.n_heads, d.n_kv, d.head_dim
        self.embed, self.layers, self.norm, self.norm_eps, self.head = d.embed, d.layers, d.norm, d.norm_eps, d.head
        self.slots = slots
        self.layout = layout(model.config)  # each layer's window or chunk, applied in its mask
        plain = all(not lay.gemma and lay.qk_norms is None and lay.res_mult is None for lay in self.layers)
        self.native = None  # native.NativeLayers, where decode steps run through them
        if native_ok and plain and not self.layout.windowed and d.embed_mult is None and d.embed_scale is None:
            try:
                self.native = [native.NativeLayer(lay, self.n_heads, self.n_kv, self.head_dim) for lay in self.layers]
            except ValueError:  # a weight the kernels do not take: the torch ops below
                self.native = None
        if native_ok and self.native is None:  # the MKL packing the torch ops run fastest with
            d.repack(tuple(sorted({slots, max(2, slots // 2)})))
        self._rope = apply_rotary_pos_emb
        self.max_len = 0
        self.k = self.v = None
        self.grow(max_len)

    def grow(self, max_len: int):
        """Make room for ``max_len`` positions per slot (kept entries are copied over)."""
        if max_len <= self.max_len:
            return
        max_len = max(max_len, self.max_len * 3 // 2)  # grow geometrically: decode asks one more each step
        dev, dtype = self.embed.device, self.embed.dtype
        self.cos, self.sin = self.decoder.rope(max_len)[None]  # [max_len, head_dim]
        half = self.head_dim // 2  # the native kernels' table: sin with its first half negated
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], -1).contiguous()
        self.cos = self.cos.contiguous()
        shape = (len(self.layers), self.slots, self.n_kv, max_len, self.head_dim)
        k, v = torch.zeros(shape, device=dev, dtype=dtype), torch.zeros(shape, device=dev, dtype=dtype)
        if self.k is not None:
            k[..., :self.max_len, :], v[..., :self.max_len, :] = self.k, self.v
        self.k, self.v, self.max_len = k, v, max_len

    def _qkv(self, layer, x, positions):
        """q [n, heads, hd], k and v [n, kv heads, hd] of rows x [n, H] at ``positions`` [n], RoPE applied."""
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        n = x.shape[0]
        qkv = layer.qkv(_rms_norm(x, layer.ln1, layer.eps))
        q = qkv[:, :nh * hd].view(n, nh, hd)
        k = qkv[:, nh * hd:(nh + nkv) * hd].view(n, nkv, hd)
        v = qkv[:, (nh + nkv) * hd:].view(n, nkv, hd)
        q, k = layer.qk_norm(q, k)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [n, 1, hd]
        q, k = self._rope(q[:, :, None], k[:, :, None], cos, sin, unsqueeze_dim=1)  # [n, heads, 1, hd]
        return q[:, :, 0], k[:, :, 0], v

    @torch.no_grad()
    def prefill(self, slot: int, ids: list[int], start: int) -> torch.Tensor:
        """Write ``ids`` into ``slot`` at positions start.. (positions < start are kept); last logits [V]."""
        n = len(ids)
        self.grow(start + n)
        dev = self.embed.device
        positions = torch.arange(start, start + n, device=dev)
        x = self.embed[torch.tensor(ids, device=dev)]
        allowed = torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(start)
        masks = kind_masks(allowed, positions, torch.arange(start + n, device=dev), self.layout)
        for j, layer in enumerate(self.layers):
            mask = masks[self.layout.kinds[j]][None, None]
            q, k, v = self._qkv(layer, x, positions)
            self.k[j, slot, :, start:start + n] = k.transpose(0, 1)
            self.v[j, slot, :, start:start + n] = v.transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.k[j, slot:slot + 1, :, :start + n],
                                               self.v[j, slot:slot + 1, :, :start + n], attn_mask=mask,
                                               scale=layer.scaling, enable_gqa=self.n_kv != self.n_heads)
            x = self._mlp(layer, x, o[0].transpose(0, 1).reshape(n, -1))
        return self.head(_rms_norm(x[-1:], self.norm, self.norm_eps))[0]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One new token per busy slot 0..m-1 (``tokens`` [m] at positions ``lengths`` [m]); logits [m, V]."""
        m = tokens.shape[0]
        span = int(lengths.max()) + 1
        self.grow(span)
        if self.native is not None:
            return self._native_decode(tokens, lengths)
        rows = torch.arange(m, device=tokens.device)
        x = self.embed[tokens]
        # [m, span]: slot r sees its own positions 0..lengths[r] (the new token included), narrowed
        # to the layer's window or chunk around lengths[r].
        keys = torch.arange(span, device=tokens.device)
        masks = kind_masks(keys[None] <= lengths[:, None], lengths, keys, self.layout)
        groups = self.n_heads // self.n_kv
        for j, layer in enumerate(self.layers):
            mask = masks[self.layout.kinds[j]][:, None, None]  # [m, 1, 1, span]
            q, k, v = self._qkv(layer, x, lengths)
            self.k[j, rows, :, lengths] = k  # slot r's entry at position lengths[r]
            self.v[j, rows, :, lengths] = v
            # Grouped-query attention without repeating K/V: the query heads sharing a KV head
            # (HF's repeat_kv order: head = kv * groups + i) are that head's "query positions".
            o = F.scaled_dot_product_attention(q.view(m, self.n_kv, groups, -1), self.k[j, :m, :, :span],
                                               self.v[j, :m, :, :span], attn_mask=mask, scale=layer.scaling)
            x = self._mlp(layer, x, o.reshape(m, -1))
        return self.head(_rms_norm(x, self.norm, self.norm_eps))

    def _native_decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``decode`` through the native layers, in calls of up to their MAX_ROWS rows (as even as
        can be: 20 busy slots are two calls of 10), each row bitwise what it would be alone."""
        m = tokens.shape[0]
        calls = -(-m // native.MAX_ROWS)
        positions = lengths.to(torch.int64).contiguous()
        out = []
        for c in range(calls):
            a, b = c * m // calls, (c + 1) * m // calls
            x = self.embed[tokens[a:b]].contiguous()
            pos = positions[a:b]
            scratch = torch.empty(self.native[0].scratch(b - a, int(pos.max())), dtype=torch.float32)
            for j, layer in enumerate(self.native):
                layer.slots(x, pos, self.cos, self.sin_signed, self.k[j, a:], self.v[j, a:], scratch)
            out.append(self.head(_rms_norm(x, self.norm, self.norm_eps)))
        return out[0] if calls == 1 else torch.cat(out)

    @staticmethod
    def _mlp(layer, x, attn_out):
        x = x + layer.o(attn_out)
        gu = layer.gate_up(_rms_norm(x, layer.ln2, layer.eps))
        return x + layer.down(F.silu(gu[:, :layer.inter]) * gu[:, layer.inter:])

    def move(self, src: int, dst: int, length: int):
        """Copy slot ``src``'s first ``length`` entries into slot ``dst`` (compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


@dataclass
class Job:
    """One sequence a slot works on: what it holds, and the answer being generated."""

    key: object  # the caller's handle (e.g. a conversation index)
    held: list[int] = field(default_factory=list)  # tokens whose K/V are in the slot
    answer: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ContinuousBatcher:
    """Runs jobs on ``target``'s slots until none is left.

    ``next_prompt(key)`` gives a job's next prompt ids (None: the job is over) and is called
    again after each answer with ``on_answer(key, ids, ended)`` having been called first, so a
    conversation goes on in its slot turn after turn. ``pick(logits [m, V])`` chooses tokens.
    """

    def __init__(self, target: SlotTarget, max_new_tokens: int, stop_ids: set[int], pick):
        self.target, self.max_new, self.stops, self.pick = target, max_new_tokens, stop_ids, pick

    def run(self, keys: list, next_prompt, on_answer, on_progress=None):
        queue = list(reversed(keys))  # pop() takes them in the given order
        busy: list[Job] = []
        last: list[int] = []  # per busy slot: the token to feed next
        done = 0
        while busy or queue:
            while queue and len(busy) < self.target.slots:  # fill free slots
                job = Job(queue.pop())
                first = self._start(len(busy), job, next_prompt, on_answer)
                if first is None:
                    done += 1
                    continue
                busy.append(job)
                last.append(first)
            if not busy:
                break
            dev = self.target.embed.device
            lengths = torch.tensor([len(j.held) for j in busy], device=dev)
            picked = self.pick(self.target.decode(torch.tensor(last, device=dev), lengths)).tolist()
            finished = []
            for r, (job, t) in enumerate(zip(busy, picked)):
                job.held.append(last[r])
                last[r] = self._advance(r, job, t, next_prompt, on_answer)
                if last[r] is None:
                    finished.append(r)
            for r in reversed(finished):  # compact: the last busy slot moves into the hole
                done += 1
                end = len(busy) - 1
                if r != end:
                    self.target.move(end, r, len(busy[end].held))
                    busy[r], last[r] = busy[end], last[end]
                busy.pop(), last.pop()
            if finished and on_progress and busy:
                on_progress(done, len(keys))
        if on_progress:
            on_progress(done, len(keys))

    def _start(self, slot: int, job: Job, next_prompt, on_answer) -> int | None:
        """Prefill the job's next prompt into ``slot``; the token to feed next (None: job over)."""
        prompt = next_prompt(job.key)
        if prompt is None:
            return None
        keep = min(common_prefix(job.held, prompt), len(prompt) - 1)  # prefill at least one token
        logits = self.target.prefill(slot, prompt[keep:], keep)
        job.held, job.answer = list(prompt), []
        return self._advance(slot, job, int(self.pick(logits[None])[0]), next_prompt, on_answer)

    def _advance(self, slot: int, job: Job, token: int, next_prompt, on_answer) -> int | None:
        """Record ``token`` of the answer in flight; the token to feed next (None: job over)."""
        job.answer.append(token)
        ended = token in self.stops
        if not ended and len(job.answer) < self.max_new:
            return token
        on_answer(job.key, job.answer, ended)
        return self._start(slot, job, next_prompt, on_answer)
