"""Sequence packing for the trainer's forward passes (π_θ, π_prox, reference).

Right-padded rows [N, T] are unpadded and concatenated into a few packed rows [R, L]; each
sequence gets position ids restarting at 0, and attention never crosses a sequence boundary.
Two ways to tell the model about the boundaries (HF Qwen2, transformers ≥ 5):

  "position_ids"  pass position_ids and attention_mask=None; transformers detects the restarts
                  (`find_packed_sequence_indices`) and builds a block-diagonal causal mask for
                  'sdpa'/'eager', or uses varlen kernels with 'flash_attention_2'.
  "mask4d"        pass an explicit additive 4D block-diagonal causal mask [R, 1, L, L] plus the
                  position ids (works with 'sdpa' and 'eager' on any version honouring 4D masks).

Unused tail positions of a packed row hold a filler segment (pad tokens, own positions), which
nothing attends to and whose outputs are dropped. `packed_token_logprobs` returns the same
[N, T] layout as `areal_core.train.logprobs.token_logprobs`.

Groups share their prompt: with `group_index`, each group becomes one row holding the group's
longest common prefix once, then every member's own suffix (`pack_groups`), under a tree mask
(a suffix attends to the prefix and to itself, causally). The hidden state of a token depends
only on the tokens before it, so this is the same computation with the prefix done once: for
8 samples of a ~25-token prompt and ~15 response tokens, 145 instead of 320 tokens per group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from dataclasses import dataclass

import torch

from areal_core.architecture import attention_masks, window_allowed
from areal_core.train.entropy import entropy_from_logits
from areal_core.train.head import LogitHead, chunked_logprobs, hidden_states
from areal_core.train.segment_attention import PLAN_KWARG, SpanPlan, base_model, spans_active, use_segments

log = logging.getLogger("areal.train")

ATTENTION_MODES = ("auto", "segments", "mask")
MAX_MASK_ROW = 1024  # auto: packed rows up to this many tokens attend under a 4D mask, longer ones per span


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) whose lengths sum to ≤ capacity; an item longer than the
    capacity gets a bin of its own. Items are placed longest first into the first bin that fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def micro_batches_by_tokens(lengths: list[int] | torch.Tensor, token_budget: int) -> list[list[int]]:
    """Split sequence indices into micro-batches of ≤ `token_budget` real tokens each (first-fit
    decreasing, so micro-batches are few and balanced); ≤ 0 puts everything in one micro-batch."""
    lengths = [int(x) for x in lengths]
    if token_budget <= 0:
        return [list(range(len(lengths)))]
    return [sorted(b) for b in first_fit_decreasing(lengths, token_budget)]


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L], restarting at 0 for every sequence (and the filler)
    segment_ids: torch.Tensor  # [R, L], −1 on filler
    src: torch.Tensor  # flat indices into [R·L] of the real tokens …
    dst: torch.Tensor  # … and where they go in the padded [N·T] layout
    shape: tuple[int, int]  # (N, T) of the padded batch

    def attention_mask_4d(self, dtype: torch.dtype = torch.float32, window: int | None = None) -> torch.Tensor:
        """Additive mask [R, 1, L, L]: 0 where key ≤ query in the same segment (and, with a
        `window`, fewer than `window` positions back), else dtype min."""
        seg = self.segment_ids
        L = seg.shape[1]
        same = seg[:, :, None] == seg[:, None, :]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        allowed = same & causal & window_allowed(self.position_ids, window)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[:, None]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, row_len: int = 0, pad_id: int = 0) -> PackedRows:
    """Pack right-padded rows into rows of ≤ `row_len` tokens (0: the longest sequence)."""
    n, t = input_ids.shape
    lengths = attention_mask.long().sum(1).tolist()
    cap = max(row_len, max(lengths, default=1), 1)
    bins = first_fit_decreasing(lengths, cap)
    width = max(sum(lengths[i] for i in b) for b in bins)
    ids = torch.full((len(bins), width), pad_id, dtype=input_ids.dtype)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    seg = torch.full((len(bins), width), -1, dtype=torch.long)
    src, dst = [], []
    for r, b in enumerate(bins):
        start = 0
        for i in b:
            k = lengths[i]
            ids[r, start : start + k] = input_ids[i, :k]
            pos[r, start : start + k] = torch.arange(k)
            seg[r, start : start + k] = i
            src.append(torch.arange(start, start + k) + r * width)
            dst.append(torch.arange(k) + i * t)
            start += k
        pos[r, start:] = torch.arange(width - start)
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return PackedRows(ids, pos, seg, cat(src), cat(dst), (n, t))


def packed_logits(model, packed: PackedRows, mode: str = "position_ids") -> torch.Tensor:
    """Logits [R, L, V] of the packed rows, sequences isolated from one another."""
    return _forward(model, packed, mode, segments=False, hidden=False)


def _forward(model, rows: PackedRows | TreeRows, mode: str, segments: bool, hidden: bool) -> torch.Tensor:
    """Logits [R, L, V] (or the final hidden states, `hidden`) of packed or tree rows. Sequences are
    isolated by `mode` ("position_ids": transformers' own packed-sequence detection; "mask4d": our
    4D masks; tree rows always take their tree mask) or, with `segments`, by the span plan of
    segment_attention.py (no [L, L] mask at all)."""
    if mode not in ("position_ids", "mask4d"):
        raise ValueError(f"unknown packing mode {mode!r}; expected 'position_ids' or 'mask4d'")
    dev = model.device if hasattr(model, "device") else rows.input_ids.device
    inputs = {"input_ids": rows.input_ids.to(dev), "position_ids": rows.position_ids.to(dev), "attention_mask": None}
    scope = contextlib.nullcontext()
    if segments:
        prefix = PREFIX_SEGMENT if isinstance(rows, TreeRows) else None
        inputs[PLAN_KWARG] = SpanPlan.from_segments(rows.segment_ids, prefix)
        scope = spans_active()
    elif isinstance(rows, TreeRows) or mode == "mask4d":
        inputs["attention_mask"] = _masks(model, rows, dev)
    with scope:
        if hidden:
            return hidden_states(model, **inputs)
        return model(**inputs, use_cache=False).logits


def _packed_chunked(
    model, packed: PackedRows, mode: str, head, temperature: float, chunk: int, entropy: bool, segments: bool
):
    """(lp [R, L−1], entropy [R, L−1] or None) of packed rows, the head applied in chunks."""
    ids = packed.input_ids
    hid = _forward(model, packed, mode, segments, hidden=True)
    r, length = ids.shape
    flat = hid[:, :-1].reshape(-1, hid.shape[-1])
    out = chunked_logprobs(head, flat, ids[:, 1:].reshape(-1).to(flat.device), temperature, chunk, entropy)
    if not entropy:
        return out.view(r, length - 1), None
    return out[0].view(r, length - 1), out[1].view(r, length - 1)


def wants_segments(model, input_ids: torch.Tensor, attention: str, row_tokens: int) -> bool:
    """Whether rows of `row_tokens` attend per span (segment_attention.py) rather than under a 4D
    mask: `attention` "segments" always (a model that cannot is an error), "auto" past
    `MAX_MASK_ROW` tokens where the model can, "mask" never."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"unknown packed attention {attention!r}; expected one of {ATTENTION_MODES}")
    if attention == "mask" or (attention == "auto" and row_tokens <= MAX_MASK_ROW):
        return False
    able = use_segments(model) and segments_agree(model, input_ids)
    if attention == "segments" and not able:
        raise ValueError(
            f"train.packed_attention=segments: {type(model).__name__} cannot attend per span (it runs "
            f"{getattr(model.config, '_attn_implementation', '?')} attention, or differs from its masks; see the log)"
        )
    return able


