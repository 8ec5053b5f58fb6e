from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, write_shard
from areal_core.rollout.admission import (
    Admission,
    group_id,
    prompt_for_group,
    prompt_order,
    recover_progress,
)
from areal_core.staleness import (
    admission_capacity,
    groups_admissible,
    is_fresh,
    live_worker_share,
    min_allowed_version,
    staleness_histogram,
    worker_share,
)
from areal_core.store import Store


def test_admission_capacity_is_v_plus_eta_plus_one_batches():
    assert admission_capacity(0, 0, 8) == 8
    assert admission_capacity(3, 2, 8) == 48


def test_eta_zero_admits_exactly_one_batch_per_version():
    assert groups_admissible(0, 0, 0, 4, 0, 1) == 4
    assert groups_admissible(4, 0, 0, 4, 0, 1) == 0
    assert groups_admissible(4, 1, 0, 4, 0, 1) == 4


def test_discarded_groups_give_their_admission_back():
    # η = 0, B = 4: four groups started at v0, the trainer filtered 3 of them
    assert groups_admissible(4, 0, 0, 4, 0, 1) == 0
    assert groups_admissible(4, 0, 0, 4, 0, 1, discarded=3) == 3
    assert admission_capacity(2, 1, 4, discarded=5) == 4 * 4 + 5
    # split across workers like the rest of the capacity
    assert sum(groups_admissible(0, 0, 0, 4, i, 3, discarded=5) for i in range(3)) == 9


def test_worker_shares_split_the_total():
    shares = [worker_share(10, i, 3) for i in range(3)]
    assert shares == [4, 3, 3] and sum(shares) == 10
    assert sum(groups_admissible(0, 1, 1, 5, i, 4) for i in range(4)) == 15


def test_a_retired_workers_share_goes_to_the_live_workers():
    # W = 3, 20 groups in all; worker 1 left holding 4: the other 16 split between workers 0 and 2
    assert [live_worker_share(20, i, 3, {1: 4}) for i in (0, 2)] == [8, 8]
    assert [live_worker_share(21, i, 3, {}) for i in range(3)] == [7, 7, 7]  # none retired: as before
    assert live_worker_share(20, 0, 3, {1: 4, 2: 5}) == 11  # the last one left: all the others do not hold
    assert groups_admissible(8, 1, 1, 4, 0, 2) == 0  # (1 + 1 + 1)·4 = 12 over 2: worker 0 is blocked
    assert groups_admissible(8, 1, 1, 4, 0, 2, retired={1: 0}) == 4  # worker 1 left holding none


def test_a_blocked_worker_reads_the_retired_workers_and_starts_their_share(tmp_path):
    retired: dict[int, int] = {}
    clock = Clock()
    kw = dict(num_prompts=50, seed=1, batch_groups=4, eta=0, worker_index=0, num_workers=2)
    adm = Admission(**kw, read_retired=lambda: dict(retired), reread_every_s=1.0, clock=lambda: clock.t)
    for _ in range(adm.room(0)):
        adm.start()
    assert adm.started == 2 and adm.room(0) == 0
    retired[1] = 0  # worker 1 is out of the run, holding no group
    assert adm.room(0) == 0  # read again only after reread_every_s
    clock.t = 1.0
    assert adm.room(0) == 2 and adm.retired == {1: 0}


def test_hard_bound():
    assert min_allowed_version(5, 2) == 3
    assert is_fresh(3, 5, 2) and not is_fresh(2, 5, 2)
    assert is_fresh(5, 5, 0) and not is_fresh(4, 5, 0)


def test_histogram_counts_staleness():
    assert staleness_histogram([5, 5, 4, 3], 5) == {0: 2, 1: 1, 2: 1}


