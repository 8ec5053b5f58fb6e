"""A Llama-family decoder (Qwen2, Qwen3, Llama, Mistral, Phi-3; tied or untied embeddings, with or
without attention / MLP biases, fused or separate projections, sliding windows per layer; Qwen2-MoE
and Qwen3-MoE, whose sparse MLPs are `moe_block.py`'s; gpt-oss, whose attention sinks and biased
clamped-SwiGLU experts are `gpt_oss_block.py`'s) run over a pre-allocated per-slot KV cache.

The cache is one static buffer per layer, `KV: [2, slots, kv_heads, max_len, head_dim]`, allocated
once; a slot (row) holds one sequence from position 0, so every row has its own length and
no left padding is needed. The runner reads the weights of a `transformers` model (fusing q/k/v
and gate/up into one matrix each; `refresh()` re-reads them after a weight swap) and computes:

    h      = x + W_o · Attn(RoPE(W_q·n(x) + b_q), RoPE(W_k·n(x) + b_k), W_v·n(x) + b_v) + b_o
    x'     = h + W_down · (silu(W_gate·n(h) + b_g) ⊙ (W_up·n(h) + b_u)) + b_down     n = RMSNorm
    Attn   = softmax(q·Kᵀ/√d + M) · V,   M[i, j] = 0 if pos_i − w < j ≤ pos_i else −∞   (w: the layer's
             attention window, areal_core/architecture.py; ∞ for a full-attention layer)
    RoPE(x)_t = x_t·cos θ_t + rotate_half(x_t)·sin θ_t   (the model's own cos/sin table)

RoPE is one complex multiply: the q/k rows of W_qkv are permuted within each head so that the
pairs (x_i, x_{i+d/2}) are adjacent, z_i = x_i + i·x_{i+d/2}, and z_i·(cos θ_i + i·sin θ_i) is
exactly rotate-half RoPE. Attention only takes dot products q·k, which the shared permutation
leaves unchanged (v is not permuted), so the outputs equal the model's.

`prefill` runs whole (right-padded) sequences causally and writes their K/V into given rows;
`decode` runs one token per active row 0..n−1 at that row's position.

A mixture-of-experts layer replaces the MLP line by `moe_block.moe_mlp_into` (top-k routed
experts, grouped by expert over all the pass's tokens, plus Qwen2-MoE's gated shared expert);
dense layers between them (mlp_only_layers, decoder_sparse_step) keep the line above.

DeepSeek-V3 (multi-head latent attention) runs on `mla_decoder.MlaCacheDecoder` instead, with the
same interface; `build_decoder` picks the decoder of a model.

Anything else (another architecture, activation, layer type, a context-dependent or partial RoPE) is
refused by `check_supported` with an `UnsupportedModel` naming it; the torch engine, which runs
the model's own HF forward, serves those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_core.architecture import UnsupportedArchitecture, attention_windows
from areal_core.rollout.cache_ops import cached_attention, move_slots
from areal_core.rollout.gpt_oss_block import (
    GptOssMoe,
    gpt_oss_mlp_into,
    read_gpt_oss,
    sink_attention,
    unsupported_gpt_oss,
)
from areal_core.rollout.mla_decoder import MlaCacheDecoder, unsupported_mla
from areal_core.rollout.moe_block import MoeMlp, moe_mlp_into, read_moe, unsupported_moe

SUPPORTED = {"qwen2", "qwen3", "llama", "mistral", "phi3", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"}


class UnsupportedModel(ValueError):
    """The model is not a Llama-family decoder this runner implements."""


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor | None  # None: a sparse layer (`moe`)
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor | None
    b_down: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [H + KVH, d]: q_norm per query head, then k_norm per kv head
    moe: MoeMlp | GptOssMoe | None = None
    sinks: torch.Tensor | None = None  # [H]: gpt-oss's attention sinks (gpt_oss_block.py)


def check_supported(model: torch.nn.Module) -> None:
    """UnsupportedModel naming what this runner would compute differently from the model's own forward."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in SUPPORTED:
        arch = ",".join(getattr(cfg, "architectures", None) or [type(model).__name__])
        raise UnsupportedModel(
            f"continuous engine supports {sorted(SUPPORTED)} decoders, not {kind!r} ({arch}): "
            "use rollout.engine=torch (the model's own forward; rollout.engine=auto picks it) or vllm"
        )
    if kind == "deepseek_v3":  # MLA: mla_decoder.py, not this runner
        if why := unsupported_mla(model):
            raise UnsupportedModel(f"continuous engine: {why}")
        return
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"continuous engine needs hidden_act=silu, got {cfg.hidden_act!r}")
    try:
        attention_windows(cfg)
    except UnsupportedArchitecture as exc:
        raise UnsupportedModel(f"continuous engine: {exc}") from None
    rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    if rope in {"dynamic", "longrope"}:
        raise UnsupportedModel(f"continuous engine needs a position-only RoPE table, not {rope!r}")
    if float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise UnsupportedModel("continuous engine needs RoPE over the whole head (partial_rotary_factor 1)")
    moe = unsupported_gpt_oss(model) if kind == "gpt_oss" else unsupported_moe(model)
    if moe:
        raise UnsupportedModel(f"continuous engine: {moe}")


