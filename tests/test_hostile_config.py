"""Hostile configs (issue 24): every one is refused with one ConfigError line, quickly, whatever
it holds: alias bombs in files, under known keys and in --overrides; deep nesting of lists and
maps; huge strings, keys and files; many keys; binary garbage; unsafe tags."""

import os
import time

import pytest

from areal_core.config import ConfigError, from_yaml_text, load_config, to_yaml
from areal_core.config.base import (
    MAX_STR_CHARS,
    MAX_TEXT_CHARS,
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    excerpt,
    load_yaml_text,
)

# "quickly" is the point of these tests (an expanded bomb takes minutes and gigabytes), so the
# bound stays, with a 50x margin over the measured worst case (~0.1 s) for a loaded CI machine
BUDGET_S = 5.0


def laughs(levels: int, width: int = 10, indent: str = "") -> str:
    """The billion-laughs document: `width ** levels` leaves from a few hundred bytes."""
    lines = [f'{indent}a0: &a0 ["lol"]']
    lines += [f"{indent}a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def override_bomb(levels: int = 9) -> str:
    """A flow-style alias bomb in one --overrides value (~400 bytes, 9^9 leaves expanded)."""
    items = ["a0: &a0 [x,x,x,x,x,x,x,x,x]"]
    items += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "name={" + ", ".join(items) + "}"


def refused(call, *args, match: str = "") -> str:
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        call(*args)
    took = time.perf_counter() - start
    message = str(err.value)
    assert took < BUDGET_S, f"{took:.2f}s: {message[:200]}"
    assert "\n" not in message and len(message) < 400, message[:400]
    assert match in message, message
    return message


FILES = {
    "laughs 10^3": (laughs(3), "anchor or alias"),
    "laughs 10^6": (laughs(6), "anchor or alias"),
    "laughs 10^9": (laughs(9), "anchor or alias"),
    "laughs 10^30": (laughs(30), "anchor or alias"),
    "laughs under a known key": ("name:\n" + laughs(9, indent="  "), "anchor or alias"),
    "laughs under a nested known key": ("train:\n  lr:\n" + laughs(9, indent="    "), "anchor or alias"),
    "an alias to a scalar": ("name: &n x\nstore: *n\n", "anchor or alias"),
    "an anchor alone": ("name: &n x\n", "anchor or alias"),
    "a merge key from an alias": ("base: &b {steps: 1}\ntrain:\n  <<: *b\n", "anchor or alias"),
    "deep flow lists": ("name: " + "[" * 100_000 + "]" * 100_000 + "\n", "nest"),
    "deep flow maps": ("name: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n", "nest"),
    "deep block maps": ("".join(" " * i + "a:\n" for i in range(600)) + " " * 600 + "a: 1\n", "nests deeper"),
    "deep block lists": ("".join(" " * i + "-\n" for i in range(200)) + " " * 200 + "- 1\n", "nests deeper"),
    "deep flow at the limit + 1": ("name: " + "[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH + "\n", "nests deeper"),
    "a 50 MB string": ("name: " + "x" * 50_000_000 + "\n", "byte limit"),
    "a 900 KB string": ("name: " + "x" * 900_000 + "\n", "characters, over"),
    "a 900 KB quoted string": ('name: "' + "y" * 900_000 + '"\n', "characters, over"),
    "a 900 KB block string": ("name: |\n" + "  z\n" * 200_000, "characters, over"),
    "a 5 KB name": ("name: " + "x" * (MAX_STR_CHARS + 1) + "\n", "at most 4096 characters"),
    "a 70 KB prompt": ("task:\n  system_prompt: " + "p" * (MAX_TEXT_CHARS + 1) + "\n", "characters, over"),
    "a huge key": ("k" * 100_000 + ": 1\n", ""),
    "a long key": ("k" * 500 + ": 1\n", "key of 500 characters"),
    "a long nested key": ("train:\n  " + "k" * 500 + ": 1\n", "key of 500 characters"),
    "many keys over the byte limit": ("".join(f"k{i}: {i}\n" for i in range(150_000)), "byte limit"),
    "many keys": ("".join(f"k{i}: 1\n" for i in range(60_000)), f"more than {MAX_YAML_NODES} values"),
    "many keys in a section": ("train:\n" + "".join(f"  k{i}: 1\n" for i in range(30_000)), "values"),
    "a long list": ("name: [" + ",".join(["1"] * 100_000) + "]\n", "values"),
    "many small unknown keys": ("".join(f"k{i}: 1\n" for i in range(4000)), "unknown config key 'k0'"),
    "NUL": ("name: a\x00b\n", "not valid YAML"),
    "control characters": ("name: a\x07\x1bb\n", "not valid YAML"),
    "!!python/object": ("name: !!python/object/apply:os.system ['echo hi']\n", "tag"),
    "!!python/name": ("name: !!python/name:os.system\n", "tag"),
    "!!binary": ("name: !!binary aGVsbG8=\n", "tag"),
    "!!set": ("name: !!set {a, b}\n", "tag"),
    "a local tag": ("name: !x 1\n", "tag"),
    "a 5000-digit int": ("seed: " + "9" * 5000 + "\n", "not valid YAML"),
    "a 100k-digit int": ("seed: " + "9" * 100_000 + "\n", "characters, over"),
    "a bad date": ("name: 2024-13-45\n", "not valid YAML"),
    "two documents": ("name: a\n---\nname: b\n", "not valid YAML"),
    "a list at the root": ("- 1\n- 2\n", "must be a mapping"),
    "unbalanced": ("train:\n  steps: [1, 2\n", "not valid YAML"),
    "a huge list under a known key": ("train:\n  steps: [" + ",".join(["1"] * 9_000) + "]\n", "must be an integer"),
}


@pytest.mark.parametrize("name", list(FILES))
def test_hostile_config_file_is_one_line_and_quick(tmp_path, name):
    text, match = FILES[name]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    refused(load_config, path, match=match)
    refused(load_config, f"configs/default.yaml,{path}", match=match)  # layered after a good file
    if len(text) <= MAX_YAML_BYTES:
        refused(from_yaml_text, text, match=match)  # the run root's config.yaml


OVERRIDES = {
    "an alias bomb (~400 bytes)": (override_bomb(), "anchor or alias"),
    "an alias bomb under a nested key": ("train.lr=" + override_bomb()[len("name=") :], "anchor or alias"),
    "an alias": ("name=[&a x, *a]", "anchor or alias"),
    "deep lists": ("name=" + "[" * 100_000 + "]" * 100_000, "nest"),
    "deep maps": ("name=" + "{a: " * 10_000 + "1" + "}" * 10_000, "nests deeper"),
    "a deep dotted key": (".".join(["a"] * 100_000) + "=1", "parts"),
    "a dotted key of 33 parts": (".".join(["a"] * (MAX_YAML_DEPTH + 1)) + "=1", "parts"),
    "a long dotted part": ("train." + "k" * 1000 + "=1", "characters"),
    "a 50 MB value": ("name=" + "x" * 50_000_000, "limit"),
    "a 900 KB value": ("name=" + "x" * 900_000, "characters, over"),
    "a 5 KB name": ("name=" + "x" * (MAX_STR_CHARS + 1), "at most 4096 characters"),
    "a 5 KB store": ("store=" + "s" * (MAX_STR_CHARS + 1), "'store' must be at most"),
    "a tag": ("name=!!python/object/apply:os.system [x]", "tag"),
    "NUL": ("name=a\x00b", "not valid YAML"),
    "a huge value for an int key": ("train.steps=[" + ",".join(["1"] * 5_000) + "]", "must be an integer"),
    "a huge mapping for a section": ("train={" + ", ".join(f"k{i}: 1" for i in range(4_000)) + "}", "unknown"),
    "a long text with no '='": ("x" * 100_000, "must look like key=value"),
    "a long text with an empty key": ("=" + "x" * 100_000, "empty key"),
}


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_hostile_override_is_one_line_and_quick(name):
    text, match = OVERRIDES[name]
    refused(load_config, None, [text], match=match)


def test_hostile_files_beyond_the_byte_limit_are_not_read(tmp_path):
    big = tmp_path / "100mb.yaml"
    with big.open("wb") as f:  # sparse: 100 MB that costs no disk
        f.write(b"name: ")
        f.seek(100 * 2**20)
        f.write(b"x\n")
    assert "104857602 bytes" in refused(load_config, big, match="byte limit")
    garbage = tmp_path / "garbage.yaml"
    garbage.write_bytes(bytes(range(128, 256)) * 32 + os.urandom(4096))
    refused(load_config, garbage, match="not UTF-8")
    ascii_garbage = tmp_path / "ascii.yaml"
    ascii_garbage.write_bytes(bytes(range(0, 32)) * 64)
    refused(load_config, ascii_garbage, match="not valid YAML")
    refused(load_config, tmp_path, match="does not exist")  # a folder
    refused(load_config, tmp_path / ("n" * 5000), match="")  # a name too long for the file system


def test_a_message_shows_a_bounded_excerpt_of_the_value():
    message = refused(load_config, None, ["train.steps=" + "9" * 4000 + "x"], match="must be an integer, got '999")
    assert len(message) < 200
    message = refused(load_config, None, ["train=[" + ",".join(["1"] * 5000) + "]"], match="must be a mapping, got [1")
    assert len(message) < 200
    assert len(excerpt("x" * 10**7)) <= 80 and len(excerpt([[[[[[1]]]]]] * 10**5)) <= 80
    assert excerpt("a\nb") == "'a\\nb'" and excerpt(True) == "True" and excerpt(1.5) == "1.5"
    assert excerpt(int("9" * 4000) ** 2) == "<int>"


def test_good_configs_still_load_and_round_trip():
    cfg = load_config("configs/default.yaml", ["task.system_prompt=" + "p" * (MAX_TEXT_CHARS - 10)])
    assert len(cfg.task.system_prompt) == MAX_TEXT_CHARS - 10
    assert from_yaml_text(to_yaml(cfg)) == cfg
    for path in ("configs/default.yaml", "configs/code.yaml", "configs/agent_calculator.yaml"):
        load_config(path)
    plain = load_yaml_text("a: !!str 1\nb: !!int '2'\nc: [1, {d: null}]\n", "x")
    assert plain == {"a": "1", "b": 2, "c": [1, {"d": None}]}
    assert load_yaml_text("", "x") is None
    deepest = "name: " + "[" * (MAX_YAML_DEPTH - 1) + "]" * (MAX_YAML_DEPTH - 1) + "\n"
    assert load_yaml_text(deepest, "x")["name"] is not None  # at the limit: read (and then refused as not a str)
