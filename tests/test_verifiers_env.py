"""verifiers 0.4 environments run as they are (`rollout.environment=verifiers:<taskset>`,
docs/environments.md): the tasksets of tests/data/verifiers_envs/ (laid out as `vf-init` lays one out,
written against `verifiers.v1`'s public API) in the side venv `.venv-verifiers`, their episodes driven
by verifiers' own harness through the proxy, their rubric's reward on every row.

Skipped, with the reason, when the side venv is missing (scripts/setup_verifiers_venv.sh)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import shlex
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from areal_core.config import ConfigError
from areal_core.environments import load_records, verifiers_env
from areal_core.protocol import Sample, decode_shard
from areal_core.proxy import agent_workflow
from areal_core.proxy.agent_workflow import AgentWorkflow
from areal_core.proxy.examples import ScriptedEngine
from areal_core.proxy.templating import parse_tool_calls
from areal_core.rollout.engine import SamplingParams
from areal_core.run import pipeline
from areal_core.run.launcher import launch
from areal_core.store import Store
from benchmarks import tiny_checkpoints as tc
from tests.conftest import ROOT, TINY
from tests.test_flyte import pyflyte

VENV = verifiers_env.venv_dir()
PY = VENV / "bin" / "python"
ENVS = ROOT / "tests" / "data" / "verifiers_envs"
PACKAGES = ("vf_arith", "vf_tool_calc", "vf_bad")
pytestmark = pytest.mark.skipif(
    not PY.exists(), reason=f"the verifiers side venv {VENV} is missing (scripts/setup_verifiers_venv.sh)"
)


@pytest.fixture(scope="module", autouse=True)
def env_packages():
    """The test tasksets, installed into the side venv editable from this checkout, offline (hatchling
    and editables come with the venv), unless they already are."""
    probe = "import importlib.util as u, json, sys; print(json.dumps([getattr(u.find_spec(n), 'origin', None) "
    probe += "for n in sys.argv[1:]]))"
    out = subprocess.run([PY, "-c", probe, *PACKAGES], capture_output=True, text=True, check=True)
    stale = [n for n, where in zip(PACKAGES, json.loads(out.stdout)) if not (where or "").startswith(str(ENVS))]
    if stale:
        paths = [a for n in stale for a in ("-e", str(ENVS / n))]
        cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", *paths]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)


class Task:
    num_train, num_eval = 6, 2


def digits_reply(prompt_text: str) -> str:
    """A perfect policy for vf-arith and vf-tool-calc, reading the rendered prompt: call the add tool
    for a tool task, then answer with the tool's result; answer a plain sum directly."""
    last = prompt_text.rsplit("<|im_start|>user\n", 1)[-1]
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", last, re.DOTALL)
    if results:
        return f"The sum is {results[-1].strip()}."
    if m := re.search(r"compute (\d+) \+ (\d+)", last):
        call = {"name": "calc_add", "arguments": {"a": int(m.group(1)), "b": int(m.group(2))}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"
    m = re.search(r"What is (\d+) \+ (\d+)", last)
    return str(int(m.group(1)) + int(m.group(2))) if m else "?"


def small_tokenizer():
    from areal_core.models import build_tokenizer

    corpus = ['What is 7 + 7? <tool_call>{"name": "calc_add", "arguments": {"a": 12, "b": 34}}</tool_call> 0123456789']
    return build_tokenizer(corpus * 20, 400)


@pytest.fixture(scope="module")
def tok():
    return small_tokenizer()


TOOL_SPEC = "vf-tool-calc?num_tasks=4"


@pytest.fixture(scope="module")
def tool_train() -> list[dict]:
    return load_records(f"verifiers:{TOOL_SPEC}", Task, 0)[0]


def play(
    tok, spec: str, tasks: list[dict], monkeypatch=None, group_size: int = 1, reply=digits_reply
) -> tuple[list, dict, list]:
    """`group_size` episodes of each task through AgentWorkflow over a scripted engine; the requests the
    proxy received (path, headers, JSON body) when `monkeypatch` is given."""
    seen: list[tuple[str, dict, dict]] = []
    if monkeypatch is not None:
        make = agent_workflow.create_app

        def create_app(*a, **kw):
            app = make(*a, **kw)

            @app.middleware("http")
            async def record(request, call_next):
                body = await request.body()
                seen.append((request.url.path, dict(request.headers), json.loads(body) if body else None))
                return await call_next(request)

            return app

        monkeypatch.setattr(agent_workflow, "create_app", create_app)
    engine = ScriptedEngine(tok, reply)
    wf = AgentWorkflow(
        tok,
        "areal_core.environments:run_episode",
        group_size=group_size,
        sampling=SamplingParams(max_new_tokens=96),
        tool_prompt="full",
    )

    async def run_all():
        return [r for t in tasks for r in await asyncio.gather(*(wf.run_episode(engine, t) for _ in range(group_size)))]

    try:
        results = asyncio.run(run_all())
    finally:
        wf.close()
    return results, wf.stats(), seen


def messages_of(tok, s: Sample, prompt: str) -> list[dict]:
    """The conversation a row holds, as the harness saw it: the user's prompt, then per turn the
    assistant message the proxy served (its text decoded as the proxy decodes it, tool calls parsed
    as the proxy parses them) and a tool message per call (its content is not in any rubric here)."""
    msgs: list[dict] = [{"role": "user", "content": prompt}]
    for _, _, start, end, _ in s.meta["turns"]:
        ids = s.input_ids[start:end]
        ids = ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids
        parsed = parse_tool_calls(tok.decode(ids, skip_special_tokens=True))
        msgs.append({"role": "assistant", "content": parsed.content or "", "tool_calls": parsed.tool_calls or None})
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": "(result)"} for c in parsed.tool_calls]
    return msgs


def rubric(spec: str, idx: int, messages: list[dict]) -> dict:
    return asyncio.run(verifiers_env.score(spec, {"meta": {"verifiers": {"idx": idx}}}, messages))


# -- records -----------------------------------------------------------------------------------
def test_the_taskset_gives_the_prompts_with_their_answers():
    train, held_out = load_records("verifiers:vf-arith?num_tasks=10", Task, seed=3)
    assert len(train) == 6 and len(held_out) == 2  # the first 8 tasks, in a shuffle seeded by the run's seed
    ids = [r["prompt_id"] for r in held_out + train]
    assert sorted(ids) == sorted(f"verifiers-{i}" for i in range(8))
    order = list(range(8))
    random.Random(3).shuffle(order)  # held-out first, then train
    assert ids == [f"verifiers-{i}" for i in order]
    for r in train + held_out:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", r["prompt"]).groups())
        assert r["answer"] == str(a + b) and r["meta"]["environment"] == "verifiers:vf-arith?num_tasks=10"
        assert r["prompt_id"] == f"verifiers-{r['meta']['verifiers']['idx']}" and r["meta"]["verifiers"]["key"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "vf_bad.no_answer",
            "verifiers:vf_bad.no_answer: its tasks have no 'answer' field (NoAnswerData's own fields: solution)",
        ),
        ("vf_bad.load_raises", "its taskset's load() failed: ConnectionError: the dataset host is unreachable"),
        ("vf-arith?num_taskz=3", "taskset.num_taskz Extra inputs are not permitted"),
        ("vf_bad.flaky:FlakyData", "'FlakyData' is not a Taskset class"),
    ],
)
def test_a_taskset_that_cannot_run_is_one_error_at_prepare(tmp_path, spec, message):
    store = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        pipeline.prepare("", [*TINY, f"store={store}", f"rollout.environment=verifiers:{spec}", "train.eval_every=0"])
    text = str(err.value)
    assert text.startswith(f"config key 'rollout.environment': verifiers:{spec}: ") and "\n" not in text
    assert message in text and not store.exists()


