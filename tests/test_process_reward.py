"""Process rewards: steps parsed and checked without eval, per-step and per-token rewards."""

import json
import random
from fractions import Fraction

import pytest

from areal_core.reward.pool import RewardPool, normalize
from areal_core.reward.process import (
    UnsafeExpression,
    check_steps,
    process_reward,
    safe_eval,
    step_accuracy,
    token_end_offsets,
    wants_token_offsets,
)
from task_data import arithmetic
from tests.conftest import gsm8k_file


@pytest.mark.parametrize(
    "expr, value",
    [
        ("9+5", 14),
        ("14-8", 6),
        ("3*12", 36),
        ("48/2", 24),
        ("0.1+0.2", Fraction(3, 10)),  # exact, not 0.30000000000000004
        ("(2+3)*4", 20),
        ("-3+-2", -5),
        ("1,000*3", 3000),
        ("6 × 7 ÷ 2", 21),
        ("$5*4", 20),
        ("1/3*3", 1),
    ],
)
def test_safe_eval_arithmetic(expr, value):
    assert safe_eval(expr) == Fraction(value)


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('touch /tmp/pwned')",
        "open('/etc/passwd')",
        "2**100000",
        "10//3",
        "x+1",
        "(1).__class__",
        "[1,2]",
        "1 if 1 else 2",
        "lambda: 1",
        "1/0",
        "(" * 100 + "1" + ")" * 99,  # too long / unbalanced
        "",
        "1+" * 40 + "1",  # too many nodes
        "1e5",
    ],
)
def test_safe_eval_refuses_everything_else(expr):
    with pytest.raises(UnsafeExpression):
        safe_eval(expr)


def test_gsm8k_annotations_check_out():
    """Every calculator annotation of the GSM8K test references checks out (one of them,
    `<<3/4=3/4>>`, claims a fraction)."""
    rows = [json.loads(line) for line in gsm8k_file("test").read_text().splitlines() if line]
    steps = [s for r in rows for s in check_steps(r["answer"])]
    assert len(steps) == 4282
    assert all(s.kind == "annotation" for s in steps)
    assert sum(s.ok is True for s in steps) == 4282


def test_arithmetic_task_lines_are_steps():
    train, _ = arithmetic.generate(seed=3, num_train=200, num_eval=0, ops="+-*", max_steps=3)
    for rec in train:
        steps = check_steps(rec["answer"])
        assert len(steps) == rec["meta"]["steps"]
        assert all(s.ok and s.kind == "line" for s in steps)
        assert process_reward(rec["answer"], rec["answer"])["reward"] == 1.0


def test_a_wrong_step_costs_and_is_located():
    text = "9+5=15\n15-8=7\n#### 7"
    out = process_reward(text, "#### 7", step_weight=0.5)
    info = out["info"]
    assert info["step_rewards"] == [0.0, 1.0]
    assert info["steps_checked"] == 2 and info["steps_wrong"] == 1
    assert out["reward"] == pytest.approx(1.0 - 0.5 * 1 / 2)
    first = info["steps"][0]
    assert text[first["start"] : first["end"]] == "9+5=15"
    assert "is 14, not 15" in first["reason"]


def test_correct_steps_never_lift_a_wrong_answer():
    spam = "1+1=2\n" * 20 + "#### 5"
    assert process_reward(spam, "#### 6")["reward"] == 0.0
    assert process_reward("9+5=14\n#### 14", "#### 6")["reward"] == 0.0
    assert process_reward("9+5=13\n#### 13", "#### 6")["reward"] == -0.5


def test_rounded_and_fraction_claims():
    assert [s.ok for s in check_steps("<<10/3=3.33>> <<10/3=3.3>> <<10/3=3>> <<3/4=3/4>> <<1/3=0.34>>")] == [
        True,
        True,
        False,
        True,
        False,
    ]


