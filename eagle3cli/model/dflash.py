"""The DFlash draft (docs/design.md §13): a block of tokens drafted in one non-causal forward.

    ctx  = hidden_norm(fc(cat(h_1 .. h_n)))          # n target streams -> H, once per token
    x    = embed([anchor, MASK x (B-1)])              # the target's embedding, frozen
    for each layer:                                   # Qwen3-style, q/k RMSNorm per head
        k, v = k_proj/v_proj(cat(ctx rows, input_layernorm(x)))   # context injected as keys and values
        q    = q_proj(input_layernorm(x))             # queries from the block rows only
        x    = x + o_proj(attn(q, k, v))              # the block sees itself whole and the context before its anchor
        x    = x + mlp(post_attention_layernorm(x))   # context rows never pass through an MLP
    logits = target.lm_head(norm(x))                 # position k predicts the token at anchor + k

Parameter names equal the z-lab layout's safetensors names (``fc.weight``, ``layers.0.self_attn.q_proj.weight``
...), so the export is a state_dict filter; ``embed_tokens`` and ``lm_head`` are frozen copies of the
target's and are never exported.

Layer ids here use the package's count (``hidden_states[j]``, the input of decoder layer j,
docs/design.md §2); DFlash's own files count layer outputs (j - 1): ``DFlashConfig.output_layer_ids``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..core.hf_utils import text_config
from .draft import MLP, RMSNorm, Rotary, apply_rope, target_rope_parameters

DRAFT_TYPE = "dflash"


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary: the draft predicts over all of it through the target's head
    target_hidden_size: int
    max_position_embeddings: int
    num_hidden_layers: int  # the draft's own depth
    num_target_layers: int  # the target's depth (engines read it)
    target_layer_ids: tuple[int, ...]  # hidden_states[j] streams fed to fc, ascending (docs/design.md §2)
    block_size: int  # B: the anchor plus B-1 drafted tokens
    mask_token_id: int  # a real row of the target's embedding, filling the block after the anchor
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    tie_word_embeddings: bool = False

    draft_type = DRAFT_TYPE  # a class constant, not a field: every DFlashConfig is a DFlash draft's

    def __post_init__(self):
        self.target_layer_ids = tuple(int(j) for j in self.target_layer_ids)
        if self.block_size < 2:
            raise ValueError(f"a DFlash block holds the anchor and at least one drafted token: block_size "
                             f"{self.block_size} < 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a row of the target's embedding "
                             f"(0..{self.vocab_size - 1})")

    @property
    def output_layer_ids(self) -> tuple[int, ...]:
        """The streams in DFlash's own count (output of layer k = hidden_states[k + 1])."""
        return tuple(j - 1 for j in self.target_layer_ids)

    @classmethod
    def from_target(cls, target_config, target_layer_ids, *, block_size: int, mask_token_id: int,
                    num_hidden_layers: int, **overrides) -> "DFlashConfig":
        cfg = text_config(target_config)
        heads = cfg.num_attention_heads
        kw = dict(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            vocab_size=cfg.vocab_size,
            target_hidden_size=cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings,
            num_hidden_layers=int(num_hidden_layers),
            num_target_layers=int(cfg.num_hidden_layers),
            target_layer_ids=tuple(target_layer_ids),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            rope_parameters=target_rope_parameters(cfg),
            pad_token_id=getattr(cfg, "pad_token_id", None),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["draft_type"] = DRAFT_TYPE
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def llama_config(self):
        """A LlamaConfig of the same geometry, for the RoPE tables (``Rotary``)."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           num_hidden_layers=self.num_hidden_layers, rms_norm_eps=self.rms_norm_eps,
                           vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters))


def choose_mask_token(tokenizer_or_vocab_size, special_ids=(), used_vocab_size: int | None = None) -> int:
    """A MASK id that is a real row of the target's embedding and no token the target emits.

    The first row past the tokenizer's own vocabulary when the embedding has spare rows (Qwen's
    padded tables: 151669 for Qwen3), else the tokenizer's last id that is not a special token
    of the model (eos, pad, bos: a block pre-filled with eos would end decoding at once).
    """
    vocab_size = tokenizer_or_vocab_size if isinstance(tokenizer_or_vocab_size, int) else None
    if used_vocab_size is not None and vocab_size is not None and used_vocab_size < vocab_size:
        return int(used_vocab_size)
    if vocab_size is None:
        raise ValueError("choose_mask_token needs the embedding's row count")
    special = {int(s) for s in special_ids if s is not None}
    for cand in range(vocab_size - 1, -1, -1):
        if cand not in special:
            return cand
    raise ValueError("no embedding row is free of the model's special tokens")


class DFlashCache:
    """The context keys and values of one draft layer (RoPE applied), for the committed tokens
    whose target features are known; block rows are never kept (every block is drafted anew)."""

    def __init__(self):
        self.k: torch.Tensor | None = None  # [B, kv heads, L, head_dim]
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def crop(self, n: int):
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, cos, sin):
        """Rotated, k-normed keys and values [B, kv heads, T, hd] of rows ``x`` (context or block)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv))
        return apply_rope(k, cos, sin), self._heads(self.v_proj(x), self.num_kv)

    def query(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)

    def attend(self, q, k, v, mask) -> torch.Tensor:
        rep = self.num_heads // self.num_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask) -> torch.Tensor:
        """Block rows ``x`` [B, R, H] attend to the context keys/values given and to the block rows
        themselves (keys = context first, then block rows; ``mask`` [.., R, C+R] "may attend")."""
        attn = self.self_attn
        hx = self.input_layernorm(x)
        bk, bv = attn.keys_values(hx, cos, sin)
        k, v = torch.cat([ctx_k, bk], dim=2), torch.cat([ctx_v, bv], dim=2)
        x = x + attn.attend(attn.query(hx, cos, sin), k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The DFlash draft with frozen copies of the target's embedding and LM head."""

    def __init__(self, cfg: DFlashConfig, embed_weight: torch.Tensor | None = None,
                 head_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        n_in = len(cfg.target_layer_ids) * cfg.target_hidden_size
        self.fc = nn.Linear(n_in, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for p in (self.embed_tokens.weight, self.lm_head.weight):
            p.requires_grad_(False)
        if embed_weight is not None:
            self.set_embedding(embed_weight)
        if head_weight is not None:
            self.set_head(head_weight)

    # ---- setup -------------------------------------------------------------------------
    def _copy(self, param: torch.Tensor, weight: torch.Tensor, what: str):
        if tuple(weight.shape) != tuple(param.shape):
            raise ValueError(f"the target's {what} has shape {tuple(weight.shape)}, the draft expects "
                             f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(weight.to(param.dtype))

    def set_embedding(self, weight: torch.Tensor):
        self._copy(self.embed_tokens.weight, weight, "embedding")

    def set_head(self, weight: torch.Tensor):
        self._copy(self.lm_head.weight, weight, "LM head")

    def init_weights(self, std: float = 0.02, seed: int | None = None, residual_std: float | None = None):
        """Random normal linears (fc and every layer's), the norms at one; the frozen parts untouched.
        ``residual_std`` (default ``std``) scales each layer's o_proj and down_proj, the two that write
        into the block's stream: at 0 every layer starts as the identity. Every weight is drawn
        either way, so a seed gives the others alike."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear) and name != "lm_head":
                writer = name.endswith(("o_proj", "down_proj"))
                scale = residual_std if writer and residual_std is not None else std
                with torch.no_grad():
                    mod.weight.copy_((torch.randn(mod.weight.shape, generator=gen) * scale).to(mod.weight.dtype))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a DFlash draft file holds: everything but the target's embedding and head."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}

    def num_parameters(self) -> int:
        return sum(v.numel() for v in self.trainable_state_dict().values())

    # ---- pieces shared by training and decoding ------------------------------------------
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """n target streams [B, T, n*Ht] -> the injected context rows [B, T, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def block_embeddings(self, anchors: torch.Tensor) -> torch.Tensor:
        """[anchor, MASK x (B-1)] embedded for each anchor token [...]: [..., B, H]."""
        b = self.config.block_size
        ids = anchors.new_full((*anchors.shape, b), self.config.mask_token_id)
        ids[..., 0] = anchors
        return self.embed_tokens(ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def run_layers(self, x, ctx, ctx_pos, blk_pos, mask, caches: list[DFlashCache] | None = None):
        """Every layer over block rows ``x`` [B, R, H] at positions ``blk_pos`` [B, R], with context
        rows ``ctx`` [B, C, H] at ``ctx_pos`` [B, C] (appended to ``caches`` when given, whose
        earlier entries are attended too); returns the final hidden rows (before ``norm``)."""
        cos, sin = self.rotary(blk_pos, x.dtype)
        ccos, csin = self.rotary(ctx_pos, x.dtype)
        for i, layer in enumerate(self.layers):
            ck, cv = layer.self_attn.keys_values(ctx, ccos, csin)
            if caches is not None:
                caches[i].append(ck, cv)
                ck, cv = caches[i].k, caches[i].v
            x = layer(x, ck, cv, cos, sin, mask)
        return x

    # ---- decoding: one block from a cache of the committed context -----------------------
    @torch.no_grad()
    def draft_block(self, aux_new: torch.Tensor, new_pos: torch.Tensor, anchor: torch.Tensor,
                    caches: list[DFlashCache]) -> torch.Tensor:
        """Append the target streams of newly committed tokens (``aux_new`` [1, r, n*Ht] at positions
        ``new_pos`` [1, r]) to the caches, then draft the block after ``anchor`` (the last committed
        token, [1], whose position follows the cached context): logits [1, B, V] of the block rows;
        row k predicts the token at anchor + k."""
        start = len(caches[0]) + aux_new.shape[1]
        b = self.config.block_size
        x = self.block_embeddings(anchor.view(1)).to(self.fc.weight.dtype)  # [1, B, H]
        pos = torch.arange(start, start + b, device=x.device)[None]
        x = self.run_layers(x, self.context(aux_new), new_pos, pos, None, caches)
        return self.logits(x)

    # ---- training: every block of a sequence in one forward --------------------------------
    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Logits [B, m, block, V] of the blocks at ``anchors`` [B, m] (positions in the sequence)."""
        return self.logits(self.block_states(aux, input_ids, anchors))

    def block_states(self, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The last layer's rows [B, m, block, H] (before ``norm``) of the blocks at ``anchors`` [B, m].

        Block i sees the context rows strictly before its anchor and its own rows, nothing else
        (``block_mask``); ``aux`` [B, T, n*Ht] are the target streams, ``input_ids`` [B, T].
        """
        bsz, t = input_ids.shape
        m, blk = anchors.shape[1], self.config.block_size
        ctx = self.context(aux)
        x = self.block_embeddings(input_ids.gather(1, anchors)).to(ctx.dtype).reshape(bsz, m * blk, -1)
        offs = torch.arange(blk, device=anchors.device)
        blk_pos = (anchors[..., None] + offs).reshape(bsz, m * blk)
        ctx_pos = torch.arange(t, device=anchors.device).expand(bsz, t)
        mask = block_mask(anchors, t, blk)
        return self.run_layers(x, ctx, ctx_pos, blk_pos, mask).view(bsz, m, blk, -1)


def block_mask(anchors: torch.Tensor, t: int, blk: int) -> torch.Tensor:
    """The "may attend" mask [B, 1, m*blk, t + m*blk] of ``DFlashDraft.forward``: a block row sees
    the context rows before its anchor and every row of its own block, no other block's."""
    bsz, m = anchors.shape
    dev = anchors.device
    block_of = torch.arange(m, device=dev).repeat_interleave(blk)  # [m*blk]
    ctx_ok = torch.arange(t, device=dev)[None, None] < anchors.repeat_interleave(blk, dim=1)[..., None]
    own = (block_of[:, None] == block_of[None, :]).expand(bsz, -1, -1)
    return torch.cat([ctx_ok, own], dim=-1)[:, None]