# -- the Admission object of one rollout worker (rollout/admission.py) --------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_admission_capacity_split_across_workers():
    """(v + η + 1)·B over W workers: each worker starts its share, and no more until v moves."""
    adms = [Admission(num_prompts=10, seed=0, batch_groups=5, eta=1, worker_index=i, num_workers=2) for i in range(2)]
    assert [a.room(0) for a in adms] == [5, 5]
    for a in adms:
        for _ in range(a.room(0)):
            a.start()
    assert [a.room(0) for a in adms] == [0, 0] and [a.room(1) for a in adms] == [3, 2]
    off = Admission(num_prompts=10, seed=0, batch_groups=1, eta=0, enabled=False)
    off.start()
    assert off.room(0) > 1000


def test_discarded_credit_is_reread_only_while_blocked_and_at_most_every_interval():
    reads = []
    discarded = {"n": 0}

    def read() -> int:
        reads.append(clock.t)
        return discarded["n"]

    clock = Clock()
    adm = Admission(num_prompts=8, seed=0, batch_groups=2, eta=0, read_discarded=read, reread_every_s=0.1, clock=clock)
    assert reads == [0.0]  # once at start
    assert adm.room(0) == 2 and reads == [0.0]  # not blocked: no read
    adm.start(), adm.start()
    discarded["n"] = 1  # the trainer discarded a group
    for _ in range(4):  # blocked, but within the interval: no read, no room
        clock.t += 0.02
        assert adm.room(0) == 0
    assert reads == [0.0]
    clock.t = 0.1
    assert adm.room(0) == 1 and reads == [0.0, 0.1]  # the credit comes back after one read
    adm.start()
    clock.t = 0.15
    assert adm.room(0) == 0 and len(reads) == 2  # blocked again, too soon to read
    clock.t = 0.2
    assert adm.room(0) == 0 and len(reads) == 3


def test_prompt_order_is_a_fixed_shuffle_interleaved_across_workers():
    order = prompt_order(12, seed=3)
    assert sorted(order) == list(range(12)) and order == prompt_order(12, seed=3) and order != list(range(12))
    firsts = [prompt_for_group(order, 0, w, 3) for w in range(3)]
    assert firsts == order[:3]  # group 0 of workers 0, 1, 2
    assert prompt_for_group(order, 1, 0, 3) == order[3] and prompt_for_group(order, 4, 0, 3) == order[0]


def _write_groups(store: Store, worker: str, seq: int, groups: list[int]) -> None:
    rows = [
        Sample(f"{group_id(worker, g)}-0", group_id(worker, g), "p", worker, [1, 2], 1, [0, 1], [0.0, -0.1], [-1, 0])
        for g in groups
    ]
    write_shard(store, LAYOUT.shard("ungraded", worker, seq), rows)


def test_restart_recovery_gives_the_same_sequence_numbers_and_prompt_order(tmp_path):
    store = Store(str(tmp_path / "run"))
    kw = dict(num_prompts=50, seed=1, batch_groups=4, eta=1, worker_index=1, num_workers=2)
    straight = Admission(**kw)
    expected = [straight.start() for _ in range(6)]
    # a worker wrote groups 0-1 and 3 (2 was in flight when it died), then a torn shard
    _write_groups(store, "rollout-1", 0, [0, 1])
    _write_groups(store, "rollout-1", 1, [3])
    store.write_bytes(LAYOUT.shard("ungraded", "rollout-1", 2), b"torn")
    progress = recover_progress(store, "rollout-1")
    assert progress.next_seq == 2 and progress.groups == {0, 1, 3}  # the torn shard is rewritten
    restarted = Admission(**kw, progress=progress)
    assert restarted.started == 3
    assert restarted.start() == expected[2]  # the lost group first, on its own prompt
    assert [restarted.start() for _ in range(2)] == expected[4:6]
    assert restarted.started == 6 and restarted.room(2) == worker_share(16, 1, 2) - 6  # (2 + 1 + 1)·4 over 2
    assert recover_progress(store, "rollout-9").next_seq == 0
