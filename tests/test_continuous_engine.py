"""The continuous-batching engine: equality with `transformers` greedy decoding, interruption,
slot refill, sampling (seeded, top-k/top-p, the exact distribution), stop strings, failures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from areal_core.config import ConfigError, ModelConfig, load_config
from areal_core.models import build_tiny_model, build_tokenizer
from areal_core.rollout.continuous_engine import ContinuousEngine, EngineError
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.sampling import RowParams, sample
from areal_core.rollout.torch_engine import TorchEngine
from areal_core.train.logprobs import token_logprobs

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
PAD, EOS, VOCAB = 0, 1, 40


def model(seed: int = 0):
    return build_tiny_model(CFG, VOCAB, seed).eval()


def prompts(lengths=(3, 7, 5, 11, 2, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(max_new_tokens=12, greedy=True)


def test_greedy_equals_transformers_generate_with_slot_refill():
    m = model()
    eng = ContinuousEngine(m, PAD, EOS, slots=3)  # 6 prompts through 3 slots: later ones refill
    gens = eng.generate(prompts(), GREEDY)
    with torch.no_grad():
        for p, g in zip(prompts(), gens):
            ref = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)[
                0, len(p) :
            ].tolist()
            assert g.token_ids == ref
            assert g.finish_reason == ("stop" if ref[-1] == EOS else "length")
    assert eng.stats["prefill_chunks"] >= 2  # requests entered after the first batch
    assert TorchEngine(m, PAD, EOS).generate(prompts(), GREEDY)[0].token_ids == gens[0].token_ids


def test_behaviour_logprobs_match_the_trainers_recomputation():
    m = model()
    gens = ContinuousEngine(m, PAD, EOS, slots=4, seed=3).generate(prompts(), SamplingParams(max_new_tokens=10))
    for p, g in zip(prompts(), gens):
        ids = torch.tensor([p + g.token_ids])
        lp = token_logprobs(m, ids, torch.ones_like(ids))[0, len(p) :]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4)


@pytest.mark.parametrize("slots", [12, 5])
def test_a_groups_shared_prompt_is_prefilled_once_with_the_same_tokens(slots):
    """A group's samples share their prompt: it is prefilled once and its cache row copied; each
    request still gives the tokens and log-probs it gives alone (seed s + i for request i)."""
    group = [p for p in prompts((4, 9, 6)) for _ in range(4)]
    params = SamplingParams(max_new_tokens=10, seed=11)
    eng = ContinuousEngine(model(), PAD, EOS, slots=slots)
    gens = eng.generate(group, params)
    assert eng.stats["prefill_shared"] >= (9 if slots == 12 else 4)
    alone = ContinuousEngine(model(), PAD, EOS, slots=1)
    for i, (p, g) in enumerate(zip(group, gens)):
        ref = alone.generate([p], SamplingParams(max_new_tokens=10, seed=11 + i))[0]
        assert g.token_ids == ref.token_ids
        assert np.allclose(g.logprobs, ref.logprobs, atol=1e-4)
    assert alone.stats["prefill_shared"] == 0


def test_a_call_never_reuses_the_previous_calls_sampling_settings():
    """Two calls with the same row layout (every row runs to max_new_tokens): the second call's
    greedy settings and seeds are its own, however Python reuses the first batch's id."""
    eng = ContinuousEngine(model(), PAD, EOS, slots=8)
    fresh = ContinuousEngine(model(), PAD, EOS, slots=8)
    ps = prompts((3, 4, 5, 6))
    one = SamplingParams(max_new_tokens=1, greedy=True)
    want = [g.token_ids for g in fresh.generate(ps, one)]
    for i in range(4):
        hot = eng.generate(ps, SamplingParams(max_new_tokens=1, temperature=50.0, seed=i))
        assert [g.token_ids for g in hot] != want  # near-uniform sampling over 40 tokens
        assert [g.token_ids for g in eng.generate(ps, one)] == want


