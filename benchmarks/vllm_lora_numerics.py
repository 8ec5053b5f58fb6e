"""Does vLLM's native LoRA serve the trainer's policy? Teacher-forced log-probs of a trained adapter
on tokens vLLM did not sample, against the merged model in float32.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_lora_numerics.py --run runs/vllm-rl-s3/vllm-native
        [--version N] [--n 64] [--max-new 48] [--dtype bfloat16] [--out numerics.json]

The run is a finished LoRA run of `benchmarks/vllm_rl.py` (its store holds init_model and the adapter
versions). For --n held-out prompts: the float32 merged model (init_model + s·B·A, what the trainer
computes) writes its greedy answer; then vLLM scores prompt + answer with `prompt_logprobs` (no
sampling: every position is a token vLLM did not choose), three ways on one server of init_model with
LoRA enabled: the adapter `v{N}` by name, and the base model. Reported per token of the answers:

  err_native = mean |log p_vLLM,adapter − log p_fp32,merged|   (what the native path gets wrong)
  effect     = mean |log p_fp32,merged − log p_fp32,base|      (what the adapter changes)

plus both for the bf16 merged model in torch (what the trainer's autocast gets), and greedy accuracy
of the answers vLLM's adapter writes against the float32 merged model's. err_native well below
effect, and near the torch bf16 error, means the served policy is the trained one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import httpx
import torch

from benchmarks.smollm2_rl import grade, load_model, prompts_of
from benchmarks.vllm_rl import cpu_name, write_result


def teacher_forced(model, ids: list[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t ≥ start under a torch model."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[start - 1 :].tolist()


def vllm_prompt_logprobs(url: str, model: str, ids: list[int], start: int) -> list[float]:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    plp = r.json()["choices"][0]["prompt_logprobs"]
    out = []
    for t in range(start, len(ids)):
        entry = plp[t]
        out.append(float(entry[str(ids[t])]["logprob"]))
    return out


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    return statistics.mean(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def main(argv: list[str] | None = None) -> None:
    from areal_core.context import load_run_config
    from areal_core.layout import LAYOUT
    from areal_core.models import localize
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.vllm_engine import VLLMEngine
    from areal_core.rollout.vllm_server import SERVED_NAME, server_spec
    from areal_core.store import Store
    from areal_core.train.lora import merge_adapter
    from areal_core.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from areal_core.weights.reader import stage_adapter
    from task_data.registry import load_task

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--version", type=int, default=-1, help="adapter version; -1: the newest published")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", help="the vLLM server's dtype")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    store = Store(args.run)
    cfg = load_run_config(store)
    version = args.version
    if version < 0:
        version = max(v for v in map(LAYOUT.weights_version, store.listdir(LAYOUT.weights_root)) if v is not None)
    staged = stage_adapter(store, version, tempfile.mkdtemp(prefix="areal-numerics-"))  # sha256-checked
    files = {name: (staged / name).read_bytes() for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}
    base, tok = load_model(localize(store.url(LAYOUT.init_model)))
    merged, _ = load_model(localize(store.url(LAYOUT.init_model)))
    merge_adapter(merged, files)
    merged_bf16 = load_model(localize(store.url(LAYOUT.init_model)))[0]
    merge_adapter(merged_bf16, files)
    merged_bf16 = merged_bf16.to(torch.bfloat16)
    _, heldout = load_task(cfg.task, cfg.seed)
    records = heldout[: args.n]
    prompts = prompts_of(tok, records, cfg.task.system_prompt)
    answers = []
    for p in prompts:
        out = merged.generate(torch.tensor([p]), max_new_tokens=args.max_new, do_sample=False)
        answers.append(out[0, len(p) :].tolist())
    seqs = [p + a for p, a in zip(prompts, answers)]
    ref = [teacher_forced(merged, s, len(p)) for s, p in zip(seqs, prompts)]
    ref_base = [teacher_forced(base, s, len(p)) for s, p in zip(seqs, prompts)]
    torch_bf16 = [teacher_forced(merged_bf16, s, len(p)) for s, p in zip(seqs, prompts)]
    spec = server_spec(cfg, native_lora=True)
    spec.dtype = args.dtype
    engine = VLLMEngine.launch(store, version, tok.eos_token_id, spec=spec, native_lora=True)
    try:
        name = VLLMEngine.adapter_name(version)
        native = [vllm_prompt_logprobs(engine.url, name, s, len(p)) for s, p in zip(seqs, prompts)]
        vbase = [vllm_prompt_logprobs(engine.url, SERVED_NAME, s, len(p)) for s, p in zip(seqs, prompts)]
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new, greedy=True))
    finally:
        engine.close()
    res = {
        "cpu": cpu_name(),
        "run": args.run,
        "version": version,
        "server_dtype": args.dtype,
        "n": len(prompts),
        "tokens": sum(len(a) for a in answers),
        "err_native_vs_fp32_merged": mean_abs(native, ref),
        "err_vllm_base_vs_fp32_base": mean_abs(vbase, ref_base),
        "err_torch_bf16_vs_fp32_merged": mean_abs(torch_bf16, ref),
        "adapter_effect_fp32": mean_abs(ref, ref_base),
        "adapter_effect_vllm": mean_abs(native, vbase),
        "greedy_acc_fp32_merged": statistics.mean(grade(tok, records, answers)),
        "greedy_acc_vllm_native": statistics.mean(grade(tok, records, [g.token_ids for g in gens])),
        "greedy_same_tokens": statistics.mean(float(g.token_ids == a) for g, a in zip(gens, answers)),
    }
    write_result(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
