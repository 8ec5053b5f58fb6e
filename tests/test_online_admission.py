"""Online mode's admission (issue 26): a serving proxy writing sessions into a run root opens no new
session while (η + 1)·B·G of its rows wait for the trainer; the trainer settles every row it reads
(trained, dropped or left out) and publishes the totals; open sessions are never cut off."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from areal_core.config import load_config
from areal_core.events import EventLog
from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, write_shard
from areal_core.proxy.backpressure import SessionAdmission, TrainerBehind, admission_bound, count_written
from areal_core.staleness import sessions_admissible
from areal_core.store import Store

MODEL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1"]
KEY = "sk-admission"


def row(i: int, versions: list[int], worker: str = "proxy-0", reward: float = 1.0, prompt_id: str = "") -> Sample:
    n = len(versions)
    return Sample(
        f"s{i}", f"sess-{i}", prompt_id, worker, list(range(1, n + 2)), 1, [0] + [1] * n, [0.0] + [-0.1] * n,
        [-1, *versions], reward=reward,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("written", "settled", "eta", "rows", "expected"),
    [
        (0, 0, 0, 4, 4),  # η = 0: one batch may wait
        (0, 0, 2, 4, 12),  # (η + 1)·B·G
        (5, 0, 2, 4, 7),
        (12, 0, 2, 4, 0),  # at the bound
        (30, 0, 2, 4, 0),  # beyond it (a restarted proxy): never negative
        (30, 20, 2, 4, 2),  # settled rows give their places back
        (3, 10, 0, 4, 11),  # settled ahead of written (a proxy restarted on an old count)
    ],
)
def test_sessions_admissible_by_hand(written, settled, eta, rows, expected):
    assert sessions_admissible(written, settled, eta, rows) == expected


def test_admission_bound_is_eta_plus_one_batches():
    assert [admission_bound(eta, 8) for eta in (0, 1, 4)] == [8, 16, 40]


def test_live_sessions_settle_every_row_once_per_proxy_and_publish_the_totals(tmp_path):
    """v = 3, η = 1, B·G = 4: of proxy-0's 6 rows 4 train, 1 is left out (reward out of range) and 1
    waits; proxy-1's 2 rows are too old (dropped). Settled: proxy-0 5, proxy-1 2; the row that waits is
    not settled until it trains; the totals ride in the checkpoint state."""
    from areal_core.online.live_sessions import LiveSessions
    from areal_core.train.checkpoint import TrainerState

    store = Store(str(tmp_path / "run"))
    cfg = load_config(None, [*MODEL, "train.batch_groups=2", "rollout.group_size=2", "train.eta=1"])
    ours = [row(i, [3]) for i in range(5)] + [row(5, [3], reward=1e6)]
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 0), ours)
    write_shard(store, LAYOUT.shard("graded", "proxy-1", 0), [row(10, [0], "proxy-1"), row(11, [1], "proxy-1")])
    state = TrainerState(version=3)
    source = LiveSessions(store, cfg, state, EventLog(None, "trainer", "0"))
    batch = source.next_batch(state)
    assert len(batch.samples) == 4 and len(batch.dropped) == 2 and len(source.pending()) == 1
    assert store.read_json(LAYOUT.live_settled) == {"rows": {"proxy-0": 5, "proxy-1": 2}}
    source.save_into(state)
    assert state.settled == {"proxy-0": 5, "proxy-1": 2}
    again = LiveSessions(store, cfg, state, EventLog(None, "trainer", "0"), pending=source.pending())
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 1), [row(20 + i, [3]) for i in range(3)])
    assert len(again.next_batch(state).samples) == 4  # the waiting row and three new ones
    assert store.read_json(LAYOUT.live_settled) == {"rows": {"proxy-0": 9, "proxy-1": 2}}


def test_settled_rows_survive_a_checkpoint_and_a_damaged_count_skips_it(tmp_path):
    from areal_core.models import build_tiny_model
    from areal_core.train import checkpoint
    from areal_core.train.checkpoint import CheckpointError, TrainerState

    store = Store(str(tmp_path / "run"))
    model = build_tiny_model(load_config(None, MODEL).model, 50, seed=1)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(store, TrainerState(step=2, version=2, settled={"proxy-0": 7}), model, opt, [])
    state, _ = checkpoint.restore(store, model, opt)
    assert state.settled == {"proxy-0": 7}
    # a checkpoint written before the field existed restores with nothing settled
    name = LAYOUT.checkpoint_file(2, checkpoint.STATE_FILE)
    record = store.read_json(name)
    record.pop("settled")
    _rewrite(store, 2, name, record)
    assert checkpoint.restore(store, model, opt)[0].settled == {}
    record["settled"] = {"proxy-0": "seven"}  # crafted: refused, and with no other checkpoint, said so
    _rewrite(store, 2, name, record)
    skipped: list = []
    with pytest.raises(CheckpointError, match="none of the committed checkpoints"):
        checkpoint.restore(store, model, opt, skipped=skipped)
    assert skipped and "does not load" in skipped[0][1]


def _rewrite(store: Store, step: int, name: str, record: dict) -> None:
    """Rewrite a checkpoint's state.json and its manifest entry (as a writer that can sign would)."""
    from areal_core.manifest import make_manifest
    from areal_core.train import checkpoint

    store.write_json(name, record)
    folder = LAYOUT.checkpoint_dir(step)
    files = {
        rel.rsplit("/", 1)[-1]: store.read_bytes(rel)
        for rel in store.find(folder)
        if rel.rsplit("/", 1)[-1] not in (checkpoint.MANIFEST_NAME, LAYOUT.committed_name)
    }
    store.write_json(LAYOUT.checkpoint_file(step, checkpoint.MANIFEST_NAME), make_manifest(files, step=step))