def test_unsafe_steps_are_unchecked_not_run(tmp_path):
    marker = tmp_path / "pwned"
    text = f"<<__import__('pathlib').Path('{marker}').touch()=0>>\n<<2**10=1024>>\n#### 3"
    out = process_reward(text, "#### 3")
    assert not marker.exists()
    assert out["info"]["steps_unchecked"] == 2 and out["info"]["steps_checked"] == 0
    assert out["info"]["step_rewards"] == [None, None]
    assert out["reward"] == 1.0


def test_prose_is_not_a_step():
    assert check_steps("She had 5 = 5 apples.\nIn 2023 it cost 4 dollars.\n#### 4") == []


def test_token_rewards_land_on_step_tokens_and_sum_to_reward():
    text = "9+5=15\n15-8=7\n#### 7"
    offsets = list(range(1, len(text) + 1))  # one character per token
    out = process_reward(text, "#### 7", token_offsets=offsets, prompt_len=3, step_weight=0.5)
    tr = out["token_rewards"]
    assert len(tr) == 3 + len(text)
    assert tr[:3] == [0.0, 0.0, 0.0]
    assert sum(tr) == pytest.approx(out["reward"])
    assert tr[3 + len("9+5=15") - 1] == pytest.approx(-0.25)  # the wrong step's last character
    assert tr[-1] == 1.0  # the outcome, on the last token
    assert sum(1 for v in tr if v != 0) == 2


