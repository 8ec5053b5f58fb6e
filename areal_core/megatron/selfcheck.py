"""What megatron-core does with converted weights on this machine, on 2 gloo ranks (CPU):

    python -m areal_core.megatron.selfcheck CASES.pt OUT_DIR

CASES.pt (torch.save) is a list of {"name", "shape": ModelShape.as_dict(), "megatron": the TP = 1
Megatron state dict (`convert.hf_to_megatron`), "ids": LongTensor [b, s], "hf_logits": the HF
model's logits on ids}. For each case:

1. TP = 1 (data parallel 2): build GPTModel, check the converted state dict fits it key for key
   and shape for shape, load it, run the forward: logits vs HF's, or where megatron-core stopped;
2. TP = 2: the same with each rank's `shard.shard_for_rank`; the TP 2 forward is tried only when
   the TP 1 forward ran (where TP 1 stops, TP 2 stops first at the same call);
3. publication's first half: every rank's `model.state_dict()` gathered to rank 0 and converted
   back (`shard.gather_hf_state_dict`), saved as OUT_DIR/NAME.hf.pt.

OUT_DIR/selfcheck.json: {name: {"tp1": {...}, "tp2": {...}}}, each with "mismatches" (empty when the
state dict fits), and either "max_abs_diff" (the forward ran) or "stopped" (`gpt.try_forward`).
Runs in the megatron venv (scripts/setup_megatron_venv.sh); tests/test_megatron_core.py drives it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal_core.megatron.shapes import ModelShape
from areal_core.megatron.shard import gather_hf_state_dict, shard_for_rank
from areal_core.procs import free_port

WORLD = 2


def _one_layout(case: dict[str, Any], shape: ModelShape, tp: int, rank: int, run_forward: bool) -> dict[str, Any]:
    from megatron.core import parallel_state

    from areal_core.megatron.gpt import build_gpt_model, load_converted, state_dict_mismatches, try_forward

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        vocab_rows = case["megatron"]["embedding.word_embeddings.weight"].shape[0]
        model = build_gpt_model(shape, tensor_parallel=tp, padded_vocab_size=vocab_rows).eval()
        sd = shard_for_rank(case["megatron"], tp, rank % tp, shape)
        out: dict[str, Any] = {"mismatches": state_dict_mismatches(model, sd)}
        if out["mismatches"]:
            return out
        load_converted(model, sd)
        if run_forward:
            logits, stopped = try_forward(model, case["ids"])
            if stopped is not None:
                out["stopped"] = stopped
            else:
                assert logits is not None
                if tp > 1:  # the output layer is vocabulary-parallel: gather the parts
                    parts = [torch.empty_like(logits) for _ in range(tp)]
                    dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
                    logits = torch.cat(parts, dim=-1)
                diff = logits[..., : shape.vocab_size].float() - case["hf_logits"].float()
                out["max_abs_diff"] = diff.abs().max().item()
        if tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            out["hf"] = gather_hf_state_dict(model.state_dict(), shape, group=group)
        return out
    finally:
        parallel_state.destroy_model_parallel()


def _worker(rank: int, cases_path: str, out_dir: str, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    for case in torch.load(cases_path, weights_only=True):
        shape = ModelShape(**case["shape"])
        tp1 = _one_layout(case, shape, 1, rank, run_forward=True)
        tp2 = _one_layout(case, shape, WORLD, rank, run_forward="max_abs_diff" in tp1)
        hf = tp2.pop("hf", None)
        if rank == 0 and hf is not None:
            torch.save(hf, Path(out_dir) / f"{case['name']}.hf.pt")
        results[case["name"]] = {"tp1": tp1, "tp2": tp2}
    if rank == 0:
        import megatron.core

        results["_versions"] = {"megatron-core": megatron.core.__version__, "torch": torch.__version__}
        (Path(out_dir) / "selfcheck.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    Path(argv[1]).mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(argv[0], argv[1], free_port()), nprocs=WORLD)
    print(Path(argv[1], "selfcheck.json").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
