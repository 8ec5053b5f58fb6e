"""Which weights did the rollout engine really sample from? Each sampled token's behaviour log-prob
against the float32 model of the version it is labelled with, and of the versions around it.

    PYTHONPATH=. .venv/bin/python benchmarks/served_version_check.py --run runs/x-vllm-native-s3/vllm-native
        [--n 48] [--offsets -2 -1 0 1] [--skip 0] [--out served.json]

The run is a finished run of `benchmarks/vllm_rl.py` (its store holds init_model, its last
published versions and the graded shards). For --n graded samples (after the first --skip) whose
versions are all still in the store with room for the offsets (a run keeps only its last few
versions), each response is cut into segments of one version label v. For each offset k the
float32 model of version v + k (`weights.reader.load_state_dict`: a LoRA version merged into
init_model) scores the segment's tokens teacher-forced at the rollout temperature:

    err(k) = mean over tokens of |log π_behav(t) − log π_{v+k}(t)|.

If the engine served the version it labels, err(0) is the smallest (the floor is bf16 against
float32: 0.013 nats for the built-in engine here); a stale adapter shows as a smaller err(−1) or
err(−2). Also reported: the signed gap log π_behav − log π_v of the end token of the responses
that stopped (an engine that under-samples stopping shows it clearly below 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

from areal_core.layout import LAYOUT
from areal_core.protocol import decode_shard
from areal_core.store import Store
from areal_core.weights.reader import load_state_dict
from benchmarks.smollm2_rl import load_model
from benchmarks.vllm_rl import cpu_name


def segments(versions: list[int], mask: list[int]) -> list[tuple[int, int, int]]:
    """(version, start, end) spans of policy tokens with one version label, end exclusive."""
    out: list[tuple[int, int, int]] = []
    for t, (v, m) in enumerate(zip(versions, mask)):
        if not m:
            continue
        if out and out[-1][0] == v and out[-1][2] == t:
            out[-1] = (v, out[-1][1], t + 1)
        else:
            out.append((v, t, t + 1))
    return out


def token_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of ids[t] given ids[:t], for t = 1..len−1 (index t−1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--offsets", type=int, nargs="+", default=[-2, -1, 0, 1])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    store = Store(a.run)
    from areal_core.context import load_run_config

    cfg = load_run_config(store)
    temperature = cfg.rollout.temperature
    rows = []
    for name in sorted(store.find(LAYOUT.graded_dir, ".arrow")):
        rows += decode_shard(store.read_bytes(name))
    rows.sort(key=lambda s: s.created_at)
    pre = LAYOUT.version_prefix
    kept = sorted(int(n[len(pre) :]) for n in store.listdir(LAYOUT.weights_root) if n.startswith(pre))
    oldest, latest = kept[0], kept[-1]  # a run keeps its last few versions (train.keep_versions)
    usable = [s for s in rows if s.min_version() >= oldest - min(a.offsets, default=0)]
    picked = usable[a.skip : a.skip + a.n]
    model, _ = load_model(f"{a.run}/{LAYOUT.init_model}")
    work: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)  # version -> (row, start, end, label)
    for i, s in enumerate(picked):
        for v, t0, t1 in segments(s.versions, s.loss_mask):
            for k in a.offsets:
                if oldest <= v + k <= latest:
                    work[v + k].append((i, t0, t1, v))
    errs: dict[int, list[float]] = defaultdict(list)
    stop_gap: list[float] = []  # log π_behav − log π_v of the end token of responses that stopped
    for version in sorted(work):
        model.load_state_dict(load_state_dict(store, version), strict=False)
        cache: dict[int, torch.Tensor] = {}
        for i, t0, t1, label in work[version]:
            if i not in cache:
                cache[i] = token_logprobs(model, picked[i].input_ids, temperature)
            lp = cache[i][t0 - 1 : t1 - 1]
            behav = torch.tensor(picked[i].behav_logprobs[t0:t1])
            errs[version - label] += (behav - lp).abs().tolist()
            if version == label and t1 == len(picked[i].input_ids) and picked[i].finish_reason == "stop":
                stop_gap.append(float(behav[-1] - lp[-1]))
    res = {
        "run": a.run,
        "cpu": cpu_name(),
        "samples": len(picked),
        "tokens": len(errs[0]),
        "temperature": temperature,
        "err": {str(k): round(statistics.mean(v), 4) for k, v in sorted(errs.items()) if v},
        "stop_tokens": len(stop_gap),
        "stop_token_gap_mean": round(statistics.mean(stop_gap), 4) if stop_gap else None,
    }
    print("RESULT " + json.dumps(res), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