def _attention_weights(a: torch.nn.Module, q: int, kv: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """([W_q, W_k, W_v], their biases or None) of an attention block: separate projections, or
    Phi-3's fused qkv_proj (rows q | k | v)."""
    if hasattr(a, "qkv_proj"):
        w, b = a.qkv_proj.weight, a.qkv_proj.bias
        return list(w.split([q, kv, kv])), None if b is None else list(b.split([q, kv, kv]))
    ws = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
    return ws, None if a.q_proj.bias is None else [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]


def _mlp_weights(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W_gate|up, its bias or None): gate rows first, as Phi-3's fused gate_up_proj holds them."""
    if hasattr(m, "gate_up_proj"):
        return m.gate_up_proj.weight, m.gate_up_proj.bias
    bias = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])
    return torch.cat([m.gate_proj.weight, m.up_proj.weight]), bias


def _refreshed_moe(old: MoeMlp, new: MoeMlp) -> MoeMlp:
    """`new` (views of the swapped-in weights) with the shared expert's fused gate|up copied into
    `old`'s buffer: no reallocation per swap."""
    if old.shared_gate_up is not None:
        new.shared_gate_up = old.shared_gate_up.copy_(new.shared_gate_up)
    return new


def build_decoder(model: torch.nn.Module, slots: int, max_len: int) -> StaticCacheDecoder | MlaCacheDecoder:
    """The continuous engine's decoder of `model`: DeepSeek-V3's MLA one (mla_decoder.py) or this module's."""
    check_supported(model)
    if model.config.model_type == "deepseek_v3":
        return MlaCacheDecoder(model, slots, max_len)
    return StaticCacheDecoder(model, slots, max_len)