def test_token_rewards_with_multi_char_tokens():
    text = "9+5=15\n#### 15"
    offsets = [2, 4, 6, 7, 12, len(text)]  # '9+' '5=' '15' '\n' '#### ' '15'
    out = process_reward(text, "#### 14", token_offsets=offsets, prompt_len=0, step_weight=1.0)
    assert out["token_rewards"] == [0.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    assert out["reward"] == -1.0


class CharTokenizer:
    """Char-level ids; `merge` ids decode to 'ab' alone but 'b' after 'a' (like sentencepiece spaces)."""

    def __init__(self, glitch=False):
        self.glitch = glitch

    def decode(self, ids, skip_special_tokens=True):
        out = ""
        for i, t in enumerate(ids):
            if t == 0:
                continue  # a special token
            ch = chr(t)
            if self.glitch and ch == " " and i == 0:
                ch = ""  # a leading space vanishes when decoded alone
            out += ch
        return out


def test_token_end_offsets_fast_and_exact_paths():
    ids = [ord(c) for c in "ab cd"] + [0]
    assert token_end_offsets(CharTokenizer(), ids) == [1, 2, 3, 4, 5, 5]
    glitchy = [ord(c) for c in "a b"]
    # per-token decodes ('a', '', 'b') do not add up to 'a b': prefix decoding is used
    assert token_end_offsets(CharTokenizer(glitch=True), glitchy) == [1, 2, 3]


def test_step_accuracy_alone():
    assert step_accuracy("9+5=14\n14-8=7") == 0.5
    assert step_accuracy("no steps here") == 0.0


def sample_process_reward(completion, reference, token_offsets=None, prompt_len=0):
    return process_reward(completion, reference, token_offsets, prompt_len, step_weight=0.2)


def test_process_reward_through_the_pool():
    rng = random.Random(0)
    train, _ = arithmetic.generate(seed=1, num_train=20, num_eval=0, ops="+-", max_steps=2)
    jobs, broken = [], []
    for rec in train:
        text = rec["answer"]
        broken.append(rng.random() < 0.5)
        if broken[-1]:
            text = text.replace("=", "=1", 1)  # break the first step
        jobs.append(
            {
                "completion": text,
                "reference": rec["answer"],
                "prompt_id": rec["prompt_id"],
                "token_offsets": list(range(1, len(text) + 1)),
                "prompt_len": 2,
            }
        )
    with RewardPool("tests.test_process_reward:sample_process_reward", size=2, timeout_s=60) as pool:
        results = pool.grade(jobs)
    assert len(results) == 20
    assert 0 < sum(broken) < 20
    for job, res, bad in zip(jobs, results, broken):
        direct = normalize(sample_process_reward(**{k: job[k] for k in ("completion", "reference")}))
        assert res.reward == pytest.approx(direct.reward)
        assert len(res.token_rewards) == 2 + len(job["completion"])
        assert sum(res.token_rewards) == pytest.approx(res.reward)
        assert res.info["steps_wrong"] == int(bad)
        assert res.reward == pytest.approx(1.0 - 0.2 * bad / res.info["steps_checked"])


def test_wants_token_offsets():
    assert wants_token_offsets("areal_core.reward.process:process_reward")
    assert wants_token_offsets(sample_process_reward)
    assert not wants_token_offsets("areal_core.reward.math:gsm8k_reward")


def test_worker_style_grading_with_the_project_tokenizer(tmp_path):
    """What the reward worker does: decode, offsets, pool, labels, then a valid graded shard."""
    from areal_core.models import build_tokenizer
    from areal_core.protocol import Sample, read_shard_or_quarantine, write_shard
    from areal_core.reward.labels import apply_labels
    from areal_core.store import Store

    train, _ = arithmetic.generate(seed=2, num_train=50, num_eval=0, ops="+-", lo=1, hi=9, max_steps=2)
    tok = build_tokenizer([r["prompt"] + "\n" + r["answer"] for r in train], vocab_size=300)
    rec = next(r for r in train if r["meta"]["steps"] == 2)
    first, rest = rec["answer"].split("\n", 1)
    a, b = first.split("=")
    wrong = f"{a}={int(b) + 1}\n{rest}"  # first step wrong, final answer right
    prompt_ids = tok.encode(rec["prompt"])
    samples = []
    for k, text in enumerate([rec["answer"], wrong]):
        resp = tok.encode(text) + [tok.eos_token_id]
        n = len(prompt_ids) + len(resp)
        samples.append(
            Sample(
                f"s{k}",
                "g",
                rec["prompt_id"],
                "w",
                prompt_ids + resp,
                len(prompt_ids),
                [0] * len(prompt_ids) + [1] * len(resp),
                [0.0] * n,
                [-1] * len(prompt_ids) + [0] * len(resp),
            )
        )
    jobs = []
    for s in samples:
        ids = s.response_ids()
        completion = tok.decode(ids, skip_special_tokens=True)
        offsets = token_end_offsets(tok, ids)
        assert len(offsets) == len(ids) and offsets[-1] == len(completion)
        jobs.append(
            {"completion": completion, "reference": rec["answer"], "token_offsets": offsets, "prompt_len": s.prompt_len}
        )
    with RewardPool("areal_core.reward.process:process_reward", size=1, timeout_s=60) as pool:
        results = pool.grade(jobs)
    for s, r in zip(samples, results):
        s.reward, s.token_rewards, s.reward_info = r.reward, r.token_rewards, r.info
    apply_labels(samples, [{"prompt_id": "other", "reward": 0.0}])  # no match: nothing changes
    store = Store(str(tmp_path / "run"))
    write_shard(store, "trajectories/graded/w/00000000.arrow", samples)  # validates token_rewards' length
    back = read_shard_or_quarantine(store, "trajectories/graded/w/00000000.arrow")
    assert [s.reward for s in back] == [1.0, 0.75]
    good, bad = back
    assert good.token_rewards == [0.0] * (len(good.input_ids) - 1) + [1.0]
    nonzero = [i for i, v in enumerate(bad.token_rewards) if v]
    assert len(nonzero) == 2 and bad.token_rewards[-1] == 1.0
    # the penalty sits on the token that ends the wrong step's claimed value
    i = nonzero[0] - bad.prompt_len
    step_end = len(f"{a}={int(b) + 1}")
    assert tok.decode(bad.response_ids()[: i + 1]).endswith(str(int(b) + 1)[-1])
    assert len(tok.decode(bad.response_ids()[:i])) < step_end <= len(tok.decode(bad.response_ids()[: i + 1]))
    assert bad.token_rewards[nonzero[0]] == pytest.approx(-0.25)