class SwapAt:
    """Stages `state_dict` as `version` right before engine step `step` (0 = the first token)."""

    def __init__(self, engine, step, version, state_dict):
        self.engine, self.step, self.version, self.sd, self.calls = engine, step, version, state_dict, 0
        self.original = engine._install_staged

    def __call__(self):
        self.calls += 1
        if self.calls == self.step + 1:
            self.engine.stage_weights(self.version, self.sd)
        return self.original()


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=12, seed=11, top_p=0.9)])
def test_interruption_with_equal_weights_gives_identical_tokens(params):
    base = ContinuousEngine(model(), PAD, EOS, slots=8).generate(prompts(), params)
    m = model()
    eng = ContinuousEngine(m, PAD, EOS, slots=8)
    eng._install_staged = SwapAt(eng, 4, 1, {k: v.clone() for k, v in m.state_dict().items()})
    swapped = eng.generate(prompts(), params)
    assert eng.swaps == 1 and eng.stats["reprefill_tokens"] > 0
    for a, b in zip(base, swapped):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        n = len(b.versions)
        assert b.versions == [0] * min(4, n) + [1] * max(0, n - 4)


class StageAtCall:
    """Wraps `engine.<method>`: stages `state_dict` as `version` right before its call number
    `at` (0-based); the continuous engine's `_step`, the torch engine's `_forward`."""

    def __init__(self, engine, method, at, version, state_dict):
        self.engine, self.at, self.version, self.sd, self.calls = engine, at, version, state_dict, 0
        self.original = getattr(engine, method)
        setattr(engine, method, self)

    def __call__(self, *args):
        if self.calls == self.at:
            self.engine.stage_weights(self.version, self.sd)
        self.calls += 1
        return self.original(*args)


@pytest.mark.parametrize("mid", [False, True])
@pytest.mark.parametrize("engine_cls", [ContinuousEngine, TorchEngine])
def test_without_mid_generation_swaps_a_version_waits_for_the_next_call(engine_cls, mid):
    """swap_mid_generation=False: a version staged mid-call is installed at the next call's
    start; the call in flight keeps its weights and tokens, with nothing re-prefilled. True:
    the same staging swaps within the call."""
    kwargs = {"slots": 8} if engine_cls is ContinuousEngine else {}
    base = engine_cls(model(), PAD, EOS, **kwargs).generate(prompts(), GREEDY)
    new = model(seed=5)
    eng = engine_cls(model(), PAD, EOS, swap_mid_generation=mid, **kwargs)
    StageAtCall(eng, "_step" if engine_cls is ContinuousEngine else "_forward", 3, 2, new.state_dict())
    gens = eng.generate(prompts(), GREEDY)
    if mid:
        assert eng.swaps == 1 and any(2 in g.versions for g in gens)
        return
    assert eng.swaps == 0 and eng.version == 0
    assert [g.token_ids for g in gens] == [g.token_ids for g in base]
    assert all(set(g.versions) == {0} for g in gens)
    if engine_cls is ContinuousEngine:
        assert eng.stats["reprefill_tokens"] == 0
    after = eng.generate(prompts(), GREEDY)  # the next call starts under the staged version
    assert eng.swaps == 1 and eng.version == 2
    assert all(set(g.versions) == {2} for g in after)
    ref = engine_cls(model(seed=5), PAD, EOS, **kwargs).generate(prompts(), GREEDY)
    assert [g.token_ids for g in after] == [g.token_ids for g in ref]


def test_swap_mid_generation_is_a_rollout_setting_the_factory_passes_on():
    from areal_core.rollout.factory import build_local_engine

    tok = build_tokenizer(["1 2 3 4 5 + - = ####"], 300)
    cfg = load_config("configs/default.yaml", ["rollout.swap_mid_generation=false"])
    m = build_tiny_model(CFG, len(tok), 0)
    assert build_local_engine(cfg, m, tok, 0, seed=1).swap_mid_generation is False
    cfg = load_config("configs/default.yaml", ["rollout.engine=torch", "rollout.swap_mid_generation=true"])
    assert build_local_engine(cfg, m, tok, 0, seed=1).swap_mid_generation is True
    assert load_config(None, []).rollout.swap_mid_generation is True  # the library default: AReaL's
    assert load_config("configs/default.yaml", []).rollout.swap_mid_generation is False  # the default job's