class StaticCacheDecoder:
    def __init__(self, model: torch.nn.Module, slots: int, max_len: int):
        check_supported(model)
        cfg = model.config
        self.model = model
        self.slots, self.max_len = slots, max_len
        self.on_route: Callable[[int, torch.Tensor], None] | None = None  # an MoE pass's experts per layer
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.windows = attention_windows(cfg)  # per layer: None (full causal) or the window
        self.scale = self.head_dim**-0.5
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (2, slots, self.n_kv, max_len, self.head_dim)
        n_layers = len(model.model.layers)
        self.kv = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(n_layers)]
        with torch.no_grad():
            pos = torch.arange(max_len, device=self.device)[None]
            cos, sin = model.model.rotary_emb(torch.zeros(1, device=self.device, dtype=self.dtype), pos)
        half = self.head_dim // 2
        # complex64/128 multiply for float32/64; bf16/fp16 use the same pairing with real arithmetic
        self.complex_rope = self.dtype in (torch.float32, torch.float64)
        if self.complex_rope:
            self.rot = torch.complex(cos[0, :, :half], sin[0, :, :half])  # [max_len, d/2]
        else:
            self.rot = torch.stack([cos[0, :, :half], sin[0, :, :half]], dim=-1)  # [max_len, d/2, 2]
        d = torch.arange(self.head_dim, device=self.device)
        self._perm = torch.stack([d[:half], d[half:]], dim=-1).reshape(-1)  # [0, d/2, 1, d/2+1, …]
        self.layers: list[_Layer] = []
        self.refresh()

    # -- weights ----------------------------------------------------------------------------
    def _permute_heads(self, w: torch.Tensor, heads: int) -> torch.Tensor:
        """Rows (or entries) of a [heads·d, …] projection reordered within each head by `_perm`."""
        return w.unflatten(0, (heads, self.head_dim))[:, self._perm].flatten(0, 1)

    def _qk_norm(self, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """[H + KVH, d]: the permuted q_norm weight for each query head, then k_norm for each kv head,
        so one normalisation covers q and k (`_qkv`)."""
        q, k = q_norm[self._perm], k_norm[self._perm]
        return torch.cat([q.expand(self.n_heads, -1), k.expand(self.n_kv, -1)]).contiguous()

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-read the model's weights into the fused matrices (after a weight swap)."""
        fresh = not self.layers
        H, KVH = self.n_heads, self.n_kv
        for i, blk in enumerate(self.model.model.layers):
            a, m = blk.self_attn, blk.mlp
            (wq, wk, wv), b = _attention_weights(a, H * self.head_dim, KVH * self.head_dim)
            qkv = torch.cat([self._permute_heads(wq, H), self._permute_heads(wk, KVH), wv])
            bias = None
            if b is not None:
                bias = torch.cat([self._permute_heads(b[0], H), self._permute_heads(b[1], KVH), b[2]])
            moe = read_gpt_oss(m, i) or read_moe(m, i)
            gate_up, gate_up_bias = (None, None) if moe else _mlp_weights(m)
            q_norm = getattr(getattr(a, "q_norm", None), "weight", None)
            k_norm = getattr(getattr(a, "k_norm", None), "weight", None)
            if fresh:
                self.layers.append(
                    _Layer(
                        ln1=blk.input_layernorm.weight,
                        ln2=blk.post_attention_layernorm.weight,
                        w_qkv=qkv,
                        b_qkv=bias,
                        w_o=a.o_proj.weight,
                        b_o=a.o_proj.bias,
                        w_gate_up=gate_up,
                        b_gate_up=gate_up_bias,
                        w_down=None if moe else m.down_proj.weight,
                        b_down=None if moe else m.down_proj.bias,
                        q_norm=None if q_norm is None else q_norm[self._perm].clone(),
                        k_norm=None if k_norm is None else k_norm[self._perm].clone(),
                        qk_norm=None if q_norm is None else self._qk_norm(q_norm, k_norm),
                        moe=moe,
                        sinks=getattr(a, "sinks", None),
                    )
                )
            else:  # copy into the existing buffers: no reallocation per swap
                L = self.layers[i]
                L.w_qkv.copy_(qkv)
                if moe is not None:
                    L.moe = _refreshed_moe(L.moe, moe)
                else:
                    L.w_gate_up.copy_(gate_up)
                if gate_up_bias is not None:
                    L.b_gate_up.copy_(gate_up_bias)
                if bias is not None:
                    L.b_qkv.copy_(bias)
                if q_norm is not None:
                    L.q_norm.copy_(q_norm[self._perm])
                    L.k_norm.copy_(k_norm[self._perm])
                    L.qk_norm.copy_(self._qk_norm(q_norm, k_norm))
        self.embed = self.model.model.embed_tokens.weight
        self.norm = self.model.model.norm.weight
        self.lm_head = self.model.lm_head.weight

    # -- pieces -----------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _qkv(self, L: _Layer, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """qkv [..., (H + 2·KVH)·d] with RoPE applied in place to q and k; `rot` [..., 1, d/2]
        (complex; [..., 1, d/2, 2] cos/sin for half precision) broadcasts over the heads."""
        H, KVH, D = self.n_heads, self.n_kv, self.head_dim
        qkv = F.linear(self._rms(x, L.ln1), L.w_qkv, L.b_qkv)
        qk = qkv[..., : (H + KVH) * D].unflatten(-1, (H + KVH, D))
        # Qwen3's per-head q/k RMSNorm: all q and k heads in one normalisation, then one weight multiply
        src = qk if L.qk_norm is None else F.rms_norm(qk, (D,), None, self.eps).mul_(L.qk_norm)
        pairs, src_pairs = qk.unflatten(-1, (D // 2, 2)), src.unflatten(-1, (D // 2, 2))
        if self.complex_rope:  # written into qkv's q|k columns
            torch.mul(torch.view_as_complex(src_pairs), rot, out=torch.view_as_complex(pairs))
        else:
            c, s = rot[..., 0], rot[..., 1]
            a, b = src_pairs[..., 0].clone(), src_pairs[..., 1].clone()
            pairs[..., 0] = a * c - b * s
            pairs[..., 1] = a * s + b * c
        return qkv

    def _mlp_into(self, L: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x + W_down·(silu(W_gate·n(x)) ⊙ W_up·n(x)), the residual folded into the GEMM; a sparse
        layer's routed (and shared) experts instead (`moe_block.moe_mlp_into`)."""
        if L.moe is not None:
            into = gpt_oss_mlp_into if isinstance(L.moe, GptOssMoe) else moe_mlp_into
            return into(L.moe, x, self._rms(x, L.ln2), self.on_route)
        g, u = F.linear(self._rms(x, L.ln2), L.w_gate_up, L.b_gate_up).chunk(2, dim=-1)
        out = torch.addmm(x, F.silu(g).mul_(u), L.w_down.t())
        return out if L.b_down is None else out.add_(L.b_down)

    def _attn_out_into(self, L: _Layer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """x + W_o·att + b_o, the residual folded into the GEMM."""
        out = torch.addmm(x, att, L.w_o.t())
        return out if L.b_o is None else out.add_(L.b_o)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(h, self.norm), self.lm_head)

    # -- passes -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, rows: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Causal pass over right-padded `ids [r, P]` (true lengths `lens [r]`), writing K/V into
        cache rows `rows [r]` at positions 0..P−1; returns the last real position's logits [r, V]."""
        r, P = ids.shape
        H, KVH, D = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(ids, self.embed).flatten(0, 1)  # [r·P, hidden]
        rot = self.rot[:P, None].repeat(r, *[1] * self.rot.dim())  # [r·P, 1, d/2(, 2)]
        q_at = torch.arange(P, device=x.device)
        causal = q_at[None, :] <= q_at[:, None]
        near = {w: causal & (q_at[:, None] - q_at[None, :] < w) for w in set(self.windows) if w}
        for i, L in enumerate(self.layers):
            qkv = self._qkv(L, x, rot).view(r, P, H + 2 * KVH, D).transpose(1, 2)  # [r, heads, P, d]
            q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
            self.kv[i][0, rows, :, :P] = k
            self.kv[i][1, rows, :, :P] = v
            w = self.windows[i]
            if L.sinks is not None:
                att = sink_attention(q, k, v, near[w] if w and w < P else causal, L.sinks, self.scale)
            elif w and w < P:  # key k visible from query q iff q − w < k ≤ q
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=near[w], scale=self.scale, enable_gqa=True)
            else:
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            x = self._attn_out_into(L, x, att.transpose(1, 2).reshape(r * P, H * D))
            x = self._mlp_into(L, x)
        last = x.view(r, P, -1)[torch.arange(r, device=x.device), lens - 1]
        return self.logits(last)

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One token per row 0..n−1 (`ids [n]` at positions `pos [n]`), attending to cache
        positions 0..pos_i; `span` ≥ max(pos)+1 bounds the keys read. Returns logits [n, V].

        Attention is two batched matmuls over (row, kv head) with the G = H/KVH query heads of
        a group as the rows of one small matrix: S = α·q·Kᵀ + M, O = softmax(S)·V, with
        M = 0 where key j ≤ pos_i and −∞ after."""
        n = ids.shape[0]
        H, KVH, D = self.n_heads, self.n_kv, self.head_dim
        G = H // KVH
        dev = ids.device
        x = F.embedding(ids, self.embed)
        rot = self.rot[pos][:, None]
        keys_at = torch.arange(span, device=dev)[None, None, :]
        biases = {}
        for w in set(self.windows):  # M = 0 where pos_i − w < j ≤ pos_i (no lower bound without a window)
            hidden = keys_at > pos[:, None, None]
            if w:
                hidden |= keys_at <= pos[:, None, None] - w
            bias = torch.zeros(n, 1, span, device=dev, dtype=x.dtype).masked_fill_(hidden, float("-inf"))
            biases[w] = bias.expand(n, KVH, span).reshape(n * KVH, 1, span)
        # row of (k|v, row i, kv head h, position pos_i) in a cache viewed as [2·S·KVH·max_len, d],
        # ordered like the k and v heads in qkv[:, H·d:]
        plane = self.slots * KVH * self.max_len
        heads = torch.arange(2 * KVH, device=dev)
        cell = (heads // KVH) * plane + (heads % KVH) * self.max_len
        flat = (torch.arange(n, device=dev)[:, None] * (KVH * self.max_len) + pos[:, None] + cell[None, :]).reshape(-1)
        for i, L in enumerate(self.layers):
            qkv = self._qkv(L, x, rot)
            cache = self.kv[i]
            cache.view(-1, D).index_copy_(0, flat, qkv[:, H * D :].reshape(-1, D))
            keys = cache[0, :n, :, :span].reshape(n * KVH, span, D)
            vals = cache[1, :n, :, :span].reshape(n * KVH, span, D)
            q = qkv[:, : H * D].reshape(n * KVH, G, D)
            att = cached_attention(q, keys, vals, biases[self.windows[i]], self.scale, L.sinks)  # [n·KVH, G, d]
            x = self._attn_out_into(L, x, att.view(n, H * D))
            x = self._mlp_into(L, x)
        return self.logits(x)

    def move_rows(self, src: list[int], dst: list[int], span: int) -> None:
        """Copy cache rows src → dst (positions < span): compaction after sequences finish."""
        move_slots(self.kv, src, dst, span, slot_dim=1)