def admission(store: Store, bound: int = 4, written: int | None = None) -> SessionAdmission:
    return SessionAdmission(store, "proxy-0", bound=bound, written=written, background=False)


def test_session_admission_refuses_at_the_bound_and_reopens_when_the_trainer_settles(tmp_path):
    store = Store(str(tmp_path / "run"))
    adm = admission(store)
    adm.add_written(9)
    adm.refresh()
    adm.check()  # no live_settled.json: no continuous trainer reads this root (yet), nothing to wait for
    store.write_json(LAYOUT.live_settled, {"rows": {}})  # the continuous trainer started
    adm.refresh()
    with pytest.raises(TrainerBehind, match=r"9 session rows of this proxy wait to be trained \(bound 4\)"):
        adm.check()
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-1": 9}})  # another proxy's rows: no help
    adm.refresh()
    with pytest.raises(TrainerBehind):
        adm.check()
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 6, "proxy-1": 9}})
    adm.refresh()
    adm.check()
    assert adm.waiting() == 3 and adm.refused == 2
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 2}})  # a trainer restored from an older
    adm.refresh()  # checkpoint: the latest count is taken, which only makes the proxy stricter
    with pytest.raises(TrainerBehind):
        adm.check()
    store.write_json(LAYOUT.done, {"step": 4})  # the run is over: nobody will settle anything more
    adm.refresh()
    adm.check()
    assert not adm.active


@pytest.mark.parametrize(
    "damage",
    [
        b"not json",
        b'{"rows": [1, 2]}',
        b'{"rows": {"proxy-0": "many"}}',
        b'{"rows": {"proxy-0": 1e999}}',  # JSON's inf: int() of it would raise OverflowError
        b'{"rows": {"proxy-0": 99999999999999999999999}}',  # would switch the bound off for good
        b'{"rows": {"proxy-0": -3}}',
        b'{"rows": {"proxy-0": true}}',
        b'{"rows": {"proxy-0": 2.5}}',
        b"[]",
        b'{"other": 1}',
    ],
)
def test_a_damaged_settled_file_keeps_the_last_count_and_never_raises_but_trainer_behind(tmp_path, damage):
    store = Store(str(tmp_path / "run"))
    adm = admission(store, written=5)
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 2}})
    adm.refresh()
    adm.check()
    store.write_bytes(LAYOUT.live_settled, damage)
    adm.refresh()
    assert adm.waiting() == 3 and adm.active  # the last good count
    adm.add_written(1)
    with pytest.raises(TrainerBehind):
        adm.check()


def test_an_unreadable_store_keeps_the_last_count(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "run"))
    adm = admission(store, written=5)
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 4}})
    adm.refresh()

    def outage(*_a, **_k):
        raise OSError("store unreachable")

    monkeypatch.setattr(store, "read_json", outage)
    adm.refresh()  # logged, never raised into a request
    assert adm.waiting() == 1 and adm.active


def test_the_background_thread_follows_the_trainer(tmp_path):
    store = Store(str(tmp_path / "run"))
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 0}})
    adm = SessionAdmission(store, "proxy-0", bound=2, poll_s=0.02, written=2)
    try:
        deadline = time.time() + 120
        while not adm.active and time.time() < deadline:
            time.sleep(0.02)
        with pytest.raises(TrainerBehind):
            adm.check()
        store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 1}})
        while adm.settled != 1 and time.time() < deadline:
            time.sleep(0.02)
        adm.check()
    finally:
        adm.close()


