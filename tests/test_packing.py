"""Sequence packing: packed and padded forward passes of a tiny Qwen2 agree; layout and budgets."""

import pytest
import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model
from areal_core.train.entropy import token_logprobs_and_entropy
from areal_core.train.logprobs import token_logprobs
from areal_core.train.packing import (
    PREFIX_SEGMENT,
    first_fit_decreasing,
    micro_batches_by_tokens,
    pack,
    pack_groups,
    packed_logits,
    packed_token_logprobs,
)

VOCAB = 50
LENGTHS = [7, 3, 12, 1, 5, 9, 2]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    return build_tiny_model(cfg, VOCAB, seed=0)


def padded_batch(lengths=LENGTHS, width=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    attn = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
    return ids * attn, attn


def test_first_fit_decreasing_and_token_budget():
    bins = first_fit_decreasing([5, 9, 3, 4, 20, 1], capacity=10)
    assert bins == [[4], [1, 5], [0, 3], [2]]  # 20 alone (too long), 9+1, 5+4, 3
    mbs = micro_batches_by_tokens(torch.tensor(LENGTHS), token_budget=12)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in mb) <= 12 for mb in mbs) and len(mbs) == 4  # 39 tokens
    assert micro_batches_by_tokens(LENGTHS, 0) == [list(range(len(LENGTHS)))]


def test_pack_layout():
    ids, attn = padded_batch([3, 2, 4], width=5)
    p = pack(ids, attn, row_len=6)
    # bins of ≤ 6 tokens, longest first: [4, 2] and [3]; positions restart per sequence
    assert p.input_ids.shape == (2, 6)
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]  # row 2: filler 0..2
    assert p.segment_ids.tolist() == [[2, 2, 2, 2, 1, 1], [0, 0, 0, -1, -1, -1]]
    assert torch.equal(p.input_ids[0, :4], ids[2, :4]) and torch.equal(p.input_ids[1, :3], ids[0, :3])
    flat = torch.zeros(3 * 5, dtype=torch.long)
    flat[p.dst] = p.input_ids.reshape(-1)[p.src]
    assert torch.equal(flat.view(3, 5), ids)  # src/dst invert the packing exactly


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["position_ids", "mask4d"])
@pytest.mark.parametrize("budget,row_len", [(0, 0), (16, 0), (0, 64), (20, 20)])
def test_packed_matches_padded(model, attn_impl, mode, budget, row_len):
    model.set_attn_implementation(attn_impl)
    ids, attn = padded_batch()
    with torch.no_grad():
        want, want_h = token_logprobs_and_entropy(model, ids, attn)
        got, got_h = packed_token_logprobs(
            model, ids, attn, token_budget=budget, row_len=row_len, mode=mode, with_entropy=True
        )
    m = attn.float()
    m[:, 0] = 0  # position 0 has no prediction: 0 in both layouts
    assert torch.allclose(got, want * m, atol=2e-5)
    assert torch.allclose(got_h, want_h * m, atol=2e-5)
    assert (got[attn == 0] == 0).all()


def test_packed_matches_token_logprobs_with_temperature(model):
    model.set_attn_implementation("sdpa")
    ids, attn = padded_batch(seed=1)
    with torch.no_grad():
        want = token_logprobs(model, ids, attn, temperature=0.7) * attn
        got = packed_token_logprobs(model, ids, attn, temperature=0.7, token_budget=24)
    assert torch.allclose(got, want, atol=2e-5)


def test_boundaries_matter(model):
    """Negative control: the same packed row with one continuous position range (no restarts)
    lets sequences attend to each other, and the logits change."""
    model.set_attn_implementation("sdpa")
    ids, attn = padded_batch([6, 6])
    p = pack(ids, attn, row_len=12)
    with torch.no_grad():
        isolated = packed_logits(model, p)
        p.position_ids = torch.arange(12)[None]
        leaked = packed_logits(model, p)
    assert torch.allclose(isolated[:, :6], leaked[:, :6], atol=1e-5)  # the first sequence is unaffected
    assert (isolated[:, 6:] - leaked[:, 6:]).abs().max() > 1e-3


