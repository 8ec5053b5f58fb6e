from areal_core.staleness import (
    admission_capacity,
    groups_admissible,
    is_fresh,
    min_allowed_version,
    staleness_histogram,
    worker_share,
)


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


def test_hard_bound():
    assert min_allowed_version(5, 2) == 3
    assert is_fresh(3, 5, 2) and not is_fresh(2, 5, 2)
    assert is_fresh(5, 5, 0) and not is_fresh(4, 5, 0)


def test_histogram_counts_staleness():
    assert staleness_histogram([5, 5, 4, 3], 5) == {0: 2, 1: 1, 2: 1}
