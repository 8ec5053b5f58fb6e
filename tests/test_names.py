"""Names that become store paths (issue 24): one validator (layout.check_name) refuses '.', '..',
hidden names, separators, NUL and control characters and overlong names, at every Layout builder
that takes a name and at the entry points (labels, re-grade layers, worker ids, --into); the
store resolves every path under its root; a folder with any entry is not an empty run root."""

from __future__ import annotations

import pytest

from areal_core.layout import LAYOUT, MAX_NAME_CHARS, BadName, check_name, check_root, inside
from areal_core.reward.labels import LabelsError, write_labels
from areal_core.run.derived import DerivedRunError, fresh_root
from areal_core.store import Store

BAD = {
    "empty": "",
    "dot": ".",
    "dotdot": "..",
    "hidden": ".hidden",
    "traversal": "../prompts",
    "deep traversal": "../../../../etc/passwd",
    "absolute": "/etc/passwd",
    "inner slash": "a/b",
    "trailing slash": "a/",
    "backslash": "a\\b",
    "backslash traversal": "..\\..\\x",
    "NUL": "a\x00b",
    "NUL alone": "\x00",
    "newline": "a\nb",
    "carriage return": "a\rb",
    "tab": "a\tb",
    "escape": "a\x1b[31mb",
    "DEL": "a\x7fb",
    "C1 control": "a\x85b",
    "bidi override": "a\u202eb",
    "zero width space": "a\u200bb",
    "line separator": "a\u2028b",
    "BOM": "\ufeffa",
    "surrogate": "a\ud800b",
    "overlong": "x" * (MAX_NAME_CHARS + 1),
    "overlong unicode": "é" * (MAX_NAME_CHARS + 1),
}
GOOD = [
    "labels.parquet",
    "rollout-0",
    "a",
    "x" * MAX_NAME_CHARS,
    "a..b",  # dots inside a name are not a relative folder
    "v1.2",
    "names with spaces",
    "ünïcödé-名前",
    "a\u2215b",  # DIVISION SLASH: a look-alike, not a separator
    "a\uff0fb",  # FULLWIDTH SOLIDUS
    "a\u29f5b",  # REVERSE SOLIDUS OPERATOR
]


@pytest.mark.parametrize("name", list(BAD))
def test_check_name_refuses(name):
    with pytest.raises(BadName) as err:
        check_name(BAD[name], "thing")
    message = str(err.value)
    assert message.startswith("thing ") and "\n" not in message and len(message) < 300


@pytest.mark.parametrize("name", GOOD)
def test_check_name_takes(name):
    assert check_name(name) == name


def test_check_name_refuses_what_is_not_a_string():
    for value in (None, 1, b"abc", ["a"]):
        with pytest.raises(BadName, match="must be a string"):
            check_name(value)


@pytest.mark.parametrize("name", list(BAD))
def test_every_layout_builder_that_takes_a_name_checks_it(name):
    bad = BAD[name]
    builders = [
        lambda: LAYOUT.labels_file(bad),
        lambda: LAYOUT.layer_dir(bad),
        lambda: LAYOUT.regrade_record(bad),
        lambda: LAYOUT.layer_shard("fix", bad, 0),
        lambda: LAYOUT.shard_dir("graded", bad),
        lambda: LAYOUT.graded_shard(bad, 0),
        lambda: LAYOUT.ungraded_shard(bad, 0),
        lambda: LAYOUT.status("rollout", bad),
        lambda: LAYOUT.status(bad, "0"),
        lambda: LAYOUT.events_part("rollout", bad, 0),
        lambda: LAYOUT.online_run(bad),
        lambda: LAYOUT.online_consumed(bad),
        lambda: LAYOUT.fork_child(bad),
    ]
    for build in builders:
        with pytest.raises(ValueError):  # BadName, or the layer rule's ValueError
            build()


def test_layout_builders_keep_their_paths():
    assert LAYOUT.labels_file("l.jsonl") == "labels/l.jsonl"
    assert LAYOUT.graded_shard("rollout-0", 3) == "trajectories/graded/rollout-0/00000003.arrow"
    assert LAYOUT.status("trainer", "0") == "status/trainer-0.json"
    assert LAYOUT.online_run("r1") == "online/r1"
    assert LAYOUT.in_layer("trajectories/graded/w/copy-of-1.arrow", "graded", "fix") == (
        "trajectories/regraded/fix/w/copy-of-1.arrow"
    )
    with pytest.raises(ValueError):
        LAYOUT.in_layer("trajectories/ungraded/w/1.arrow", "graded", "fix")
    assert LAYOUT.shard_seq("trajectories/graded/w/00000041.arrow") == 41
    for odd in ("copy-of-1.arrow", "1 (2).arrow", "1.5.arrow", "-1.arrow", "²³.arrow", "1e3.arrow", "x"):
        assert LAYOUT.shard_seq(f"trajectories/graded/w/{odd}") is None
    assert LAYOUT.own_folders("rollout", 2) == ("trajectories/ungraded/rollout-2",)
    assert LAYOUT.own_folders("trainer") == ("",)
    with pytest.raises(BadName):
        LAYOUT.own_folders("rollout", -1)