def test_packed_gradients_match_padded(model):
    model.set_attn_implementation("sdpa")
    ids, attn = padded_batch(seed=2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3)) * attn
    grads = []
    for fn in (
        lambda: token_logprobs(model, ids, attn),
        lambda: packed_token_logprobs(model, ids, attn, token_budget=16),
    ):
        model.zero_grad()
        (fn() * weights).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def grouped_batch(seed=0):
    """Three groups: members share a prompt (one member twice, one member one token past it)."""
    g = torch.Generator().manual_seed(seed)
    seqs, groups = [], []
    for gi, plen in enumerate([2, 6, 4]):
        prompt = torch.randint(3, VOCAB, (plen,), generator=g).tolist()
        for _ in range(4):
            n = int(torch.randint(1, 6, (1,), generator=g))
            seqs.append(prompt + torch.randint(3, VOCAB, (n,), generator=g).tolist())
            groups.append(gi)
    seqs.append(list(seqs[-1]))  # an identical member: each member still keeps one own token
    groups.append(2)
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
    return ids, attn, torch.tensor(groups)


def test_pack_groups_stores_each_prompt_once():
    ids, attn, groups = grouped_batch()
    tree = pack_groups(ids, attn, groups)
    assert tree.input_ids.shape[0] == 3
    lengths = attn.sum(1)
    for g, plen in enumerate([2, 6, 4]):
        members = (groups == g).nonzero().flatten()
        prefix = min(plen, int(lengths[members].min()) - 1)
        assert int((tree.segment_ids[g] >= 0).sum()) == int(lengths[members].sum()) - prefix * len(members)
        assert (tree.segment_ids[g, :prefix] == PREFIX_SEGMENT).all()
    # every predicted token is the one at its destination, predicted from the token before it
    assert torch.equal(tree.target, ids.reshape(-1)[tree.dst])
    assert torch.equal(tree.input_ids.reshape(-1)[tree.prev], ids.reshape(-1)[tree.dst - 1])


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_group_packing_matches_padded(model, attn_impl):
    model.set_attn_implementation(attn_impl)
    ids, attn, groups = grouped_batch(seed=1)
    with torch.no_grad():
        want, want_h = token_logprobs_and_entropy(model, ids, attn, temperature=0.7)
        got, got_h = packed_token_logprobs(model, ids, attn, 0.7, group_index=groups, with_entropy=True)
    m = attn.float()
    m[:, 0] = 0
    assert torch.allclose(got, want * m, atol=2e-5) and torch.allclose(got_h, want_h * m, atol=2e-5)
    assert (got[attn == 0] == 0).all()


def test_group_packing_gradients_match_padded(model):
    model.set_attn_implementation("sdpa")
    ids, attn, groups = grouped_batch(seed=2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3)) * attn
    grads = []
    for fn in (
        lambda: token_logprobs(model, ids, attn),
        lambda: packed_token_logprobs(model, ids, attn, group_index=groups),
    ):
        model.zero_grad()
        (fn() * weights).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_group_packing_needs_the_tree_mask(model):
    """Negative control: without the tree mask (plain causal over the row) a suffix attends to the
    suffixes before it and the log-probs change."""
    model.set_attn_implementation("sdpa")
    ids, attn, groups = grouped_batch(seed=4)
    tree = pack_groups(ids, attn, groups)
    with torch.no_grad():
        isolated = model(
            input_ids=tree.input_ids, position_ids=tree.position_ids, attention_mask=tree.attention_mask_4d()
        ).logits
        leaked = model(input_ids=tree.input_ids, position_ids=tree.position_ids).logits
    assert (isolated - leaked).abs().max() > 1e-3