def test_without_the_side_venv_prepare_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_VERIFIERS_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"side venv .*nowhere, which is missing \(run scripts/setup_verifiers_venv"):
        load_records("verifiers:vf-arith", Task, 0)


# -- episodes ----------------------------------------------------------------------------------
def test_a_tool_episode_runs_through_the_proxy_as_verifiers_calls_it(tok, tool_train, monkeypatch):
    """verifiers' harness streams (`stream: true`, `include_usage`) and, on the tool turn, replays the
    assistant message with empty content and indexed tool_calls: the proxy takes both, and the episode
    is one two-turn row whose reward is the rubric's (correct 1.0 + used_tool 0.25 × 1.0)."""
    spec, train = TOOL_SPEC, tool_train
    (result,), stats, seen = play(tok, spec, train[:1], monkeypatch)
    assert result.error is None and result.reward == 1.25 and stats["episodes_failed"] == 0
    chats = [(h, b) for path, h, b in seen if path == "/v1/chat/completions"]
    assert len(chats) == 2
    assert [m["role"] for m in chats[0][1]["messages"]] == ["user"]  # the null harness: no shell, no system prompt
    for _, body in chats:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert [t["function"]["name"] for t in body["tools"]] == ["calc_add"]
    assert chats[0][0]["x-session-id"] == chats[1][0]["x-session-id"]  # verifiers' trace id
    replayed = chats[1][1]["messages"][1]
    assert replayed["role"] == "assistant" and replayed["content"] == ""
    assert replayed["tool_calls"][0]["index"] == 0 and replayed["tool_calls"][0]["function"]["name"] == "calc_add"
    assert chats[1][1]["messages"][2]["role"] == "tool"
    (row,) = result.samples
    assert row.num_turns == 2 and row.meta["tool_calls"] == 1 and row.reward == 1.25
    assert row.reward_info["rewards"] == {"correct": 1.0, "used_tool": 1.0}
    assert row.reward_info["weights"] == {"correct": 1.0, "used_tool": 0.25}
    (_, _, _, end0, _), (_, fed1, start1, _, _) = row.meta["turns"]
    assert row.loss_mask[end0:start1] == [0] * (start1 - end0) and "tool" in tok.decode(row.input_ids[fed1:start1])
    scored = rubric(spec, train[0]["meta"]["verifiers"]["idx"], messages_of(tok, row, train[0]["prompt"]))
    assert scored["reward"] == row.reward and scored["info"]["rewards"] == row.reward_info["rewards"]
    held = asyncio.run(verifiers_env.runner(spec).request({"op": "stats"}))["info"]
    assert held["clients"] == 0  # the episode's model client (its own key) was closed with it