def test_a_restarted_proxy_counts_the_rows_its_shards_hold(tmp_path):
    """Graded and ungraded shards of this proxy, a graded twin counted once, a corrupt shard as 0,
    other proxies' shards not at all."""
    store = Store(str(tmp_path / "run"))
    write_shard(store, LAYOUT.shard("ungraded", "proxy-0", 0), [row(0, [0], reward=None), row(1, [0], reward=None)])
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 0), [row(0, [0]), row(1, [0])])  # its graded twin
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 1), [row(2, [0]), row(3, [0]), row(4, [0])])
    store.write_bytes(LAYOUT.shard("graded", "proxy-0", 2), b"ARROW1 not a shard")
    write_shard(store, LAYOUT.shard("graded", "proxy-1", 0), [row(9, [0], "proxy-1")])
    assert count_written(store, "proxy-0") == 5
    assert admission(store).written == 5


def test_the_bound_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="must be >= 1"):
        admission(Store(str(tmp_path)), bound=0)


def test_the_proxy_answers_429_to_a_new_session_while_the_trainer_is_behind_and_serves_open_ones(tmp_path):
    """Over real HTTP with the openai SDK: bound 3 rows. A long session stays open (it holds a row of
    the bound) and two sessions end (2 rows written); a fourth session gets a 429 (code
    trainer_behind, a Retry-After) while the session opened before the bound goes on turn after turn;
    once the trainer settles the rows, new sessions open again. /health reports the rows waiting,
    the bound and the refusals."""
    import openai

    from areal_core.models import build_tiny_model, build_tokenizer, save_pretrained
    from areal_core.proxy.__main__ import build_app, parse_args
    from areal_core.proxy.examples import calculator_corpus
    from areal_core.proxy.runner import ProxyServer
    from task_data.arithmetic import generate

    train, _ = generate(1, 50, 10, ops="+-", lo=1, hi=9, max_steps=1)
    tok = build_tokenizer(calculator_corpus(train), 300)
    folder = tmp_path / "model"
    save_pretrained(build_tiny_model(load_config(None, MODEL).model, len(tok), seed=1), tok, folder)
    run = Store(str(tmp_path / "run"))
    run.write_json(LAYOUT.live_settled, {"rows": {}})  # a continuous trainer reads this root
    flags = ["--max-waiting-rows", "3", "--poll-interval-s", "0.05"]
    args = parse_args(["--model", str(folder), "--store", run.uri, "--api-key", KEY, *flags])
    with ProxyServer(build_app(args)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
        http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

        def turn(sid: str) -> None:
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "1 + 2 ="}], max_tokens=4,
                extra_headers={"X-Session-Id": sid},
            )  # fmt: skip

        turn("long")  # opened before the bound is reached
        for sid in ("a", "b"):
            turn(sid)
            assert http.post(f"/v1/sessions/{sid}/end", json={"reward": 1.0}).status_code == 200
        with pytest.raises(openai.RateLimitError) as refused:
            turn("c")
        assert refused.value.status_code == 429 and refused.value.code == "trainer_behind"
        assert refused.value.response.headers["retry-after"] == "1"
        assert "3 session rows of this proxy wait to be trained (bound 3)" in refused.value.message
        turn("long")  # an open session is never refused
        health = http.get("/health").json()
        held = {"held_rows": 2}  # "long", whose two turns are two conversations: two rows
        assert health["admission"] == {"active": True, "waiting_rows": 2, "bound": 3, "refused_sessions": 1, **held}
        run.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 2}})  # the trainer caught up
        deadline = time.monotonic() + 120  # the admission thread reads it at its next poll
        while http.get("/health").json()["admission"]["waiting_rows"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        turn("c")
        assert http.post("/v1/sessions/long/end", json={"reward": 0.0}).status_code == 200
        health = http.get("/health").json()
        assert health["admission"]["waiting_rows"] == health["sessions"]["rows_written"] - 2 >= 1  # long's rows


def test_rows_that_will_never_train_are_settled_to_the_proxy_whose_folder_held_them(tmp_path):
    """η = 0, B·G = 4, so one unsettled row would leave the proxy refusing sessions while the trainer
    waits for its fourth: a duplicate of a row already read, every row of a shard quarantined for its
    values (here a reward that is not finite), and rows naming another worker in proxy-0's folder
    are all settled to proxy-0."""
    from areal_core.online.live_sessions import LiveSessions
    from areal_core.protocol import encode_shard
    from areal_core.train.checkpoint import TrainerState

    store = Store(str(tmp_path / "run"))
    cfg = load_config(None, [*MODEL, "train.batch_groups=2", "rollout.group_size=2", "train.eta=0"])
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 0), [row(0, [0]), row(1, [0], worker="elsewhere")])
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 1), [row(0, [0])])  # a copy of s0
    bad = bytearray(encode_shard([row(2, [0]), row(3, [0])]))
    store.write_bytes(LAYOUT.shard("graded", "proxy-0", 2), bytes(bad))
    state = TrainerState(version=0)
    source = LiveSessions(store, cfg, state, EventLog(None, "trainer", "0"))
    monkey_bad_shard(store, LAYOUT.shard("graded", "proxy-0", 2))
    assert source.next_batch(state).samples is None  # 2 rows wait: too few for a step
    settled = store.read_json(LAYOUT.live_settled)["rows"]
    assert settled == {"proxy-0": 3}  # the duplicate and the quarantined shard's 2 rows
    assert state.counters.quarantined_shards == 1 and state.counters.duplicate_samples == 1
    write_shard(store, LAYOUT.shard("graded", "proxy-0", 3), [row(4, [0]), row(5, [0])])
    assert len(source.next_batch(state).samples) == 4
    assert store.read_json(LAYOUT.live_settled)["rows"] == {"proxy-0": 7}  # every row proxy-0 wrote


