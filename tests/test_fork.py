"""Fork (areal_core/run/fork.py): a child root continues a run from its checkpoint at step k, to
DONE, on the weights v_k, reading the parent's remaining shards by reference; the parent root
is left as it was but for its lineage record; lineage in both roots and in MLflow; bad forks
are refused in one line and write nothing. On S3, through the Flyte workflow as pods."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys

import pytest

from areal_core.dataset import samples_table
from areal_core.forks import ForkRef, WorkerCursor, on_lineage, read_fork, write_fork
from areal_core.layout import LAYOUT
from areal_core.protocol import Sample, decode_shard, write_shard
from areal_core.rollout.admission import Admission, recover_progress
from areal_core.run import pipeline
from areal_core.run.derived import DerivedRunError
from areal_core.run.fork import child_id, fork
from areal_core.run.replay import record_ids
from areal_core.run.tracking import Tracker
from areal_core.store import Store
from areal_core.train.checkpoint import MODEL_FILE
from tests.conftest import ROOT, TINY

STEPS, K = 6, 4


def run_to_done(overrides: list[str]) -> Store:
    run_uri, _ = pipeline.prepare("", overrides)
    pipeline.run_async_rl(run_uri, pipeline.sft(run_uri))
    store = Store(run_uri)
    assert store.done()
    return store


def listing(store: Store) -> dict[str, str]:
    """Every object of a root and its sha256, but the parent's lineage records."""
    return {
        rel: hashlib.sha256(store.read_bytes(rel)).hexdigest()
        for rel in store.find("")
        if not rel.startswith(LAYOUT.fork_children_dir)
    }


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Store:
    tmp = tmp_path_factory.mktemp("fork")
    tracking = [o for o in TINY if not o.startswith("tracking.")]
    tracked = ["tracking.enabled=true", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}", "tracking.experiment=fork"]
    keep = "train.keep_checkpoints=3"  # steps 2, 4 and 6
    return run_to_done([*tracking, *tracked, f"store={tmp / 'parent'}", f"train.steps={STEPS}", keep])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.slow