def test_parallel_tool_calls_are_replayed_with_their_indexes(tok, tool_train, monkeypatch):
    """Two calls in one reply: verifiers replays them as tool_calls indexes 0 and 1, then a tool message
    each; the episode is still one two-turn row."""

    def two_calls(prompt_text: str) -> str:
        last = prompt_text.rsplit("<|im_start|>user\n", 1)[-1]
        if "<|im_start|>tool" in last:
            return digits_reply(prompt_text)
        a, b = re.search(r"compute (\d+) \+ (\d+)", last).groups()
        calls = [
            {"name": "calc_add", "arguments": {"a": int(a), "b": 0}},
            {"name": "calc_add", "arguments": {"a": int(a), "b": int(b)}},
        ]
        return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)

    (result,), _, seen = play(tok, TOOL_SPEC, tool_train[:1], monkeypatch, reply=two_calls)
    assert result.error is None and result.reward == 1.25  # the last tool result is the sum
    (row,) = result.samples
    assert row.num_turns == 2 and row.meta["tool_calls"] == 2
    second = [b for path, _, b in seen if path == "/v1/chat/completions"][1]["messages"]
    assert [c["index"] for c in second[1]["tool_calls"]] == [0, 1] and [m["role"] for m in second[2:]] == ["tool"] * 2


OFFLINE_EPISODE = """
import json
from areal_core.environments import load_records
from tests.test_verifiers_env import Task, play, small_tokenizer
train, _ = load_records("verifiers:vf-tool-calc?num_tasks=4", Task, 0)
(result,), _, _ = play(small_tokenizer(), "vf-tool-calc?num_tasks=4", train[:1])
print(json.dumps({"reward": result.reward, "error": result.error, "turns": result.samples[0].num_turns}))
"""