def test_a_step_delay_slows_the_engine_and_changes_no_token():
    """rollout.step_delay_s (the controlled experiment of issue 25): the same seeded tokens, one sleep per step."""
    from areal_core.rollout.factory import build_local_engine

    tok = build_tokenizer(["1 2 3 4 5 + - = ####"], 300)
    cfg = load_config("configs/default.yaml", ["rollout.step_delay_s=0.05"])
    m = build_tiny_model(CFG, len(tok), 0).eval()
    slow = build_local_engine(cfg, m, tok, 0, seed=1)
    assert slow.step_delay_s == 0.05
    fast = ContinuousEngine(m, tok.pad_token_id, tok.eos_token_id, slots=4, seed=1)
    slow.slots = 4
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    t0 = time.perf_counter()
    got = slow.generate(prompts(), params)
    elapsed = time.perf_counter() - t0
    assert [g.token_ids for g in got] == [g.token_ids for g in fast.generate(prompts(), params)]
    assert elapsed >= 0.05 * slow.stats["steps"] > 0
    with pytest.raises(ConfigError, match="step_delay_s"):
        load_config("configs/default.yaml", ["rollout.step_delay_s=-1"])


def test_versions_switch_at_the_right_token_with_new_weights():
    new = model(seed=5)
    eng = ContinuousEngine(model(), PAD, EOS, slots=8)
    eng._install_staged = SwapAt(eng, 3, 2, new.state_dict())
    gens = eng.generate(prompts(), GREEDY)
    checked = 0
    for p, g in zip(prompts(), gens):
        assert g.versions[:3] == [0] * min(3, len(g.versions))
        if len(g.token_ids) <= 3:
            continue
        assert set(g.versions[3:]) == {2}
        # the continuation is what the new model alone produces from the same prefix
        ref = ContinuousEngine(model(seed=5), PAD, EOS).generate(
            [p + g.token_ids[:3]], SamplingParams(max_new_tokens=len(g.token_ids) - 3, greedy=True)
        )[0]
        assert ref.token_ids == g.token_ids[3:]
        checked += 1
    assert checked >= 3


def test_a_long_request_does_not_block_short_ones():
    lengths = [40] + [4] * 8
    params = [SamplingParams(max_new_tokens=n, seed=i) for i, n in enumerate(lengths)]
    no_eos = -1
    ps = prompts((3,) * len(lengths))
    cont = ContinuousEngine(model(), PAD, no_eos, slots=2)
    gens = cont.generate(ps, params)
    assert [len(g.token_ids) for g in gens] == lengths
    # the long one holds one slot for 40 steps; the 8 short ones pass through the other (8·4 = 32)
    assert cont.stats["steps"] == 40
    static = ContinuousEngine(model(), PAD, no_eos, slots=2, policy="static")
    gens_static = static.generate(ps, params)
    assert static.stats["steps"] == 40 + 4 * 4  # [long, short] for 40 steps, then 7 shorts in 4 pairs
    # same per-request seeds: the schedule does not change any token
    assert [g.token_ids for g in gens] == [g.token_ids for g in gens_static]


def test_cache_is_allocated_once_and_reused():
    eng = ContinuousEngine(model(), PAD, EOS, slots=4)
    eng.generate(prompts(), GREEDY)
    ptrs = [kv.data_ptr() for kv in eng.runner.kv]
    eng.generate(prompts((4, 6)), GREEDY)
    assert [kv.data_ptr() for kv in eng.runner.kv] == ptrs


