import torch

from areal_core.config import ModelConfig
from areal_core.models import build_tiny_model
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.train.logprobs import token_logprobs

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
PAD, EOS = 0, 1


def model(seed=0):
    torch.manual_seed(seed)
    return build_tiny_model(CFG, 40, seed)


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 40, (n,), generator=g).tolist() for n in (3, 7, 5, 11)]


def test_behaviour_logprobs_match_the_trainers_recomputation_with_left_padding():
    m = model()
    eng = TorchEngine(m, PAD, EOS, seed=3)
    gens = eng.generate(prompts(), SamplingParams(max_new_tokens=12))
    for p, g in zip(prompts(), gens):
        ids = torch.tensor([p + g.token_ids])
        lp = token_logprobs(m, ids, torch.ones_like(ids))[0, len(p) :]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4)


class SwapAt:
    """Stages `state_dict` as version `version` right before decode step `step`."""

    def __init__(self, engine, step, version, state_dict):
        self.engine, self.step, self.version, self.sd, self.calls = engine, step, version, state_dict, 0
        self.original = engine._install_staged

    def __call__(self):
        self.calls += 1
        if self.calls == self.step + 1:
            self.engine.stage_weights(self.version, self.sd)
        return self.original()


def test_interruption_with_equal_weights_gives_identical_tokens():
    params = SamplingParams(max_new_tokens=10, greedy=True)
    base = TorchEngine(model(), PAD, EOS).generate(prompts(), params)
    m = model()
    eng = TorchEngine(m, PAD, EOS)
    eng._install_staged = SwapAt(eng, 4, 1, {k: v.clone() for k, v in m.state_dict().items()})
    swapped = eng.generate(prompts(), params)
    assert eng.swaps == 1
    for a, b in zip(base, swapped):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        # tokens sampled after the swap carry version 1, earlier ones version 0
        assert b.versions == [0] * min(4, len(b.versions)) + [1] * max(0, len(b.versions) - 4)


def test_swap_to_new_weights_continues_under_them():
    params = SamplingParams(max_new_tokens=10, greedy=True)
    new = model(seed=5)
    eng = TorchEngine(model(), PAD, EOS)
    eng._install_staged = SwapAt(eng, 3, 2, new.state_dict())
    gens = eng.generate(prompts(), params)
    # the continuation equals what the new model alone would produce from the same prefix
    for p, g in zip(prompts(), gens):
        if len(g.token_ids) <= 3:
            continue
        prefix = p + g.token_ids[:3]
        ref = TorchEngine(model(seed=5), PAD, EOS).generate(
            [prefix], SamplingParams(max_new_tokens=len(g.token_ids) - 3, greedy=True)
        )[0]
        assert ref.token_ids == g.token_ids[3:]
        assert set(g.versions[3:]) == {2}


def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy():
    a = TorchEngine(model(), PAD, EOS, seed=7).generate(prompts(), SamplingParams(max_new_tokens=8))
    b = TorchEngine(model(), PAD, EOS, seed=7).generate(prompts(), SamplingParams(max_new_tokens=8))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    greedy = TorchEngine(model(), PAD, EOS).generate(prompts(), SamplingParams(max_new_tokens=8, greedy=True))
    top1 = TorchEngine(model(), PAD, EOS).generate(prompts(), SamplingParams(max_new_tokens=8, top_k=1))
    assert [g.token_ids for g in greedy] == [g.token_ids for g in top1]
