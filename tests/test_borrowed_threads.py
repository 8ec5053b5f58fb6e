"""Idle cores lent to the trainer (areal_core/train/borrowed_threads.py, train.borrow_idle_cores): the count rule, the
machine readings, the hooks at every decoder layer's forward and backward, and a replay that follows the recorded
counts bit for bit."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from areal_core.train import borrowed_threads as bt
from areal_core.train.borrowed_threads import BorrowedThreads, decoder_layers, running_elsewhere, thread_count

LAYERS = 3


def tiny_qwen(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        vocab_size=128,
    )
    return Qwen2ForCausalLM(cfg)


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("cores", "base", "extra", "others", "want"),
    [
        (2, 1, 1, 0, 2),  # the other core is idle: borrowed
        (2, 1, 1, 1, 1),  # the rollout runs: given back
        (2, 1, 1, 5, 1),  # a loaded machine: never below base
        (8, 1, 3, 2, 4),  # 5 idle, at most 3 more
        (8, 2, 8, 3, 5),  # 3 idle beyond base's 2
        (4, 4, 2, 0, 4),  # base already takes every core
        (2, 1, 0, 0, 1),  # nothing to borrow
    ],
)
def test_thread_count_takes_only_the_cores_nobody_else_wants(cores, base, extra, others, want):
    assert thread_count(cores, base, extra, others) == want


def test_running_elsewhere_takes_this_process_s_running_threads_off_the_machine_s():
    loadavg = b"0.52 0.58 0.59 3/467 12345\n"
    assert running_elsewhere(loadavg, [b"R", b"S", b"S"]) == 2
    assert running_elsewhere(loadavg, [b"R", b"R", b"R", b"S"]) == 0
    assert running_elsewhere(loadavg, [b"R", b"R", b"R", b"R"]) == 0  # read at different instants: never negative
    assert running_elsewhere(b"1.0 1.0 1.0 12/900 1\n", [b"S", b"D"]) == 12


def test_the_machine_readings_see_this_thread_running():
    states = bt.own_thread_states()
    assert b"R" in states  # the reading thread itself
    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait)
    sleeper.start()
    try:
        assert len(bt.own_thread_states()) >= len(states) + 1 and b"S" in bt.own_thread_states()
    finally:
        stop.set()
        sleeper.join()
    assert bt.others_running() >= 0


def test_decoder_layers_are_found_in_the_llama_and_gpt2_layouts():
    assert len(decoder_layers(tiny_qwen())) == LAYERS
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32))
    assert len(decoder_layers(gpt2)) == 2
    assert decoder_layers(torch.nn.Linear(2, 2)) == []


def one_step(model: torch.nn.Module, borrowed: BorrowedThreads) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """One forward and backward of a fixed batch inside `borrowed.step()`: (loss, grads, the counts each layer pass
    ran at, read inside the passes)."""
    torch.manual_seed(1)
    x = torch.randint(0, 128, (6, 40))
    seen: list[int] = []
    for layer in decoder_layers(model):  # after the borrower's hooks: what the pass itself runs at
        layer.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    model.zero_grad()
    with borrowed.step():
        loss = model(x).logits.log_softmax(-1)[..., 0].mean()
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], seen


def test_every_layer_pass_chooses_and_the_step_ends_on_base_threads(monkeypatch):
    torch.set_num_threads(1)
    model = tiny_qwen()
    others = itertools.cycle([0, 1, 1])
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n, real=torch.set_num_threads: (calls.append(n), real(n)))
    monkeypatch.setattr(bt.os.path, "exists", lambda p: True)
    borrowed = BorrowedThreads.for_run(model, 1, 1, None)
    assert borrowed is not None
    borrowed._probe, borrowed.cores = lambda: next(others), 2
    _, _, seen = one_step(model, borrowed)
    # a forward and a backward per layer, the counts the probe's pattern gives: 0 others -> 2 threads, 1 -> 1
    assert borrowed.trace == [2, 1, 1] * 2
    assert seen == [2, 1, 1]  # the forwards ran at the chosen counts
    assert torch.get_num_threads() == 1 and calls[-1] == 1  # given back after the step
    assert borrowed.borrowed_share() == pytest.approx(2 / 6)
    # outside a step (evaluation, generation) nothing is chosen
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 8)))
    assert borrowed.trace == [2, 1, 1] * 2


def test_a_replay_follows_the_recorded_counts_not_the_machine():
    recorder = BorrowedThreads(1, 1, probe=itertools.cycle([0, 1]).__next__, cores=2)
    model = tiny_qwen()
    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(recorder._before_forward)
        layer.register_forward_hook(recorder._after_forward)
    loss, grads, _ = one_step(model, recorder)
    trace = list(recorder.trace)
    assert trace == [2, 1] * LAYERS

    def machine() -> int:
        raise AssertionError("a replay must not read the machine")

    replayer = BorrowedThreads(1, 1, probe=machine, cores=2)
    again = tiny_qwen()
    for layer in decoder_layers(again):
        layer.register_forward_pre_hook(replayer._before_forward)
        layer.register_forward_hook(replayer._after_forward)
    replayer.follow(trace)
    loss2, grads2, _ = one_step(again, replayer)
    assert replayer.trace == trace
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    replayer.follow(trace[:2])  # a short trace: base threads for the passes beyond it
    replayer._probe = lambda: 0
    one_step(again, replayer)
    assert replayer.trace == trace[:2] + [1] * (2 * LAYERS - 2)


def test_for_run_says_why_it_does_not_borrow(caplog):
    model = tiny_qwen()
    caplog.set_level("INFO", logger="areal.trainer")
    assert BorrowedThreads.for_run(model, 1, 0, None) is None  # off: nothing hooked, nothing said
    assert BorrowedThreads.for_run(model, 1, 1, "the decoder is compiled") is None
    assert "not used: the decoder is compiled" in caplog.text
    assert BorrowedThreads.for_run(torch.nn.Linear(2, 2), 1, 1, None) is None
    assert "no decoder layers found" in caplog.text


def test_a_followed_trace_is_clamped_and_a_mismatch_is_logged(caplog):
    model = tiny_qwen()
    follower = BorrowedThreads(1, 0, probe=lambda: 0, cores=2).hooked(model)
    follower.follow([0, 7, "2", 1, 1, 1])  # a tampered record: 0 and 7 threads are not run
    caplog.set_level("WARNING", logger="areal.trainer")
    one_step(model, follower)
    assert follower.trace == [1, 2, 2, 1, 1, 1] and "layer passes" not in caplog.text
    follower.follow([2] * 9)  # three passes too many: another model or micro-batching
    one_step(model, follower)
    assert follower.trace == [2] * 6 and "made 6 layer passes where its record names 9" in caplog.text
    follower.follow([])  # a record of a step that did not borrow: base everywhere, though the probe says idle
    one_step(model, follower)
    assert follower.trace == [1] * 6


def test_usable_cores_follow_a_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(bt.os, "sched_getaffinity", lambda pid: set(range(8)))
    real_open = open

    def cpu_max(text: str):
        def fake_open(path, *args, **kwargs):
            if path == "/sys/fs/cgroup/cpu.max":
                (tmp_path / "cpu.max").write_text(text)
                return real_open(tmp_path / "cpu.max", *args, **kwargs)
            return real_open(path, *args, **kwargs)

        return fake_open

    for text, want in (("max 100000\n", 8), ("250000 100000\n", 3), ("50000 100000\n", 1), ("2000000 100000", 8)):
        monkeypatch.setattr("builtins.open", cpu_max(text))
        assert bt.usable_cores() == want, text
    monkeypatch.setattr("builtins.open", cpu_max("garbage"))
    assert bt.usable_cores() == 8