def test_chunked_prefill_gives_the_same_tokens():
    a = ContinuousEngine(model(), PAD, EOS, slots=6).generate(prompts(), GREEDY)
    b = ContinuousEngine(model(), PAD, EOS, slots=6, prefill_tokens=12).generate(prompts(), GREEDY)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_seeded_sampling_is_reproducible_across_slots_and_batches():
    params = SamplingParams(max_new_tokens=10, seed=7, temperature=1.3, top_k=20)
    a = ContinuousEngine(model(), PAD, EOS, slots=6).generate(prompts(), params)
    b = ContinuousEngine(model(), PAD, EOS, slots=2).generate(prompts(), params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    # request 3 alone, with the seed it had in the batch (shared seed s gives request i seed s + i)
    alone = ContinuousEngine(model(), PAD, EOS).generate(
        [prompts()[3]], [SamplingParams(**{**vars(params), "seed": 10})]
    )
    assert alone[0].token_ids == a[3].token_ids
    other = ContinuousEngine(model(), PAD, EOS).generate(prompts(), SamplingParams(**{**vars(params), "seed": 8}))
    assert [g.token_ids for g in other] != [g.token_ids for g in a]
    # unseeded requests draw their seeds from the engine's generator
    e1 = ContinuousEngine(model(), PAD, EOS, seed=3).generate(prompts(), SamplingParams(max_new_tokens=8))
    e2 = ContinuousEngine(model(), PAD, EOS, seed=3).generate(prompts(), SamplingParams(max_new_tokens=8))
    assert [g.token_ids for g in e1] == [g.token_ids for g in e2]


def test_top_k_one_and_tiny_top_p_are_greedy():
    greedy = ContinuousEngine(model(), PAD, EOS).generate(prompts(), GREEDY)
    for p in (SamplingParams(max_new_tokens=12, top_k=1, seed=1), SamplingParams(max_new_tokens=12, top_p=1e-6)):
        out = ContinuousEngine(model(), PAD, EOS).generate(prompts(), p)
        assert [g.token_ids for g in out] == [g.token_ids for g in greedy]


def rows(n, temperature=1.0, top_k=0, top_p=1.0, vocab=6):
    return RowParams(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k if top_k > 0 else vocab),
        top_p=torch.full((n,), top_p),
        greedy=torch.zeros(n, dtype=torch.bool),
        seeds=torch.arange(n, dtype=torch.int64) * 7919 + 3,
        all_greedy=False,
        any_greedy=False,
        any_filter=top_k > 0 or top_p < 1,
    )


def test_sampler_draws_from_the_filtered_distribution():
    """Frequencies over 40k requests (one token each) match softmax(l/τ) restricted to top-k/top-p
    within 4 standard errors; filtered-out tokens never appear."""
    n = 40000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).repeat(n, 1)
    cases = [
        (dict(temperature=0.7), [0, 1, 2, 3, 4, 5]),
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.8), None),
    ]
    for kw, support in cases:
        tok, lp = sample(logits, rows(n, **kw), torch.zeros(n, dtype=torch.long))
        p = torch.softmax(logits[0] / kw.get("temperature", 1.0), -1)
        if support is None:  # top-p: the smallest prefix of sorted tokens with mass ≥ 0.8
            support = [j for j in range(6) if p[:j].sum() < 0.8]
        q = torch.zeros(6)
        q[support] = p[support] / p[support].sum()
        freq = torch.bincount(tok, minlength=6).float() / n
        assert set(tok.unique().tolist()) <= set(support)
        assert torch.all((freq - q).abs() <= 4 * (q * (1 - q) / n).sqrt() + 1e-9), (kw, freq, q)
        # the behaviour log-prob is the unfiltered tempered one
        ref = torch.log_softmax(logits / kw.get("temperature", 1.0), -1).gather(-1, tok[:, None]).squeeze(-1)
        assert torch.allclose(lp, ref)