def _masks(model, rows: PackedRows | TreeRows, dev: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D mask(s) of `rows` for `model`, each layer's attention window included
    (areal_core/architecture.py): one tensor, or one per layer type for models mixing windows."""
    dtype = next(model.parameters()).dtype
    config = model.config if hasattr(model, "config") else model.module.config
    return attention_masks(config, lambda window: rows.attention_mask_4d(dtype, window).to(dev))


def unpack(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Per-position values [R, L] (value at p for predicting token p) -> padded [N, T], 0 at t = 0
    of every sequence and on padding. Differentiable."""
    n, t = packed.shape
    flat = values.reshape(-1)
    src, dst = packed.src.to(flat.device), packed.dst.to(flat.device)
    starts = packed.position_ids.reshape(-1).to(flat.device)[src] == 0
    src, dst = src[~starts], dst[~starts]
    out = torch.zeros(n * t, dtype=flat.dtype, device=flat.device)
    return out.index_put((dst,), flat[src]).view(n, t)


def packed_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    token_budget: int = 0,
    row_len: int = 0,
    pad_id: int = 0,
    mode: str = "position_ids",
    with_entropy: bool = False,
    group_index: torch.Tensor | None = None,
    logit_chunk: int = 0,
    attention: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Packed equivalent of `token_logprobs`: logp[:, t] = log π(x_t | x_<t), 0 at t = 0 and on padding.

    Sequences are split into micro-batches of ≤ `token_budget` tokens (0: one forward pass), each
    packed into rows of ≤ `row_len` tokens (0: the micro-batch's longest sequence, which keeps
    dense-mask attention no dearer than padding; use `row_len = token_budget` for a single row
    with varlen flash attention). With `with_entropy`, also returns the entropy [N, T].
    Gradients flow to the model when called outside `torch.no_grad()`. With `group_index` [N] (and
    no budget or row length), each group's common prefix is computed once (`pack_groups`) unless
    a group's row would exceed `MAX_TREE_ROW` tokens under a mask. `logit_chunk` > 0: the LM head
    applied that many tokens at a time from the final hidden states (train/head.py), never all
    logits at once. `attention` (`wants_segments`): rows past `MAX_MASK_ROW` tokens attend per
    span, without an [L, L] mask, where the model can ("auto"); then trees have no length limit.
    """
    head = LogitHead.for_model(model, input_ids, logit_chunk)
    if group_index is not None and token_budget <= 0 and row_len <= 0:
        tree = pack_groups(input_ids.cpu(), attention_mask.cpu(), group_index.cpu(), pad_id)
        width = tree.input_ids.shape[1]
        if width <= MAX_TREE_ROW or attention == "segments" or tree_saving(tree, attention_mask) >= MIN_TREE_SAVING:
            segments = wants_segments(model, input_ids, attention, width)
            if segments or width <= MAX_TREE_ROW:
                return tree_token_logprobs(model, tree, temperature, with_entropy, head, logit_chunk, segments)
    n, t = input_ids.shape
    dev = input_ids.device
    logp = torch.zeros(n, t, device=dev)
    ent = torch.zeros(n, t, device=dev) if with_entropy else None
    lengths = attention_mask.long().sum(1)
    for rows in micro_batches_by_tokens(lengths, token_budget):
        idx = torch.tensor(rows, device=dev)
        sub_t = int(lengths[idx].max())
        packed = pack(input_ids[idx, :sub_t].cpu(), attention_mask[idx, :sub_t].cpu(), row_len, pad_id)
        segments = wants_segments(model, input_ids, attention, packed.input_ids.shape[1])
        if head is not None:
            lp, h = _packed_chunked(model, packed, mode, head, temperature, logit_chunk, with_entropy, segments)
        else:
            logits = _forward(model, packed, mode, segments, hidden=False)
            z = logits[:, :-1].float()
            if temperature != 1.0:
                z = z / temperature
            target = packed.input_ids[:, 1:].to(z.device)
            lp = z.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
            h = entropy_from_logits(z) if ent is not None else None
        lp = torch.nn.functional.pad(lp, (1, 0))
        sub = torch.nn.functional.pad(unpack(lp, packed), (0, t - sub_t))
        logp = logp.index_put((idx,), sub.to(dev))
        if ent is not None:
            h = torch.nn.functional.pad(h, (1, 0))
            ent = ent.index_put((idx,), torch.nn.functional.pad(unpack(h, packed), (0, t - sub_t)).to(dev))
    return (logp, ent) if with_entropy else logp


PREFIX_SEGMENT = -2  # segment id of a group's shared prefix (filler is -1, a suffix its row index)
# auto: a tree row longer than MAX_TREE_ROW runs per span only when sharing the prompts saves this
# fraction of the tokens; else plain rows (causal attention per sequence without any mask is cheaper
# than a span's masked blocks: 8 answers of 512 under a 32-token prompt save 5%, and ran 25% slower)
MIN_TREE_SAVING = 0.2


def tree_saving(tree: TreeRows, attention_mask: torch.Tensor) -> float:
    """1 − the tree's tokens / the sequences' tokens: the share of the work sharing prompts saves."""
    total = int(attention_mask.sum())
    return 1.0 - int((tree.segment_ids != -1).sum()) / max(total, 1)


MAX_TREE_ROW = 1024  # a longer group row under a mask falls back to `pack` (its [L, L] mask would cost more)


@dataclass
class TreeRows:
    """One row per group: the common prefix once, then each member's suffix; and for every
    predicted token (sequence position t ≥ 1) where its logits are and where it goes."""

    input_ids: torch.Tensor  # [G, L]
    position_ids: torch.Tensor  # [G, L]: the prefix 0..p-1, each suffix p..len-1, filler continuing
    segment_ids: torch.Tensor  # [G, L]: PREFIX_SEGMENT, the member's row index, or -1 (filler)
    prev: torch.Tensor  # [M] flat index into [G·L] of the token before each predicted token …
    target: torch.Tensor  # [M] … the predicted token …
    dst: torch.Tensor  # [M] … and its flat index in the padded [N·T] layout
    shape: tuple[int, int]

    def attention_mask_4d(self, dtype: torch.dtype = torch.float32, window: int | None = None) -> torch.Tensor:
        """Additive [G, 1, L, L]: 0 where key ≤ query and the key is in the query's segment or the
        prefix (and, with a `window`, fewer than `window` positions back), else dtype min."""
        seg = self.segment_ids
        L = seg.shape[1]
        allowed = (seg[:, :, None] == seg[:, None, :]) | (seg == PREFIX_SEGMENT)[:, None, :]
        allowed &= torch.ones(L, L, dtype=torch.bool).tril()
        allowed &= window_allowed(self.position_ids, window)
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def pack_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, group_index: torch.Tensor, pad_id: int = 0):
    """Right-padded rows [N, T] -> `TreeRows`: per group, the longest common prefix p of its
    members (at most the shortest member's length − 1, so each keeps a token), stored once."""
    n, t = input_ids.shape
    lengths = attention_mask.long().sum(1).tolist()
    ids = input_ids.tolist()
    members: dict[int, list[int]] = {}
    for r, g in enumerate(group_index.tolist()):
        members.setdefault(g, []).append(r)
    rows, prev, target, dst = [], [], [], []
    for rs in members.values():
        seqs = [ids[r][: lengths[r]] for r in rs]
        p = min(len(os.path.commonprefix(seqs)), min(map(len, seqs)) - 1)
        toks, pos, seg = seqs[0][:p], list(range(p)), [PREFIX_SEGMENT] * p
        base = len(rows)
        for r, s in zip(rs, seqs):
            start, k = len(toks), len(s)
            toks += s[p:]
            pos += range(p, k)
            seg += [r] * (k - p)
            # the token before position i (1 ≤ i < k) sits at i-1 in the prefix, or in the suffix
            prev.append((base, list(range(p)) + list(range(start, start + k - 1 - p))))
            target += s[1:]
            dst += range(r * t + 1, r * t + k)
        rows.append((toks, pos, seg))
    width = max((len(r[0]) for r in rows), default=1)
    out_ids = torch.full((len(rows), width), pad_id, dtype=input_ids.dtype)
    out_pos = torch.zeros((len(rows), width), dtype=torch.long)
    out_seg = torch.full((len(rows), width), -1, dtype=torch.long)
    for g, (toks, pos, seg) in enumerate(rows):
        k = len(toks)
        out_ids[g, :k] = torch.tensor(toks, dtype=input_ids.dtype)
        out_pos[g] = torch.tensor(pos + list(range(width - k)))
        out_seg[g, :k] = torch.tensor(seg)
    flat_prev = [g * width + i for g, local in prev for i in local]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return TreeRows(out_ids, out_pos, out_seg, as_long(flat_prev), as_long(target), as_long(dst), (n, t))


def tree_token_logprobs(
    model,
    tree: TreeRows,
    temperature: float = 1.0,
    with_entropy: bool = False,
    head=None,
    logit_chunk: int = 0,
    segments: bool = False,
):
    """`packed_token_logprobs` over `pack_groups` rows: one forward pass under the tree mask (per
    span with `segments`), then logp = z[prev, target] − logsumexp(z[prev]) with z = logits /
    temperature (with a `head`: from the hidden states at `prev`, `logit_chunk` tokens at a time,
    train/head.py)."""
    dev = model.device if hasattr(model, "device") else tree.input_ids.device
    prev, target, dst = tree.prev.to(dev), tree.target.to(dev), tree.dst.to(dev)
    n, t = tree.shape
    if head is not None:
        hid = _forward(model, tree, "mask4d", segments, hidden=True)
        flat = hid.reshape(-1, hid.shape[-1])[prev]
        out = chunked_logprobs(head, flat, target, temperature, logit_chunk, with_entropy)
        lp, h = (out[0], out[1]) if with_entropy else (out, None)
    else:
        logits = _forward(model, tree, "mask4d", segments, hidden=False)
        z = logits.float().reshape(-1, logits.shape[-1])
        if temperature != 1.0:
            z = z / temperature
        lp = z[prev, target] - torch.logsumexp(z, dim=-1)[prev]
        h = entropy_from_logits(z)[prev] if with_entropy else None
    logp = torch.zeros(n * t, device=dev, dtype=lp.dtype).index_put((dst,), lp).view(n, t)
    if not with_entropy:
        return logp
    return logp, torch.zeros(n * t, device=dev, dtype=h.dtype).index_put((dst,), h).view(n, t)


# -- the first use of per-span attention on a model, checked against its masks ---------------------
_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
CHECK_TOL = 1e-4


def segments_agree(model, input_ids: torch.Tensor) -> bool:
    """Once per model: the per-span forward of a small tree (two sequences sharing a prompt, one
    more in a group of its own) equals the same rows under their 4D masks, else the model stays on
    masks (logged). The caller has switched it with `use_segments`. Compared in eval mode: dropout
    (GPT-2's checkpoints ship 0.1) would make two forwards differ whatever the attention."""
    base = base_model(model)
    if base not in _CHECKED:
        training = model.training
        model.eval()
        try:
            _CHECKED[base] = _compare(model, input_ids)
        finally:
            model.train(training)
    return _CHECKED[base]


@torch.no_grad()
def _compare(model, input_ids: torch.Tensor) -> bool:
    ids = input_ids.reshape(-1)[:24].cpu()
    if ids.numel() < 8:
        return True
    n = ids.numel()
    other = ids.clone()
    other[n // 2 :] = ids.flip(0)[n // 2 :]
    rows = torch.stack([ids, other, ids.roll(3)])
    tree = pack_groups(rows, torch.ones_like(rows), torch.tensor([0, 0, 1]))
    name = type(base_model(model)).__name__
    want = _forward(model, tree, "mask4d", segments=False, hidden=True)
    try:
        got = _forward(model, tree, "mask4d", segments=True, hidden=True)
    except (NotImplementedError, TypeError, ValueError) as exc:
        log.warning("%s: segment attention unavailable (%s); packed rows use 4D masks", name, exc)
        return False
    real = (tree.segment_ids != -1).to(want.device)
    gap = float((want - got).abs()[real].max())
    if gap > CHECK_TOL:
        log.warning("%s: segment attention differs from 4D masks by %.2e; packed rows use 4D masks", name, gap)
    return gap <= CHECK_TOL
