"""The EAGLE-3 draft model (docs/design.md §3): one Llama-style decoder layer.

    g   = fc(cat(h_low, h_mid, h_high))                     # 3*Ht -> H, once per token
    x   = cat(input_layernorm(embed(tok)), hidden_norm(g))  # 2H, embedding first
    h   = g + o_proj(attn(q,k,v from x))                    # residual is the un-normed g
    a   = h + mlp(post_attention_layernorm(h))              # the draft's output stream
    p   = softmax(lm_head(norm(a)))                         # over the draft vocabulary

The next drafting step feeds ``a`` (not its normed value) where ``g`` was. Parameter names
match the exported safetensors names exactly (no ``model.`` prefix), so export is a plain
state_dict filter.

Options the serving engines read from config.json (docs/design.md §3), all off by default:

    fc_norm               g = fc(cat(fc_norm.0(h_low), fc_norm.1(h_mid), fc_norm.2(h_high)))   # EAGLE-3.1
    norm_output           the output stream is norm(a): fed to the next step, lm_head reads it  # EAGLE-3.1
    norm_before_fc        g = fc(input_norm(cat(h_low, h_mid, h_high)))    # one norm over 3*Ht
    norm_before_residual  h = hidden_norm(g) + o_proj(attn(...))           # speculators' variant
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..core.hf_utils import text_config


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    max_position_embeddings: int
    aux_layer_ids: tuple[int, int, int]
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    # Architecture options (docs/design.md §3); the defaults are the EAGLE-3 paper's draft.
    fc_norm: bool = False  # one RMSNorm per target stream before fc (EAGLE-3.1)
    norm_output: bool = False  # feed norm(a) to the next step and to lm_head (EAGLE-3.1)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated 3*Ht streams before fc
    norm_before_residual: bool = False  # the residual around attention is hidden_norm(g)

    def __post_init__(self):
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are mutually exclusive (speculators refuses both; "
                             "choose per-stream norms or one norm over the concatenation)")

    @property
    def variant(self) -> str:
        """'eagle3.1' when both EAGLE-3.1 options are on, else 'eagle3' (other options aside)."""
        return "eagle3.1" if self.fc_norm and self.norm_output else "eagle3"

    def options(self) -> dict[str, bool]:
        """The architecture options that are on."""
        return {k: True for k in OPTION_KEYS if getattr(self, k)}

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids, **overrides) -> "DraftConfig":
        cfg = text_config(target_config)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kw = dict(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            vocab_size=cfg.vocab_size,
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings,
            aux_layer_ids=tuple(int(j) for j in aux_layer_ids),
            rope_parameters=target_rope_parameters(cfg),
            pad_token_id=getattr(cfg, "pad_token_id", None),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["aux_layer_ids"] = tuple(kw["aux_layer_ids"])
        return cls(**kw)

    def llama_config(self):
        """A transformers LlamaConfig with the same geometry (used for RoPE and by engines)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
        )


OPTION_KEYS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")


