"""A Llama-family decoder (Qwen2, Qwen3, Llama, Mistral) run over a pre-allocated per-slot KV cache.

The cache is one static buffer per layer, `K, V: [slots, kv_heads, max_len, head_dim]`, allocated
once; a slot (row) holds one sequence from position 0, so every row has its own length and
no left padding is needed. The runner reads the weights of a `transformers` model (fusing q/k/v
and gate/up into one matrix each; `refresh()` re-reads them after a weight swap) and computes:

    h      = x + W_o · Attn(RoPE(W_q·n(x)), RoPE(W_k·n(x)), W_v·n(x))     n = RMSNorm
    x'     = h + W_down · (silu(W_gate·n(h)) ⊙ W_up·n(h))
    Attn   = softmax(q·Kᵀ/√d + M) · V,   M[i, j] = 0 if j ≤ pos_i else −∞   (decode, per row)
    RoPE(x)_t = x_t·cos θ_t + rotate_half(x_t)·sin θ_t   (the model's own cos/sin table)

`prefill` runs whole (right-padded) sequences causally and writes their K/V into given rows;
`decode` runs one token per active row 0..n−1 at that row's position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = {"qwen2", "qwen3", "llama", "mistral"}


class UnsupportedModel(ValueError):
    """The model is not a Llama-family decoder this runner implements."""


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def check_supported(model: torch.nn.Module) -> None:
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in SUPPORTED:
        raise UnsupportedModel(f"continuous engine supports {sorted(SUPPORTED)} decoders, not {kind!r}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"continuous engine needs hidden_act=silu, got {cfg.hidden_act!r}")
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise UnsupportedModel("continuous engine does not implement sliding-window attention")
    rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    if rope in {"dynamic", "longrope"}:
        raise UnsupportedModel(f"continuous engine needs a position-only RoPE table, not {rope!r}")


class StaticCacheDecoder:
    def __init__(self, model: torch.nn.Module, slots: int, max_len: int):
        check_supported(model)
        cfg = model.config
        self.model = model
        self.slots, self.max_len = slots, max_len
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (slots, self.n_kv, max_len, self.head_dim)
        n_layers = len(model.model.layers)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(n_layers)]
        with torch.no_grad():
            pos = torch.arange(max_len, device=self.device)[None]
            cos, sin = model.model.rotary_emb(torch.zeros(1, device=self.device, dtype=self.dtype), pos)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim]
        self.layers: list[_Layer] = []
        self.refresh()

    # -- weights ----------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> None:
        """Re-read the model's weights into the fused matrices (after a weight swap)."""
        fresh = not self.layers
        for i, blk in enumerate(self.model.model.layers):
            a, m = blk.self_attn, blk.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            bias = None
            if a.q_proj.bias is not None:
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            if fresh:
                self.layers.append(
                    _Layer(
                        ln1=blk.input_layernorm.weight,
                        ln2=blk.post_attention_layernorm.weight,
                        w_qkv=qkv,
                        b_qkv=bias,
                        w_o=a.o_proj.weight,
                        w_gate_up=gate_up,
                        w_down=m.down_proj.weight,
                        q_norm=getattr(getattr(a, "q_norm", None), "weight", None),
                        k_norm=getattr(getattr(a, "k_norm", None), "weight", None),
                    )
                )
            else:  # copy into the existing buffers: no reallocation per swap
                L = self.layers[i]
                L.w_qkv.copy_(qkv)
                L.w_gate_up.copy_(gate_up)
                if bias is not None:
                    L.b_qkv.copy_(bias)
        self.embed = self.model.model.embed_tokens.weight
        self.norm = self.model.model.norm.weight
        self.lm_head = self.model.lm_head.weight

    # -- pieces -----------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _qkv(self, L: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., H, D], k and v [..., KVH, D] with RoPE applied; cos/sin broadcast over heads."""
        h = self._rms(x, L.ln1)
        qkv = F.linear(h, L.w_qkv, L.b_qkv)
        H, KVH, D = self.n_heads, self.n_kv, self.head_dim
        qk = qkv[..., : (H + KVH) * D].unflatten(-1, (H + KVH, D))
        v = qkv[..., (H + KVH) * D :].unflatten(-1, (KVH, D))
        if L.q_norm is not None:
            qk = torch.cat([self._rms(qk[..., :H, :], L.q_norm), self._rms(qk[..., H:, :], L.k_norm)], -2)
        x1, x2 = qk.chunk(2, dim=-1)
        qk = qk * cos + torch.cat((-x2, x1), dim=-1) * sin
        return qk[..., :H, :], qk[..., H:, :], v

    def _mlp(self, L: _Layer, x: torch.Tensor) -> torch.Tensor:
        gu = F.linear(self._rms(x, L.ln2), L.w_gate_up)
        g, u = gu.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, L.w_down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(h, self.norm), self.lm_head)

    # -- passes -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, rows: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Causal pass over right-padded `ids [r, P]` (true lengths `lens [r]`), writing K/V into
        cache rows `rows [r]` at positions 0..P−1; returns the last real position's logits [r, V]."""
        r, P = ids.shape
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[:P, None, :], self.sin[:P, None, :]
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)  # [r, P, heads, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            self.k[i][rows, :, :P] = k
            self.v[i][rows, :, :P] = v
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            x = x + F.linear(att.transpose(1, 2).flatten(2), L.w_o)
            x = x + self._mlp(L, x)
        last = x[torch.arange(r, device=x.device), lens - 1]
        return self.logits(last)

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One token per row 0..n−1 (`ids [n]` at positions `pos [n]`), attending to cache
        positions 0..pos_i; `span` ≥ max(pos)+1 bounds the keys read. Returns logits [n, V].

        Attention is two batched matmuls over (row, kv head) with the G = H/KVH query heads of
        a group as the rows of one small matrix: S = α·q·Kᵀ + M, O = softmax(S)·V."""
        n = ids.shape[0]
        H, KVH, D = self.n_heads, self.n_kv, self.head_dim
        G = H // KVH
        dev = ids.device
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        # additive mask, shared by all layers: 0 where key j ≤ pos_i, −∞ after
        bias = torch.zeros(n, 1, span, device=dev, dtype=x.dtype)
        bias.masked_fill_(torch.arange(span, device=dev)[None, None, :] > pos[:, None, None], float("-inf"))
        bias = bias.expand(n, KVH, span).reshape(n * KVH, 1, span)
        # flat row index of (row i, kv head h, position pos_i) in a cache viewed as [S·KVH·max_len, D]
        rows = torch.arange(n, device=dev)[:, None] * KVH + torch.arange(KVH, device=dev)[None, :]
        flat = (rows * self.max_len + pos[:, None]).reshape(-1)
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, x, cos, sin)  # q [n, H, D]; k, v [n, KVH, D]
            kc, vc = self.k[i], self.v[i]
            kc.view(-1, D).index_copy_(0, flat, k.reshape(-1, D))
            vc.view(-1, D).index_copy_(0, flat, v.reshape(-1, D))
            keys = kc[:n, :, :span].reshape(n * KVH, span, D)
            vals = vc[:n, :, :span].reshape(n * KVH, span, D)
            scores = torch.baddbmm(bias, q.reshape(n * KVH, G, D), keys.transpose(1, 2), alpha=self.scale)
            att = torch.bmm(torch.softmax(scores, dim=-1), vals)  # [n·KVH, G, D]
            x = x + F.linear(att.reshape(n, H * D), L.w_o)
            x = x + self._mlp(L, x)
        return self.logits(x)

    @torch.no_grad()
    def move_rows(self, src: list[int], dst: list[int], span: int) -> None:
        """Copy cache rows src → dst (positions < span): compaction after sequences finish."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for kc, vc in zip(self.k, self.v):
            kc[d, :, :span] = kc[s, :, :span]
            vc[d, :, :span] = vc[s, :, :span]