def test_stop_strings_and_stop_token_ids():
    tok = build_tokenizer(["12+34=46", "7-3=4", "the answer is 9"], vocab_size=VOCAB)
    eng = ContinuousEngine(model(), tok.pad_token_id, tok.eos_token_id, slots=4, tokenizer=tok)
    base = eng.generate(prompts(), SamplingParams(max_new_tokens=16, greedy=True))
    g = next(x for x in base if len(x.token_ids) >= 8)
    i = g.token_ids.index(g.token_ids[5])  # first occurrence of the 6th token
    # a stop string completed by token i+1 (the decoded text of tokens i..i+1)
    stop = tok.decode(g.token_ids[i : i + 2])
    full = tok.decode(g.token_ids)
    first = full.index(stop)
    out = eng.generate([prompts()[base.index(g)]], SamplingParams(max_new_tokens=16, greedy=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    text = tok.decode(out.token_ids)
    assert stop in text and text.index(stop) == first
    assert stop not in tok.decode(out.token_ids[:-1])  # stopped at the token completing it
    assert out.token_ids == g.token_ids[: len(out.token_ids)]
    ids = eng.generate(
        [prompts()[base.index(g)]], SamplingParams(max_new_tokens=16, greedy=True, stop_token_ids=[g.token_ids[5]])
    )[0]
    assert ids.token_ids == g.token_ids[: i + 1] and ids.finish_reason == "stop"
    with pytest.raises(ValueError, match="tokenizer"):
        ContinuousEngine(model(), PAD, EOS).generate(prompts(), SamplingParams(stop=["x"]))


def test_an_engine_failure_is_a_clear_error_and_health_reports_it():
    eng = ContinuousEngine(model(), PAD, EOS, slots=2)
    eng.generate(prompts(), GREEDY)
    calls = {"n": 0}
    decode = eng.runner.decode

    def broken(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return decode(*args)

    eng.runner.decode = broken
    with pytest.raises(EngineError, match=r"failed at step 3 of a 6-request call \(version 0, 2 active rows"):
        eng.generate(prompts(), GREEDY)
    assert eng.health()["ok"] is False and "simulated kernel failure" in eng.health()["error"]


def test_config_selects_the_engine():
    assert load_config(None, ["rollout.engine=continuous"]).rollout.engine == "continuous"
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(None, ["rollout.engine=turbo"])


def published_continuous_run(overrides: list[str]):
    """(run URI, store) of a prepared tiny run on the continuous engine, SFT done, v0 published."""
    from areal_core.layout import LAYOUT
    from areal_core.models import load_pretrained
    from areal_core.run import pipeline
    from areal_core.store import Store
    from areal_core.weights.publisher import publish, state_dict_bytes

    run_uri, _ = pipeline.prepare("", [*overrides, "rollout.engine=continuous"])
    pipeline.sft(run_uri)
    store = Store(run_uri)
    m, _ = load_pretrained(store.url(LAYOUT.init_model))
    publish(store, 0, state_dict_bytes(m), {})
    return run_uri, store


@pytest.mark.slow
def test_rollout_worker_engine_crash_is_named_and_a_restart_resumes_from_the_store(tiny_overrides, monkeypatch):
    from areal_core.protocol import decode_shard
    from areal_core.rollout import worker

    run_uri, store = published_continuous_run(tiny_overrides)

    real = ContinuousEngine.generate
    calls = {"n": 0}

    def dead_from_the_second_call(self, prompts_, params):
        # a crashed engine stays crashed: AsyncEngine retries a failed batch one call at a time, and
        # those retries fail too (a one-off failure is retried and lost nothing: test below)
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("out of memory (simulated)")
        return real(self, prompts_, params)

    monkeypatch.setattr(ContinuousEngine, "generate", dead_from_the_second_call)
    with pytest.raises(
        worker.RolloutEngineFailed,
        match=r"rollout-0: engine 'continuous' failed generating groups 2\.\.\.[23] \(shard 1, version 0\).*"
        r"out of memory \(simulated\)",
    ):
        worker.run_rollout_worker(run_uri, 0)
    assert store.find("trajectories/ungraded/rollout-0", ".arrow") == ["trajectories/ungraded/rollout-0/00000000.arrow"]

    monkeypatch.setattr(ContinuousEngine, "generate", real)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(worker.run_rollout_worker(run_uri, 0)))
    t.start()
    deadline = time.time() + 120
    # admission with η = 2, B = 2 groups at version 0 allows (0 + 2 + 1)·2 = 6 groups: 3 shards
    while len(store.find("trajectories/ungraded/rollout-0", ".arrow")) < 3 and time.time() < deadline:
        time.sleep(0.1)
    store.write_text("DONE", "test")
    t.join(timeout=60)
    assert result == {"worker": "rollout-0", "shards": 3, "groups": 6}
    samples = [
        s
        for name in store.find("trajectories/ungraded/rollout-0", ".arrow")
        for s in decode_shard(store.read_bytes(name))
    ]
    groups = [s.group_id for s in samples]
    assert sorted(set(groups)) == [f"rollout-0-g{g:07d}" for g in range(6)]
    assert len(samples) == len({s.sample_id for s in samples}) == 6 * 4
    assert all(set(s.versions[s.prompt_len :]) == {0} for s in samples)


@pytest.mark.slow
def test_a_one_off_engine_failure_is_retried_call_by_call_and_loses_no_group(tiny_overrides, monkeypatch):
    from areal_core.protocol import decode_shard
    from areal_core.rollout import worker

    run_uri, store = published_continuous_run(tiny_overrides)
    real = ContinuousEngine.generate
    sizes: list[int] = []

    def fails_once(self, prompts_, params):
        sizes.append(len(prompts_))
        if len(sizes) == 2:
            raise RuntimeError("transient (simulated)")
        return real(self, prompts_, params)

    monkeypatch.setattr(ContinuousEngine, "generate", fails_once)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(worker.run_rollout_worker(run_uri, 0)))
    t.start()

    def samples():
        return [
            s
            for name in store.find("trajectories/ungraded/rollout-0", ".arrow")
            for s in decode_shard(store.read_bytes(name))
        ]

    deadline = time.time() + 120
    while len(samples()) < 6 * 4 and time.time() < deadline:  # admission allows 6 groups (test above)
        time.sleep(0.2)
    store.write_text("DONE", "test")
    t.join(timeout=60)
    # groups retried one by one finish apart, so they may fill more (smaller) shards than 3
    assert result["groups"] == 6 and result["shards"] >= 3
    # the failed call held two groups of 4; each was run again alone
    assert sizes[1] == 8 and sizes[2:4] == [4, 4]
    got = samples()
    assert sorted({s.group_id for s in got}) == [f"rollout-0-g{g:07d}" for g in range(6)]
    assert len(got) == len({s.sample_id for s in got}) == 6 * 4


@pytest.mark.parametrize("engine_cls", [ContinuousEngine, TorchEngine])
def test_a_swap_that_would_re_prefill_past_the_budget_waits_exactly(engine_cls):
    """rollout.reprefill_budget_tokens: a version staged while more tokens than the budget are in
    flight waits; the call decodes on under the current weights, token for token as without the
    swap, every token tagged with the version that produced it, nothing re-prefilled; the version
    is installed once few enough tokens are in flight (here: at the next call). A budget above
    what is in flight swaps mid-call as before."""
    from areal_core.rollout.factory import build_local_engine

    kwargs = {"slots": 8} if engine_cls is ContinuousEngine else {}
    hook = "_step" if engine_cls is ContinuousEngine else "_forward"
    base = engine_cls(model(), PAD, EOS, **kwargs).generate(prompts(), GREEDY)
    new = model(seed=5)
    eng = engine_cls(model(), PAD, EOS, reprefill_budget=10, **kwargs)
    StageAtCall(eng, hook, 3, 2, new.state_dict())
    gens = eng.generate(prompts(), GREEDY)
    assert eng.swaps == 0 and eng.deferred_swap_steps > 0
    assert [g.token_ids for g in gens] == [g.token_ids for g in base]
    assert all(set(g.versions) == {0} for g in gens)
    if engine_cls is ContinuousEngine:
        assert eng.stats["reprefill_tokens"] == 0 and eng.health()["deferred_swap_steps"] > 0
    eng.generate(prompts(), GREEDY)
    assert eng.swaps == 1 and eng.version == 2
    roomy = engine_cls(model(), PAD, EOS, reprefill_budget=10**6, **kwargs)
    StageAtCall(roomy, hook, 3, 2, new.state_dict())
    assert any(2 in g.versions for g in roomy.generate(prompts(), GREEDY)) and roomy.deferred_swap_steps == 0
    tok = build_tokenizer(["1 2 3 4 5 + - = ####"], 300)
    kind = "continuous" if engine_cls is ContinuousEngine else "torch"
    cfg = load_config("configs/default.yaml", [f"rollout.engine={kind}", "rollout.reprefill_budget_tokens=4096"])
    assert build_local_engine(cfg, build_tiny_model(CFG, len(tok), 0), tok, 0, seed=1).reprefill_budget == 4096