def test_a_run_needs_no_package_index(tmp_path):
    """In a network namespace with only loopback (no index reachable), prepare's records and a tool
    episode run: the harness's chat program syncs from the lock the setup script made, the tool server
    is the venv's own."""
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here (unshare -n needs root)")
    cmd = f"ip link set lo up && exec {shlex.quote(sys.executable)} -c {shlex.quote(OFFLINE_EPISODE)}"
    out = subprocess.run(["unshare", "-n", "sh", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"reward": 1.25, "error": None, "turns": 2}


def test_failing_and_nan_episodes_are_counted_and_never_rows(tok):
    """vf_bad.flaky: task 0's reward raises after the model replied (a failed episode), task 1's rubric
    is NaN (a bad reward: not trained on), task 2 is fine; the worker's counters say which."""
    spec = "vf_bad.flaky?num_tasks=3"
    tasks = sorted(load_records(f"verifiers:{spec}", type("T", (), {"num_train": 3, "num_eval": 0}), 0)[0],
                   key=lambda r: r["meta"]["verifiers"]["idx"])  # fmt: skip
    results, stats, _ = play(tok, spec, tasks, group_size=2)
    crashed, nan, fine = results[0:2], results[2:4], results[4:6]
    assert all(r.samples == [] and "the grader crashed on task 0" in r.error for r in crashed)
    assert all(
        r.samples == [] and r.error.startswith("bad reward: reward must be finite: the rubric's correct gave")
        for r in nan
    )
    assert all(r.error is None and [s.reward for s in r.samples] == [1.0] for r in fine)
    assert stats["episodes_failed"] == 2 and stats["episodes_bad_reward"] == 2 and stats["rows"] == 2


# -- whole runs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tc.save("llama", tmp_path_factory.mktemp("ckpt") / "llama")


def run_overrides(checkpoint, store, spec: str) -> list[str]:
    return [
        *TINY,
        f"store={store}",
        f"model.path={checkpoint}",
        "sft.enabled=false",
        f"rollout.environment=verifiers:{spec}",
        "train.eval_every=0",
        "train.steps=2",
        "rollout.group_size=2",
        "train.batch_groups=1",
        "rollout.max_new_tokens=6",
        "eval.num_samples=1",
        "task.num_train=8",
        "task.num_eval=2",
    ]


def graded_rows(store: Store) -> list[Sample]:
    return [s for p in store.find("trajectories/graded", ".arrow") for s in decode_shard(store.read_bytes(p))]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["vf-arith", "vf-tool-calc"])
def test_pyflyte_run_trains_on_a_verifiers_environment_to_done(checkpoint, tmp_path, spec):
    """`pyflyte run` with rollout.environment on a tiny checkpoint reaches DONE, and the reward stored
    with every sample is what the environment's rubric gives that sample's completion. A short warm
    start on vf-arith's answers makes the tiny model answer with digits, so the rubric's functions score
    some samples above zero (has_number, correct) and the check is not all zeros."""
    store_dir = tmp_path / "run"
    overrides = run_overrides(checkpoint, store_dir, spec)
    if spec == "vf-arith":
        overrides += ["sft.enabled=true", "sft.steps=40", "sft.lr=1e-2"]
    out = pyflyte("run", "workflows/grpo.py", "grpo", "--overrides", shlex.join(overrides), timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert re.search(r"held-out agent success \(.*?\): before RL [\d.]+, after RL [\d.]+", log), log[-3000:]
    store = Store(str(store_dir))
    assert store.done() and store.read_json("DONE")["step"] == 2
    prompts = {r["prompt_id"]: r for r in pq.read_table(store_dir / "prompts" / "part-00000.parquet").to_pylist()}
    rows = graded_rows(store)
    assert rows and all(s.reward_info["reward_source"] == "agent" for s in rows)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    for s in rows:
        idx = int(s.prompt_id.removeprefix("verifiers-"))
        scored = rubric(spec, idx, messages_of(tok, s, prompts[s.prompt_id]["prompt"]))
        assert math.isclose(s.reward, scored["reward"]), (s.prompt_id, s.reward, scored)
        assert s.reward_info["rewards"] == scored["info"]["rewards"]
    assert store.statuses()["rollout-0"]["episodes"] >= 2 * 2
    if spec == "vf-arith":
        assert any(s.reward > 0 for s in rows)
    names = set(rows[0].reward_info["rewards"])
    assert names == ({"correct", "has_number"} if spec == "vf-arith" else {"correct", "used_tool"})
    steps = [json.loads(line) for line in (store_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all({f"reward/{n}" for n in names} <= set(m) for m in steps)  # each logged apart


@pytest.mark.slow
def test_a_run_goes_on_past_failing_and_nan_episodes(checkpoint, tmp_path):
    """vf_bad.flaky in a whole run: a third of the tasks fail mid-rollout, a third give NaN; the run
    reaches DONE, counting both, and trains only on finite rewards from the healthy tasks."""
    run_uri, _ = pipeline.prepare("", run_overrides(checkpoint, tmp_path / "run", "vf_bad.flaky"))
    pipeline.sft(run_uri)  # sft.enabled=false: places the checkpoint as the initial model
    launch(run_uri, 1, 1, timeout_s=600, progress=False)
    store = Store(run_uri)
    assert store.done()
    status = store.statuses()["rollout-0"]
    assert status["episodes_failed"] > 0 and status["episodes_bad_reward"] > 0
    rows = graded_rows(store)
    assert rows and all(int(s.prompt_id.removeprefix("verifiers-")) % 3 == 2 for s in rows)
    assert all(math.isfinite(s.reward) for s in rows)