def monkey_bad_shard(store: Store, rel: str) -> None:
    """Rewrite a shard with a reward column of NaN: it parses, and the trainer quarantines it."""
    import pyarrow as pa

    from areal_core.ipc_reader import read_ipc_file

    table = read_ipc_file(store.read_bytes(rel), 100)
    i = table.schema.get_field_index("reward")
    table = table.set_column(i, "reward", pa.array([float("nan")] * table.num_rows, table.schema.field(i).type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    store.write_bytes(rel, sink.getvalue().to_pybytes())


def test_a_proxy_writing_into_a_fork_starts_after_the_parent_s_shards(tmp_path):
    """The fork's trainer starts from the parent's consumed list: a session shard named like one of
    the parent's would never be read. The writer starts after the fork cursor of its worker."""
    from areal_core.forks import ForkRef, WorkerCursor, write_fork
    from areal_core.proxy.shards import ShardWriter

    child = Store(str(tmp_path / "child"))
    ref = ForkRef("file:///parent", 3, 3, {}, {"proxy-0": WorkerCursor(next_seq=7, groups=[])})
    write_fork(child, ref)
    writer = ShardWriter(child, "proxy-0")
    try:
        assert writer.write([row(0, [3])]) == [LAYOUT.shard("graded", "proxy-0", 7)]
        assert ShardWriter(child, "proxy-1").seq == 0  # a worker the parent never had
    finally:
        writer.close()


# -- issue 46: admission bounds rows, counts from the store are untrusted ----------------------------
def test_sessions_opened_at_once_each_hold_a_row_of_the_bound(tmp_path):
    """60 sessions opened before any row is written, bound 8: 8 open, the rest are refused (each
    open session will write at least one row when it ends)."""
    from areal_core.proxy.manager import SessionManager

    store = Store(str(tmp_path / "run"))
    store.write_json(LAYOUT.live_settled, {"rows": {}})
    adm = admission(store, bound=8)
    adm.refresh()
    manager = SessionManager(template=None, admission=adm)
    opened, refused = 0, 0
    for i in range(60):
        try:
            manager.open(f"s{i}", f"key-{i % 3}")
            opened += 1
        except TrainerBehind:
            refused += 1
    assert (opened, refused) == (8, 52)


@pytest.mark.parametrize("forged", [2**50, 10**6])
def test_a_forged_settled_count_is_never_believed_past_the_rows_written(tmp_path, forged):
    store = Store(str(tmp_path / "run"))
    adm = admission(store, written=10)
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": forged}})
    adm.refresh()
    assert adm.settled == 10  # not the forged count: admission stays on
    adm.add_written(4)  # one bound's worth more, then it holds again
    with pytest.raises(TrainerBehind):
        adm.check()


@pytest.mark.parametrize("damage", [b'{"rows": {"proxy-0": 3}, "pad": "' + b"x" * (2 << 20) + b'"}', b"[" * 200_000])
def test_an_oversized_or_deep_settled_file_keeps_the_last_count(tmp_path, damage):
    store = Store(str(tmp_path / "run"))
    adm = admission(store, written=5)
    store.write_json(LAYOUT.live_settled, {"rows": {"proxy-0": 2}})
    adm.refresh()
    store.write_bytes(LAYOUT.live_settled, damage)
    adm.refresh()
    assert adm.settled == 2 and adm.active


@pytest.mark.parametrize("damage", [b"[" * 200_000, b'{"champion_score": 0.5, "offers": []' + b" " * (65 << 20) + b"}"])
def test_a_deep_or_oversized_promotion_record_is_refused_by_name_not_a_crash(tmp_path, damage):
    from areal_core.online.promotion import PromotionGate

    store = Store(str(tmp_path / "run"))
    store.write_bytes(LAYOUT.promotions, damage)
    with pytest.raises(ValueError, match="promotions.json is damaged"):
        PromotionGate(store, "m", "")