def target_rope_parameters(cfg) -> dict:
    """The target's RoPE settings as one dict (rope_type, rope_theta, scaling keys).

    transformers 5 keeps them in ``rope_parameters``; models with per-layer-type RoPE
    (Gemma-3: sliding vs full attention) nest one dict per type: the draft is a full-attention
    layer, so it takes the full-attention one.

    ``partial_rotary_factor`` (GLM-4, Phi-2, StableLM rotate only part of each head) is left
    out: the draft's attention rotates every dimension of its heads, and an engine that read the
    target's factor from the draft's config would run another draft than the one trained.
    """
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        if "full_attention" in rp and isinstance(rp["full_attention"], dict):
            rp = rp["full_attention"]
        out = dict(rp)
    else:  # transformers 4.x style
        out = dict(getattr(cfg, "rope_scaling", None) or {})
        out.setdefault("rope_type", out.pop("type", "default"))
        out["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0))
    out.pop("partial_rotary_factor", None)
    out.setdefault("rope_type", "default")
    out.setdefault("rope_theta", 10000.0)
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Rotary(nn.Module):
    """RoPE with the target's scaling (any rope_type transformers knows: llama3, yarn, ...)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        lcfg = cfg.llama_config()
        rope_type = cfg.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = float(cfg.rope_parameters["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
            scale = 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](lcfg, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scale)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """cos, sin of shape [B, 1, T, head_dim] for broadcasting over heads."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin


class KVCache:
    """The draft's own cache: keys/values of the verified prefix plus drafted nodes, KV heads
    already repeated to the query heads (grouped-query attention is expanded once per new row,
    not once per step over the whole prefix)."""

    def __init__(self):
        self.k: torch.Tensor | None = None  # [B, heads, L, head_dim]
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int):
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def select(self, keep: torch.Tensor):
        """Keep the cache entries at positions ``keep`` (1-D index tensor), in that order."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, keep], self.v[:, :, keep]


class DecodeCache(KVCache):
    """The drafter's cache at inference: preallocated, doubled when full, so a step writes its
    new rows in place instead of copying the whole prefix (``KVCache.append`` concatenates, which
    autograd needs in training). ``k``/``v`` are views of the filled part."""

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity, self.n = capacity, 0
        self._k = self._v = None

    def __len__(self) -> int:
        return self.n

    def _grow(self, like: torch.Tensor, need: int):
        cap = max(need, 2 * self.capacity if self._k is not None else self.capacity)
        b, h, _, d = like.shape
        k, v = like.new_empty(b, h, cap, d), like.new_empty(b, h, cap, d)
        if self._k is not None:
            k[:, :, : self.n], v[:, :, : self.n] = self._k[:, :, : self.n], self._v[:, :, : self.n]
        self._k, self._v, self.capacity = k, v, cap

    def _views(self):
        self.k, self.v = self._k[:, :, : self.n], self._v[:, :, : self.n]
        return self.k, self.v

    def append(self, k: torch.Tensor, v: torch.Tensor):
        need = self.n + k.shape[2]
        if self._k is None or need > self._k.shape[2]:
            self._grow(k, need)
        self._k[:, :, self.n: need], self._v[:, :, self.n: need] = k, v
        self.n = need
        return self._views()

    def crop(self, n: int):
        if self._k is not None:
            self.n = min(self.n, n)
            self._views()

    def select(self, keep: torch.Tensor):
        if self._k is not None:
            k, v = self._k[:, :, keep], self._v[:, :, keep]  # a gather copies, so the write is safe
            self.n = len(keep)
            self._k[:, :, : self.n], self._v[:, :, : self.n] = k, v
            self._views()


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q [B,nh,T,hd], k and v [B,nkv,T,hd]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """Repeat KV heads for grouped-query attention."""
        rep = self.num_heads // self.num_kv
        return t if rep == 1 else t.repeat_interleave(rep, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act = ``hidden_act`` (SwiGLU for "silu")."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        if cfg.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not an activation transformers knows "
                             f"(e.g. silu, gelu_pytorch_tanh)")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """h + mlp(...); ``residual`` is the un-normed hidden input (normed here with
        norm_before_residual, as vLLM's and speculators' ``_norm_before_residual``)."""
        if self.norm_before_residual:
            residual = self.hidden_norm(residual)
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)])
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Frozen copy of the target's token embedding (exported only if H != Ht).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if embed_weight is not None:
            self.set_embedding(embed_weight)
        self.rotary = Rotary(cfg)
        # Draft vocab maps (docs/design.md §4): target_id = draft_id + d2t[draft_id]; t2d marks members.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.draft_vocab_size == cfg.vocab_size:
            self.t2d.fill_(True)

    # ---- setup -------------------------------------------------------------------------
    def set_embedding(self, weight: torch.Tensor):
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding has shape {tuple(weight.shape)}, the draft expects "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    def set_vocab(self, draft_to_target_ids: torch.Tensor):
        """Install the vocab maps from the sorted target ids of the draft vocabulary."""
        ids = draft_to_target_ids.to(torch.long).cpu()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"expected {self.config.draft_vocab_size} draft tokens, got {ids.numel()}")
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def init_weights(self, std: float = 0.02, seed: int | None = None, residual_std: float | None = None):
        """Random normal weights for fc, the head and the layer's linears. ``residual_std`` (default
        ``std``) scales the two that write into the residual stream (o_proj, down_proj): at 0 the
        layer starts as the identity, so the first steps train fc and the head as a linear probe of
        the target's streams. Every weight is drawn either way, so a seed gives the others alike."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        layer = self.midlayer
        linears = [m for m in (*layer.self_attn.children(), *layer.mlp.children()) if isinstance(m, nn.Linear)]
        writers = {id(layer.self_attn.o_proj), id(layer.mlp.down_proj)}
        for mod in [self.fc, self.lm_head, *linears]:
            scale = std if residual_std is None or id(mod) not in writers else residual_std
            with torch.no_grad():
                w = torch.randn(mod.weight.shape, generator=gen) * scale
                mod.weight.copy_(w.to(mod.weight.dtype))

    # ---- pieces shared by inference and training ----------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """3*Ht target streams -> g (H), through input_norm or fc_norm when the options are on."""
        return self.fc(self.fuse_input(aux.to(self.fc.weight.dtype)))

    def fuse_input(self, aux: torch.Tensor) -> torch.Tensor:
        """What fc reads of the 3*Ht target streams: themselves, or normed by input_norm / fc_norm."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return aux

    def output(self, a: torch.Tensor) -> torch.Tensor:
        """The output stream as the next step and ``logits`` see it: norm(a) with norm_output, else a."""
        return self.norm(a) if self.config.norm_output else a

    def head_input(self, a: torch.Tensor) -> torch.Tensor:
        """What lm_head reads of the output stream (``output``): norm is applied exactly once."""
        return a if self.config.norm_output else self.norm(a)

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits from the output stream (``output``)."""
        return self.lm_head(self.head_input(a))

    # ---- one drafting step with a KV cache (inference) ----------------------------------
    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the layer on T new tokens; returns their output stream ``a`` [B,T,H] (``output``).

        ``hidden`` is g (already fused) for verified tokens or the previous step's ``a`` for
        drafted ones. ``attn_mask`` is a bool [B or 1, 1, T, len(cache)+T] "may attend" mask;
        None means causal over the new tokens with the whole cache visible.
        """
        layer = self.midlayer
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        x = layer.attn_input(emb, hidden)
        cos, sin = self.rotary(position_ids, x.dtype)
        attn = layer.self_attn
        q, k, v = attn.qkv(x, cos, sin)
        past = len(cache)
        k_all, v_all = cache.append(attn.expand_kv(k), attn.expand_kv(v))
        if attn_mask is None:
            t = input_ids.shape[1]
            attn_mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask)
        return self.output(layer.finish(attn.out(o), hidden))

    # ---- training forward, single step (the TTT trainer unrolls several) ---------------
    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, position_ids: torch.Tensor | None = None):
        """Causal forward over whole sequences from the target streams: (a, logits)."""
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        a = self.step(input_ids, self.fuse(aux), position_ids, KVCache())
        return a, self.logits(a)

    def num_parameters(self, exported_only: bool = True) -> int:
        """Weights, vocab maps excluded; ``exported_only`` counts what model.safetensors holds:
        the frozen embedding copy only when H != Ht (export ships it only then)."""
        skip = {"d2t", "t2d"}
        if exported_only and self.config.hidden_size == self.config.target_hidden_size:
            skip.add("embed_tokens.weight")
        return sum(v.numel() for k, v in self.state_dict().items() if k not in skip)