@pytest.mark.parametrize("name", list(BAD))
def test_write_labels_refuses_a_bad_name_and_writes_nothing(tmp_path, name):
    run = tmp_path / "run"
    store = Store(str(run))
    store.write_text(LAYOUT.prompts_part(0), "prompts")
    with pytest.raises(LabelsError):
        write_labels(store, [{"sample_id": "s0", "reward": 1.0}], BAD[name] + ".jsonl" if BAD[name] else "")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["run/prompts/part-00000.parquet"]
    assert store.read_text(LAYOUT.prompts_part(0)) == "prompts"


def test_write_labels_cannot_reach_prompts_or_outside_the_root(tmp_path):
    store = Store(str(tmp_path / "run"))
    for name in ("../prompts/part-00000.parquet", "../../escape.jsonl", "..", "../config.yaml", "..\\x.jsonl"):
        with pytest.raises(LabelsError, match="labels file name"):
            write_labels(store, [{"sample_id": "s0", "reward": 1.0}], name)
    assert not list(tmp_path.rglob("*.parquet")) and not list(tmp_path.rglob("*.jsonl"))
    assert write_labels(store, [{"sample_id": "s0", "reward": 1.0}], "ok.jsonl") == "labels/ok.jsonl"


def test_regrade_refuses_bad_layer_names_before_anything():
    from areal_core.reward.regrade import RegradeError, _check_names

    for name in ("..", ".", "../graded", "a/b", "a\x00", "\u202e", "x" * 200, ".hidden"):
        with pytest.raises(RegradeError):
            _check_names(None, "graded", name)  # the name is refused before the store is touched
        with pytest.raises(RegradeError):
            _check_names(None, name, "new")


def test_the_store_resolves_every_path_under_its_root(tmp_path):
    store = Store(str(tmp_path / "run"))
    for rel in ("../x", "a/../../x", "labels/../../x", "..", "./../x", "a/./../../../x"):
        with pytest.raises(BadName, match="outside the run root"):
            store.write_text(rel, "no")
        with pytest.raises(BadName):
            store.read_bytes(rel)
    assert not (tmp_path / "x").exists()
    store.write_text("a/../b.txt", "fine")  # stays under the root
    assert store.read_text("b.txt") == "fine"
    assert inside("bucket/run", "a/b") == "bucket/run/a/b"
    with pytest.raises(BadName):
        inside("bucket/run", "../run2/x")
    with pytest.raises(BadName):
        inside("bucket/run", "a/../../run2")


def test_roles_refuse_a_negative_worker_index(tmp_path):
    from areal_core.run.roles import run_role

    with pytest.raises(BadName):
        run_role("rollout", str(tmp_path / "run"), -1)


# -- --into ------------------------------------------------------------------------------------
def _source(tmp_path) -> Store:
    src = Store(str(tmp_path / "src"))
    src.write_text("config.yaml", "name: x\n")
    return src


@pytest.mark.parametrize(
    "entries",
    [
        {".env": "SECRET=1"},
        {".git/HEAD": "ref: refs/heads/main"},
        {".tmp-0123456789abcdef0123456789abcdef": ""},
        {".hidden/.also": "x"},
        {"sub/.keep": ""},
    ],
)
def test_into_a_folder_with_only_dot_files_is_not_empty(tmp_path, entries):
    into = tmp_path / "into"
    for name, text in entries.items():
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_text(text)
    with pytest.raises(DerivedRunError, match="already holds"):
        fresh_root(str(into), _source(tmp_path), {"fork": "x"})
    assert sorted(p.name for p in into.rglob("*") if p.is_file()) == sorted(n.rsplit("/", 1)[-1] for n in entries)


def test_into_a_folder_with_only_an_empty_folder_is_not_empty(tmp_path):
    (tmp_path / "into" / "empty").mkdir(parents=True)
    with pytest.raises(DerivedRunError, match="already holds"):
        fresh_root(str(tmp_path / "into"), _source(tmp_path), {"fork": "x"})
    (tmp_path / "file").write_text("x")
    with pytest.raises(DerivedRunError, match="already holds"):
        fresh_root(str(tmp_path / "file"), _source(tmp_path), {"fork": "x"})


def test_into_a_new_or_empty_folder_is_new(tmp_path):
    (tmp_path / "empty").mkdir()
    for into in (tmp_path / "empty", tmp_path / "missing", tmp_path / "missing" / "deeper"):
        store, state = fresh_root(str(into), _source(tmp_path), {"fork": "x"})
        assert state == "new" and store.uri.endswith(into.name)


@pytest.mark.parametrize(
    "into",
    [".", "..", "runs/..", "runs/.", "runs/.hidden", "runs/a\x00b", "runs/a\nb", "runs/\u202eexe", "r/" + "x" * 200],
)
def test_into_refuses_bad_names(tmp_path, monkeypatch, into):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DerivedRunError, match="--into"):
        fresh_root(into, _source(tmp_path), {"fork": "x"})
    with pytest.raises(BadName):
        check_root(into)
    assert check_root("s3://bucket/runs/child") == "s3://bucket/runs/child"
    assert check_root(str(tmp_path / "child") + "/") == str(tmp_path / "child") + "/"
