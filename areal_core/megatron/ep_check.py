"""What megatron-core does with a converted Qwen3-MoE at expert parallel 2, on 2 gloo ranks (CPU):

    python -m areal_core.megatron.ep_check CASE.pt OUT_DIR [--device cpu|cuda]

CASE.pt (torch.save) is {"shape": ModelShape.as_dict(), "moe": MoeShape.as_dict(), "megatron": the
EP = 1 state dict (`moe.qwen3_moe_to_megatron`), "ids": LongTensor [b, s], "hf_logits": the HF
model's logits on ids, "moe_input": layer 0's MoE input [b, s, hidden] (HF's post-attention norm
output), "hf_moe_output": HF's sparse MoE block on it}. Each rank:

1. builds GPTModel (local spec, MoE, `expert_model_parallel_size=2`), checks its EP part of the
   converted state dict (`moe.shard_experts`) fits key for key and shape for shape, loads it and
   saves the model's own state dict as OUT_DIR/rank{r}.pt (the test unshards and converts back);
2. runs the whole forward: logits vs HF's, or where megatron-core stopped (`gpt.try_forward`);
3. runs layer 0's MoE layer alone (router, all-gather token dispatch over the EP group, the
   rank's experts, combine): its output vs HF's sparse block, or where it stopped.

OUT_DIR/ep_check.json: {"mismatches", "forward", "moe_layer", "_versions"}, from rank 0.
With `--device cuda` (benchmarks/gpu_smoke.py's megatron_ep section) the ranks use NCCL, one GPU
each, where the machine has 2; on one GPU both ranks share it over gloo (NCCL refuses two ranks on
one device), and what gloo cannot do with CUDA tensors is recorded like any other stop.
Runs in the megatron venv (scripts/setup_megatron_venv.sh); tests/test_megatron_moe.py drives it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_core.megatron.moe import MoeShape, moe_config_kwargs, shard_experts
from areal_core.megatron.shapes import MegatronParallel, ModelShape, gpt_model_kwargs, transformer_config_kwargs
from areal_core.procs import free_port

EP = 2


def build_moe_gpt_model(shape: ModelShape, moe: MoeShape, expert_parallel: int) -> Any:
    """A float32 GPTModel (local spec with E experts, qk norms, no dropout) on CPU-initialised
    weights; parallel_state must be initialized with `expert_model_parallel_size=expert_parallel`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    kw = transformer_config_kwargs(shape, MegatronParallel(), bf16=False) | moe_config_kwargs(moe, expert_parallel)
    kw.update(use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=moe.num_experts, qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(TransformerConfig(**kw), spec, **gpt_model_kwargs(shape))


def stop_of(exc: BaseException) -> dict[str, str]:
    """The innermost megatron-core frame of an exception, its line of code and the error."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/core/" in f.filename]
    last = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    where = last.filename[last.filename.rfind("megatron/core/") :] if frames else last.filename
    return {"where": f"{where}:{last.lineno} in {last.name}", "code": (last.line or "").strip(), "error": repr(exc)}


def moe_layer_forward(model: Any, moe_input: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, str] | None]:
    """Layer 0's MoELayer on [b, s, hidden] (Megatron's [s, b, hidden] inside): (output, None) or
    (None, where it stopped)."""
    try:
        with torch.no_grad():
            out, _bias = model.decoder.layers[0].mlp(moe_input.transpose(0, 1).contiguous())
        return out.transpose(0, 1), None
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden: the report names the call
        return None, stop_of(exc)


def _compare(got: torch.Tensor | None, stopped: dict[str, str] | None, want: torch.Tensor) -> dict[str, Any]:
    if stopped is not None:
        return {"stopped": stopped}
    assert got is not None
    return {"max_abs_diff": (got[..., : want.shape[-1]].float().cpu() - want.float()).abs().max().item()}


def _to(case: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if k in ("ids", "moe_input") else v for k, v in case.items()}


def _run_rank(case: dict[str, Any], rank: int, out_dir: Path, device: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    from areal_core.megatron.gpt import state_dict_mismatches, try_forward

    shape, moe = ModelShape(**case["shape"]), MoeShape(**case["moe"])
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        model = build_moe_gpt_model(shape, moe, EP).eval()
        sd = shard_experts(case["megatron"], EP, parallel_state.get_expert_model_parallel_rank(), moe)
        result: dict[str, Any] = {"mismatches": state_dict_mismatches(model, sd)}
        if result["mismatches"]:
            return result
        model.load_state_dict(sd, strict=False)  # strict=False only for the `_extra_state` entries
        own = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        torch.save(own, out_dir / f"rank{rank}.pt")
        model, case = model.to(device), _to(case, device)
        result["forward"] = _compare(*try_forward(model, case["ids"]), case["hf_logits"])
        result["moe_layer"] = _compare(*moe_layer_forward(model, case["moe_input"]), case["hf_moe_output"])
        return result
    finally:
        parallel_state.destroy_model_parallel()


def _backend(device: str) -> str:
    """gloo on CPU and on one shared GPU; NCCL with a GPU per rank."""
    return "nccl" if device == "cuda" and torch.cuda.device_count() >= EP else "gloo"


def _worker(rank: int, case_path: str, out_dir: str, port: int, device: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(_backend(device), rank=rank, world_size=EP)
    torch.manual_seed(0)
    result = _run_rank(torch.load(case_path, weights_only=True), rank, Path(out_dir), device)
    result["backend"], result["device"] = _backend(device), device
    if rank == 0:
        import megatron.core

        result["_versions"] = {"megatron-core": megatron.core.__version__, "torch": torch.__version__}
        (Path(out_dir) / "ep_check.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    device = "cpu"
    if len(argv) == 4 and argv[2] == "--device" and argv[3] in ("cpu", "cuda"):
        device, argv = argv[3], argv[:2]
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    Path(argv[1]).mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(argv[0], argv[1], free_port(), device), nprocs=EP)
    print(Path(argv[1], "ep_check.json").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
