"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM) over the continuous engine's per-slot static
cache: multi-head latent attention (MLA), dense first layers, and the sparse blocks of
`deepseek_moe.py`. The same interface as `static_cache.StaticCacheDecoder` (prefill, decode,
move_rows, refresh, on_route), which builds this one for a "deepseek_v3" model.

Per layer, for the tokens x of a pass (n = RMSNorm with the module's own weight and ε):

    h       = n(x)
    q       = W_qb · n_q(W_qa·h + b_qa)            (or W_q · h without q_lora_rank)   → H heads of [nope | rope]
    c, k_r  = W_kva · h + b_kva                    (c: kv_lora_rank latent, k_r: one rope part shared by the heads)
    k_n | v = W_kvb · n_kv(c)                      → H heads of [nope | v_head_dim]
    k       = [k_n | RoPE(k_r)],  q = [q_n | RoPE(q_r)]
    x'      = x + W_o · softmax(α · q·kᵀ + M) · v + b_o,   M = 0 for key j ≤ pos_i, −∞ after
    x''     = x' + MLP(n(x'))     (a gated SiLU MLP for the first_k_dense_replace layers, else deepseek_moe)

α is the attention module's own `scaling`: (nope + rope)^−½, times mscale² where YaRN's
mscale_all_dim is set (transformers' yarn_apply_mscale); the RoPE cos/sin table is the model's
own rotary embedding (YaRN's attention factor included), applied as transformers applies it:
rotate-half, or DeepSeek's interleaved pairs (rope_interleave), whose output is de-interleaved
for q and k alike (dot products unchanged, as in transformers).

The cache holds the decompressed per-head keys and values, each in its own buffer because the key
width (nope + rope) and v_head_dim may differ: K [slots, H, max_len, nope + rope] and
V [slots, H, max_len, v_head_dim] per layer. That is exact (the same products as transformers'
forward); caching the latent (kv_lora_rank + rope per token, shared by the heads) and absorbing
W_kvb into q and W_o would store less but reorders the sums. The price is memory: at DeepSeek-V3's
full size (128 heads, 192 + 128 wide, 61 layers) a token takes 128·320·61·2 B ≈ 5 MB of cache in
bfloat16, against 576·61·2 B ≈ 70 kB for the latent, so this decoder suits small MLA models; a
671B checkpoint needs the latent cache (vLLM/SGLang's MLA kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_core.rollout.cache_ops import cached_attention, move_slots
from areal_core.rollout.deepseek_moe import DeepseekMoe, deepseek_moe_into, read_deepseek_moe, unsupported_deepseek_moe


@dataclass
class MlaLayer:
    """One decoder layer's weights: views of the model's parameters, but for the fused copies
    `w_a` (q_a | kv_a rows, or q | kv_a) and `w_gate_up`, refilled in place by `refresh`."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    w_a: torch.Tensor
    b_a: torch.Tensor | None
    q_a_norm: torch.Tensor | None  # None: no q_lora_rank (q comes straight from w_a)
    w_q_b: torch.Tensor | None
    kv_a_norm: torch.Tensor
    w_kv_b: torch.Tensor
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor | None  # None: a sparse layer (`moe`)
    w_down: torch.Tensor | None
    moe: DeepseekMoe | None = None


def unsupported_mla(model: torch.nn.Module) -> str | None:
    """What MlaCacheDecoder would compute differently from the model's own forward (None: nothing)."""
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"needs hidden_act=silu, got {cfg.hidden_act!r}"
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        return "needs num_key_value_heads == num_attention_heads (MLA decompresses a key and value per head)"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope in {"dynamic", "longrope"}:
        return f"needs a position-only RoPE table, not {rope!r}"
    if getattr(cfg, "sliding_window", None):
        return "runs full causal attention, not a sliding window"
    return unsupported_deepseek_moe(model)


def _linear_bias(m: torch.nn.Module) -> torch.Tensor:
    return m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])


def _fused(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """`new`, copied into the buffer `old` read before a weight swap (no reallocation per swap)."""
    return new if old is None else old.copy_(new)


def read_mla_layer(blk: torch.nn.Module, old: MlaLayer | None, index: int) -> MlaLayer:
    """Decoder layer `index`'s weights; `old` (before a swap) gives the fused buffers to refill."""
    a, m = blk.self_attn, blk.mlp
    first = a.q_a_proj if a.q_proj is None else a.q_proj
    w_a = torch.cat([first.weight, a.kv_a_proj_with_mqa.weight])
    b_a = None
    if first.bias is not None or a.kv_a_proj_with_mqa.bias is not None:
        b_a = torch.cat([_linear_bias(first), _linear_bias(a.kv_a_proj_with_mqa)])
    moe = read_deepseek_moe(m, index, None if old is None else old.moe)
    gate_up = None if moe else torch.cat([m.gate_proj.weight, m.up_proj.weight])
    return MlaLayer(
        ln1=blk.input_layernorm.weight,
        ln2=blk.post_attention_layernorm.weight,
        w_a=_fused(None if old is None else old.w_a, w_a),
        b_a=b_a if old is None or b_a is None else old.b_a.copy_(b_a),
        q_a_norm=None if a.q_proj is not None else a.q_a_layernorm.weight,
        w_q_b=None if a.q_proj is not None else a.q_b_proj.weight,
        kv_a_norm=a.kv_a_layernorm.weight,
        w_kv_b=a.kv_b_proj.weight,
        w_o=a.o_proj.weight,
        b_o=a.o_proj.bias,
        w_gate_up=None if moe else _fused(None if old is None else old.w_gate_up, gate_up),
        w_down=None if moe else m.down_proj.weight,
        moe=moe,
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """transformers' RoPE of x [..., R] with cos/sin [..., R] (cat(freqs, freqs), broadcast over heads):
    x·cos + rotate_half(x)·sin, or for interleaved pairs (x_{2i}, x_{2i+1}) rotated by angle i,
    [x_even·c − x_odd·s | x_odd·c + x_even·s] with c, s the first R/2 entries."""
    if interleave:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MlaCacheDecoder:
    """DeepSeek-V3 over a static per-slot K/V cache (module docstring)."""

    def __init__(self, model: torch.nn.Module, slots: int, max_len: int):
        cfg = model.config
        self.model = model
        self.slots, self.max_len = slots, max_len
        self.on_route: Callable[[int, torch.Tensor], None] | None = None  # an MoE pass's experts per layer
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.interleave = bool(getattr(cfg, "rope_interleave", False))
        blocks = model.model.layers
        attn = blocks[0].self_attn
        self.scale = float(attn.scaling)
        self.eps = float(blocks[0].input_layernorm.variance_epsilon)
        self.kv_eps = float(attn.kv_a_layernorm.variance_epsilon)
        self.q_eps = float(attn.q_a_layernorm.variance_epsilon) if attn.q_proj is None else 0.0
        self.q_width = attn.q_a_proj.out_features if attn.q_proj is None else attn.q_proj.out_features
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        kd = self.nope + self.rope_dim
        self.k_cache = [self._zeros(slots, self.n_heads, max_len, kd) for _ in blocks]
        self.v_cache = [self._zeros(slots, self.n_heads, max_len, self.v_dim) for _ in blocks]
        with torch.no_grad():
            pos = torch.arange(max_len, device=self.device)[None]
            cos, sin = model.model.rotary_emb(self._zeros(1), pos)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, rope]
        self.layers: list[MlaLayer] = []
        self.refresh()

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-read the model's weights (after a weight swap): views, and the fused copies refilled."""
        old = self.layers or [None] * len(self.model.model.layers)
        self.layers = [read_mla_layer(blk, o, i) for i, (blk, o) in enumerate(zip(self.model.model.layers, old))]
        self.embed = self.model.model.embed_tokens.weight
        self.norm = self.model.model.norm.weight
        self.lm_head = self.model.lm_head.weight

    # -- pieces -----------------------------------------------------------------------------
    def _qkv(self, L: MlaLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q [T, H, nope+rope], k [T, H, nope+rope], v [T, H, v_dim]) of tokens x [T, hidden] at the
        positions whose cos/sin [T, rope] are given."""
        H, nope = self.n_heads, self.nope
        a = F.linear(F.rms_norm(x, (x.shape[-1],), L.ln1, self.eps), L.w_a, L.b_a)
        q, latent, k_rot = a.split([self.q_width, self.kv_rank, self.rope_dim], dim=-1)
        if L.w_q_b is not None:
            q = F.linear(F.rms_norm(q, (q.shape[-1],), L.q_a_norm, self.q_eps), L.w_q_b)
        q = q.unflatten(-1, (H, nope + self.rope_dim))
        kv = F.linear(F.rms_norm(latent, (self.kv_rank,), L.kv_a_norm, self.kv_eps), L.w_kv_b)
        kv = kv.unflatten(-1, (H, nope + self.v_dim))
        rot = rope(torch.cat([q[..., nope:], k_rot[:, None]], dim=1), cos[:, None], sin[:, None], self.interleave)
        q = torch.cat([q[..., :nope], rot[:, :H]], dim=-1)
        k = torch.cat([kv[..., :nope], rot[:, H:].expand(-1, H, -1)], dim=-1)
        return q, k, kv[..., nope:]

    def _mlp_into(self, L: MlaLayer, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x, (x.shape[-1],), L.ln2, self.eps)
        if L.moe is not None:
            return deepseek_moe_into(L.moe, x, normed, self.on_route)
        g, u = F.linear(normed, L.w_gate_up).chunk(2, dim=-1)
        return torch.addmm(x, F.silu(g).mul_(u), L.w_down.t())

    def _attn_out_into(self, L: MlaLayer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(x, att, L.w_o.t())
        return out if L.b_o is None else out.add_(L.b_o)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(h, (h.shape[-1],), self.norm, self.eps), self.lm_head)

    # -- passes -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, rows: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Causal pass over right-padded `ids [r, P]` (true lengths `lens [r]`), writing K/V into
        cache rows `rows [r]` at positions 0..P−1; returns the last real position's logits [r, V]."""
        r, P = ids.shape
        H = self.n_heads
        x = F.embedding(ids, self.embed).flatten(0, 1)  # [r·P, hidden]
        cos, sin = self.cos[:P].repeat(r, 1), self.sin[:P].repeat(r, 1)
        for i, L in enumerate(self.layers):
            q, k, v = (t.view(r, P, H, -1).transpose(1, 2) for t in self._qkv(L, x, cos, sin))  # [r, H, P, d]
            self.k_cache[i][rows, :, :P] = k
            self.v_cache[i][rows, :, :P] = v
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [r, H, P, v_dim]
            x = self._attn_out_into(L, x, att.transpose(1, 2).reshape(r * P, H * self.v_dim))
            x = self._mlp_into(L, x)
        last = x.view(r, P, -1)[torch.arange(r, device=x.device), lens - 1]
        return self.logits(last)

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One token per row 0..n−1 (`ids [n]` at positions `pos [n]`), attending to cache
        positions 0..pos_i; `span` ≥ max(pos)+1 bounds the keys read. Returns logits [n, V].

        Attention is two batched matmuls over (row, head): S = α·q·Kᵀ + M, O = softmax(S)·V."""
        n, H = ids.shape[0], self.n_heads
        # (row i, head h, position pos_i) of a cache viewed as [slots·H·max_len, d]
        row_head = torch.arange(n * H, device=ids.device).view(n, H)
        flat = (row_head * self.max_len + pos[:, None]).reshape(-1)
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos], self.sin[pos]
        later = torch.arange(span, device=ids.device)[None, None, :] > pos[:, None, None]
        bias = torch.zeros(n, 1, span, device=ids.device, dtype=x.dtype).masked_fill_(later, float("-inf"))
        bias = bias.expand(n, H, span).reshape(n * H, 1, span)
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)
            self.k_cache[i].view(-1, k.shape[-1]).index_copy_(0, flat, k.reshape(n * H, -1))
            self.v_cache[i].view(-1, v.shape[-1]).index_copy_(0, flat, v.reshape(n * H, -1))
            keys = self.k_cache[i][:n, :, :span].reshape(n * H, span, -1)
            vals = self.v_cache[i][:n, :, :span].reshape(n * H, span, -1)
            att = cached_attention(q.reshape(n * H, 1, -1), keys, vals, bias, self.scale)  # [n·H, 1, v_dim]
            x = self._attn_out_into(L, x, att.view(n, H * self.v_dim))
            x = self._mlp_into(L, x)
        return self.logits(x)

    def move_rows(self, src: list[int], dst: list[int], span: int) -> None:
        """Copy cache rows src → dst (positions < span): compaction after sequences finish."""
        move_slots([*self.k_cache, *self.v_cache], src, dst, span, slot_dim=0)