def test_a_fork_continues_from_v_k_to_done_and_leaves_the_parent_as_it_was(parent, tmp_path):
    before = listing(parent)
    into = tmp_path / "child"
    out = fork(parent.uri, K, str(into), ["train.steps=8", "train.lr=1e-4"])
    child = Store(out["run_uri"])
    ref = read_fork(child)
    assert (ref.parent, ref.step, ref.version) == (parent.uri, K, K)
    assert listing(parent) == before  # the fork wrote nothing in the parent but its lineage record
    # the parent goes on writing shards (here one on the lineage's versions): never the child's
    late = [sample(f"rollout-0-g0000999-{i}", "rollout-0-g0000999", [K, K]) for i in range(4)]
    write_shard(parent, LAYOUT.graded_shard("rollout-0", 999), late)
    before = listing(parent)
    pipeline.run_async_rl(child.uri, child.url(LAYOUT.init_model))
    assert child.done() and child.read_json(LAYOUT.done)["step"] == 8
    assert listing(parent) == before  # the parent root is byte for byte what it was

    # the child's first step trains on v_k: the weights it published as v_k are the checkpoint's
    v_k = parent.read_bytes(LAYOUT.checkpoint_file(K, MODEL_FILE))
    assert sha(child.read_bytes(LAYOUT.weights_file(K, MODEL_FILE))) == sha(v_k)
    if parent.exists(LAYOUT.weights_file(K, MODEL_FILE)):
        assert sha(parent.read_bytes(LAYOUT.weights_file(K, MODEL_FILE))) == sha(v_k)
    first = child.read_json(LAYOUT.trained_record(K))
    assert first["trainer_version"] == K and all(v <= K for _, v in first["samples"])
    assert not child.exists(LAYOUT.trained_record(K - 1))  # steps before k are the parent's
    run_k = parent.read_json(LAYOUT.trained_record(K))
    if record_ids(run_k) == record_ids(first):  # the same batch on the same weights: the same step
        assert first["metrics"]["loss"] == run_k["metrics"]["loss"]
        assert first["metrics"]["grad_norm"] == run_k["metrics"]["grad_norm"]

    # nothing trained twice along the lineage; inherited samples are on it (versions <= k)
    parent_ids = [i for s in range(K) for i in record_ids(parent.read_json(LAYOUT.trained_record(s)))]
    child_ids = [i for s in range(K, 8) for i in record_ids(child.read_json(LAYOUT.trained_record(s)))]
    assert len(set(parent_ids + child_ids)) == len(parent_ids) + len(child_ids) == 8 * 2 * 4
    assert not [i for i in child_ids if "g0000999" in i]
    inherited = {s.identity(): s for rel, root in ref.shards.items() for s in decode_shard(Store(root).read_bytes(rel))}
    for identity in child_ids:
        if identity in inherited:
            assert max(v for v, m in zip(inherited[identity].versions, inherited[identity].loss_mask) if m) <= K
    # the child's rollout worker continued the parent's cursor: later shard numbers, new groups
    cursor = ref.workers["rollout-0"]
    own = child.find(LAYOUT.shard_dir("ungraded", "rollout-0"), ".arrow")
    assert all(LAYOUT.shard_worker_seq(rel)[1] >= cursor.next_seq for rel in own)
    new_groups = {s.group_id for rel in own for s in decode_shard(child.read_bytes(rel))}
    assert not {int(g.rsplit("-g", 1)[1]) for g in new_groups} & set(cursor.groups)

    # the child as a dataset: every sample it trained (its own, the referenced parent shards', the
    # checkpoint's pending ones) with its step, and the root holding it
    rows = samples_table(child).to_pylist()
    trained = {f"{r['worker_id']}/{r['sample_id']}": r for r in rows if r["status"] == "trained"}
    assert len(trained) == len(child_ids) and len(rows) == len(
        {(r["root"], r["worker_id"], r["sample_id"]) for r in rows}
    )
    for s in range(K, 8):
        for i, identity in enumerate(record_ids(child.read_json(LAYOUT.trained_record(s)))):
            assert (trained[identity]["step"], trained[identity]["step_index"]) == (s, i)
    own = {s.identity() for rel in child.find(LAYOUT.graded_dir, ".arrow") for s in decode_shard(child.read_bytes(rel))}
    assert {i for i, r in trained.items() if r["root"] == child.uri} == own & trained.keys()
    from_parent = {i for i, r in trained.items() if r["root"] == parent.uri}
    assert from_parent and from_parent == trained.keys() - own and not from_parent & set(parent_ids)

    # lineage: both roots and MLflow
    record = parent.read_json(LAYOUT.fork_child(child_id(child.uri)))
    assert (record["child"], record["step"]) == (child.uri, K)
    tracker, ptracker = Tracker.attach(child), Tracker.attach(parent)
    import mlflow

    client = mlflow.MlflowClient(tracker.uri)
    tags = client.get_run(tracker.run_id).data.tags
    assert tags["areal.fork.parent_store"] == parent.uri and tags["areal.fork.parent_step"] == str(K)
    assert tags["areal.fork.parent_run_id"] == ptracker.run_id != tracker.run_id
    ptags = client.get_run(ptracker.run_id).data.tags
    assert ptags[f"areal.fork.child.{child_id(child.uri)}"] == f"{child.uri} from step {K}"
    assert record["child_run_id"] == tracker.run_id


@pytest.mark.slow
def test_bad_forks_are_refused_in_one_line_and_write_nothing(parent, tmp_path):
    before, children = listing(parent), parent.find(LAYOUT.fork_children_dir)
    into = tmp_path / "child"
    with pytest.raises(DerivedRunError, match=rf"no committed checkpoint at step 1; available steps: 2, 4, {STEPS}"):
        fork(parent.uri, 1, str(into))
    with pytest.raises(DerivedRunError, match="cannot change model.num_layers"):
        fork(parent.uri, K, str(into), ["model.num_layers=2"])
    with pytest.raises(DerivedRunError, match="cannot change seed"):
        fork(parent.uri, K, str(into), ["seed=7"])
    with pytest.raises(DerivedRunError, match=r"train.steps \(4\) must be above the fork step 4"):
        fork(parent.uri, K, str(into), ["train.steps=4"])
    with pytest.raises(DerivedRunError, match="needs a critic"):
        fork(parent.uri, K, str(into), ["algo.adv_estimator=gae"])
    with pytest.raises(DerivedRunError, match="own root"):
        fork(parent.uri, K, parent.uri)
    assert not into.exists()
    (into / "weights").mkdir(parents=True)
    (into / "weights" / "LATEST").write_text("3")
    with pytest.raises(DerivedRunError, match="already holds a run"):
        fork(parent.uri, K, str(into))
    assert (into / "weights" / "LATEST").read_text() == "3"
    assert listing(parent) == before and parent.find(LAYOUT.fork_children_dir) == children
    cli = subprocess.run(
        [sys.executable, "-m", "areal_core.run.fork", parent.uri, "--step", "3", "--into", str(tmp_path / "c2")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert cli.returncode == 2 and cli.stderr.strip().count("\n") == 0 and "available steps: 2, 4, 6" in cli.stderr


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(2400)
def test_fork_workflow_of_a_run_on_s3_as_pods(tmp_path, s3_bucket, s3_server):
    """`workflows/fork.py: fork` as a cluster runs it (tests/podemu/: each node a pod, literal maps
    on the S3 endpoint): the child of a run on S3 trains to DONE in its own S3 root from v_k,
    reading the parent's shards in place; the parent's objects are untouched."""
    from tests.podemu.execute import Execution, to_literals, to_python
    from tests.podemu.package import package
    from tests.test_podemu import SECRETS, registration_env

    parent = run_to_done([*TINY, f"store={s3_bucket}/runs/parent", "train.steps=4"])
    before = listing(parent)
    pkg = package(ROOT, tmp_path / "pkg", registration_env(tmp_path / "none.yaml"), packages="workflows.fork")
    wf = "workflows.fork.fork"
    child_uri = f"{s3_bucket}/runs/child"
    inputs = {"run": parent.uri, "step": 2, "into": child_uri, "overrides": "train.steps=5 train.lr=1e-4"}
    ex = Execution(pkg, wf, s3_bucket, ROOT, tmp_path / "pods", s3_server, SECRETS, timeout_s=1800)
    out = ex.run(to_literals(pkg, wf, inputs))
    assert 0.0 <= to_python(out["after"], float) <= 1.0  # the child's held-out accuracy after RL
    child = Store(child_uri)
    assert child.done() and child.read_json(LAYOUT.done)["step"] == 5
    assert sha(child.read_bytes(LAYOUT.weights_file(2, MODEL_FILE))) == sha(
        parent.read_bytes(LAYOUT.checkpoint_file(2, MODEL_FILE))
    )
    assert child.read_json(LAYOUT.trained_record(2))["trainer_version"] == 2
    assert read_fork(child).parent == parent.uri and all(
        root == parent.uri for root in read_fork(child).shards.values()
    )
    assert listing(parent) == before
    assert parent.read_json(LAYOUT.fork_child(child_id(child.uri)))["child"] == child.uri
    assert {p.template.id.name for p in ex.pods()} >= {"tasks.fork.fork_run", "tasks.pipeline.run_async_rl"}


def test_replay_fork_and_regrade_workflows_take_typed_described_inputs():
    from flyteidl.core.types_pb2 import SimpleType

    from tests.test_flyte import serialize
    from workflows.fork import fork as fork_wf
    from workflows.regrade import regrade, regrade_and_replay
    from workflows.replay import replay

    text, number = SimpleType.STRING, SimpleType.INTEGER
    want = {
        fork_wf: {"run": text, "step": number, "into": text, "overrides": text},
        replay: {"run": text, "into": text, "overrides": text, "layer": text},
        regrade: {"run": text, "layer": text, "reward": text, "pool_size": number},
    }
    for wf, types in want.items():
        assert {k: v.type.simple for k, v in serialize(wf).template.interface.inputs.items()} == types
    for wf in (fork_wf, replay, regrade, regrade_and_replay):
        inputs = serialize(wf).template.interface.inputs
        assert {k: v.description for k, v in inputs.items() if not v.description or v.description == k} == {}


def sample(sid: str, gid: str, versions: list[int]) -> Sample:
    return Sample(sid, gid, "p", "rollout-0", [5, 6, 7, 8], 2, [0, 0, 1, 1], [0.0] * 4, [-1, -1, *versions], reward=1.0)


def test_on_lineage_keeps_whole_groups_sampled_by_versions_up_to_k_outside_abandoned_ones():
    rows = [
        sample("a0", "a", [3, 4]),
        sample("a1", "a", [4, 4]),
        sample("b0", "b", [4, 4]),
        sample("b1", "b", [4, 5]),  # one token of the parent's v5: the whole group is off the lineage
        sample("c0", "c", [1, 2]),
        sample("c1", "c", [1, 1]),
    ]
    assert [s.sample_id for s in on_lineage(rows, 4, [])] == ["a0", "a1", "c0", "c1"]
    assert [s.sample_id for s in on_lineage(rows, 4, [[2, 3]])] == []  # a0 and c0 hold abandoned versions
    assert [s.sample_id for s in on_lineage(rows, 5, [[2, 2]])] == ["a0", "a1", "b0", "b1"]


def test_a_forked_rollout_worker_continues_its_parents_cursor(tmp_path):
    store = Store(str(tmp_path))
    cursor = WorkerCursor(next_seq=9, groups=[0, 1, 2, 4])
    write_fork(store, ForkRef("file:///parent", 4, 4, {}, {"rollout-0": cursor}))
    progress = recover_progress(store, "rollout-0")
    assert (progress.next_seq, progress.groups) == (9, {0, 1, 2, 4})
    admission = Admission(num_prompts=50, seed=1, batch_groups=2, eta=1, progress=progress)
    assert admission.started == 4 and admission.room(1) == (1 + 1 + 1) * 2 - 4
    assert [admission.start()[0] for _ in range(2)] == [3, 5]  # the lost group first, then on
    assert recover_progress(store, "rollout-1").next_seq == 0  # a worker the parent did not have
    write_shard(store, LAYOUT.ungraded_shard("rollout-0", 9), [sample("x", "rollout-0-g0000005", [4, 4])] * 2)
    again = recover_progress(store, "rollout-0")
    assert (again.next_seq, again.groups) == (10, {0, 1, 2, 4, 5})


def parent_copy(parent: Store, where) -> Store:
    shutil.copytree(parent.local_path(), where)
    return Store(str(where))


@pytest.mark.slow
def test_a_retried_fork_continues_or_returns_its_result_and_another_request_is_refused(parent, tmp_path, monkeypatch):
    """A fork that died partway (here: after lineage/parent.json, before MLflow) is continued by a
    retry of the same request, its shard list as first frozen; a retry of a finished fork returns
    its result and writes nothing; another request into that root is refused."""
    from areal_core.run import tracking

    src = parent_copy(parent, tmp_path / "parent")
    into, fresh = tmp_path / "child", tmp_path / "fresh"
    overrides = ["train.steps=8", "train.lr=1e-4"]
    real = tracking.Tracker.create
    with monkeypatch.context() as m:
        m.setattr(
            tracking.Tracker, "create", classmethod(lambda cls, *a: (_ for _ in ()).throw(RuntimeError("pod lost")))
        )
        with pytest.raises(RuntimeError, match="pod lost"):
            fork(src.uri, K, str(into), overrides)
    assert tracking.Tracker.create == real
    child = Store(str(into))
    assert child.find("") and read_fork(child) and not child.exists(LAYOUT.derived_result)
    frozen = read_fork(child).shards
    fork(src.uri, K, str(fresh), overrides)  # the fork a single attempt makes at this moment
    # the parent runs on meanwhile: a later shard on the lineage's versions is not the retry's
    late = [sample(f"rollout-0-g0000998-{i}", "rollout-0-g0000998", [K, K]) for i in range(2)]
    write_shard(src, LAYOUT.graded_shard("rollout-0", 998), late)
    out = fork(src.uri, K, str(into), overrides)
    assert read_fork(child).shards == frozen and out["shards"] == len(frozen)
    assert child.read_json(LAYOUT.derived_result) == out and out["run_uri"] == child.uri
    # the retried child is that child: the same checkpoint, config, shard list and cursor
    same = (*Store(str(fresh)).find(LAYOUT.checkpoints_dir), LAYOUT.metrics, LAYOUT.discarded_groups)
    assert all(child.read_bytes(p) == Store(str(fresh)).read_bytes(p) for p in same)
    assert child.read_text(LAYOUT.config) == Store(str(fresh)).read_text(LAYOUT.config).replace(str(fresh), str(into))
    assert read_fork(child).shards == read_fork(Store(str(fresh))).shards
    assert read_fork(child).workers == read_fork(Store(str(fresh))).workers
    before = listing(child)
    assert fork(src.uri, K, str(into), overrides) == out  # finished: the same result, nothing written
    assert listing(child) == before
    with pytest.raises(DerivedRunError, match="already holds another request"):
        fork(src.uri, K, str(into), ["train.steps=8"])
    with pytest.raises(DerivedRunError, match="already holds another request"):
        fork(src.uri, 2, str(into), overrides)
    assert listing(child) == before


@pytest.mark.slow
def test_clumsy_forks_are_refused_in_one_line_and_write_nothing(parent, tmp_path, monkeypatch):
    """Unknown config keys, steps past the last checkpoint, roots spelled with '..', a root inside
    the parent's; and a parent still running that drops the checkpoint while it is copied."""
    src = parent_copy(parent, tmp_path / "parent")
    before = listing(src)
    into = tmp_path / "child"
    for overrides, message in (
        (["train.lrr=1e-4"], "unknown config key 'train.lrr'"),
        (["train.lr"], "must look like key=value"),
        (["train.lr=fast"], "config key 'train.lr' must be a number"),
    ):
        with pytest.raises(DerivedRunError, match=message):
            fork(src.uri, K, str(into), overrides)
    for step in (STEPS + 1, 99, -1):
        with pytest.raises(DerivedRunError, match=rf"at step {step}; available steps: 2, 4, {STEPS}"):
            fork(src.uri, step, str(into))
    with pytest.raises(DerivedRunError, match="own root"):
        fork(src.uri, K, f"{tmp_path}/x/../parent")
    with pytest.raises(DerivedRunError, match="inside the source run's root"):
        fork(src.uri, K, f"{src.local_path()}/forks/a")
    assert not into.exists() and listing(src) == before
    # the parent is still running and rotates its checkpoints: step K goes while it is copied
    real = Store.copy_dir

    def rotating(self, folder, dst, source=None):
        real(self, folder, dst, source)
        if source is not None and folder == LAYOUT.checkpoint_dir(K):
            source.delete(LAYOUT.checkpoint_file(K, MODEL_FILE))  # the trainer's delete, half done

    monkeypatch.setattr(Store, "copy_dir", rotating)
    with pytest.raises(DerivedRunError, match=f"checkpoint step {K} of .* was removed while it was copied"):
        fork(src.uri, K, str(into))
    monkeypatch.undo()
    assert not Store(str(into)).exists(LAYOUT.derived_result)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_core.run.fork",
            src.uri,
            "--step",
            "4",
            "--into",
            str(tmp_path / "c2"),
            "--set",
            "algo.nosuch=1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert cli.returncode == 2 and cli.stderr.strip().count("\n") == 0 and "algo.nosuch" in cli.stderr
    assert not (tmp_path / "c2").exists()


@pytest.mark.slow
@pytest.mark.s3
def test_a_fork_on_s3_retries_refuses_dot_segments_and_reads_as_a_dataset(parent, s3_bucket, monkeypatch):
    """The parent on S3 (a copy of the fixture's): a fork that died partway is finished by its
    retry, '..' in an S3 root is refused, and the child's dataset holds the referenced parent shards
    with their root."""
    from areal_core.run import tracking

    src = Store(f"{s3_bucket}/runs/parent")
    src.copy_dir("", "", source=parent)
    into = f"{s3_bucket}/runs/child"
    with pytest.raises(DerivedRunError, match="'.' or '..' segments"):
        fork(src.uri, K, f"{s3_bucket}/runs/x/../child")
    with monkeypatch.context() as m:
        m.setattr(
            tracking.Tracker, "create", classmethod(lambda cls, *a: (_ for _ in ()).throw(RuntimeError("pod lost")))
        )
        with pytest.raises(RuntimeError, match="pod lost"):
            fork(src.uri, K, into, ["train.steps=8"])
    out = fork(src.uri, K, into, ["train.steps=8"])
    child = Store(into)
    assert out == child.read_json(LAYOUT.derived_result) == fork(src.uri, K, into, ["train.steps=8"])
    ref = read_fork(child)
    assert ref.shards and set(ref.shards.values()) == {src.uri}
    rows = samples_table(child).to_pylist()
    referenced = {LAYOUT.shard_worker_seq(rel) for rel in ref.shards}
    assert {(r["worker_id"], r["shard_seq"]) for r in rows} == referenced  # nothing of its own yet
    assert {r["root"] for r in rows} == {src.uri}
