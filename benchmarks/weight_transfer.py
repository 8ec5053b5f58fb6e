"""Weight transfer through the store: publish → loaded latency vs a raw copy of the same bytes,
and delta publication (train.weight_delta) on real optimizer steps.

    PYTHONPATH=. .venv/bin/python benchmarks/weight_transfer.py --out /tmp/weight_transfer.json
    PYTHONPATH=. .venv/bin/python benchmarks/weight_transfer.py --models tiny --s3   # + a moto S3 store
    PYTHONPATH=. .venv/bin/python benchmarks/weight_transfer.py --models smollm2 --steps 3 --repeats 2

For each model (the default tiny model, ModelConfig(); and a larger shape from the flags) the
benchmark makes a chain of real weight versions: AdamW (the trainer's betas, lr --lr) steps on
the SFT loss of arithmetic-task batches, after --warmup steps so Adam's first (±lr) step is not
measured. Then, on a store (a local folder; with --s3 also a moto S3 server):

  raw copy        the store's write of the same safetensors bytes to a new object + a read back
                  (no hashing; the objects are kept during the repeats, as published versions
                  are), and on a local store also shutil.copyfile of the file
  serialize       state_dict_bytes(model): the safetensors bytes the trainer publishes
  publish         WeightPublisher.publish: sha256 + weights/v{N}/ files + MANIFEST.json + LATEST
  publish→loaded  from the publish call to the moment a reader in another process (the rollout
                  worker's WeightWatcher, polling LATEST every --poll s) has verified the
                  checksums and holds the state dict (load_state_dict, the worker's load path)
  delta           the same with WeightPublisher(delta=True): stored bytes, publish, publish→loaded
                  for a reader that follows every version, and a late joiner's load of the last
                  version (full snapshot + every delta after it)

  adapter         (pretrained models, --lora-rank) the chain trained with LoRA instead, each
                  version published as the adapter alone (WeightPublisher.publish_adapter):
                  stored bytes, publish, publish→loaded for a reader holding the base (it merges
                  the adapter into init_model's weights, the engines' load path), and staging a
                  whole merged checkpoint for a server (reader.stage_verified, what vLLM loads)

  vllm            (with --vllm) the same LoRA chain into a running vLLM server, publish → serving
                  (publish_adapter, then VLLMEngine.receive until the server serves it): merged
                  (the adapter merged into init_model, staged whole, reload_weights) vs native
                  (the adapter alone staged, /v1/load_lora_adapter as `v{N}`); --vllm-only skips
                  the full, delta and reader measurements

`--models smollm2` measures the real SmolLM2-135M-Instruct (areal_core.pretrained, fetched and
converted once), trained on the arithmetic problems as chat questions.
Medians over versions/repeats. Other lrs in --lrs are measured for delta size only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from areal_core.config import ModelConfig, RolloutConfig, TaskConfig
from areal_core.models import build_tiny_model, build_tokenizer, sft_loss
from areal_core.store import Store
from areal_core.train.sft import sft_examples
from areal_core.weights import sha256
from areal_core.weights.delta import encode_delta
from areal_core.weights.publisher import WeightPublisher, state_dict_bytes
from areal_core.weights.reader import load_state_dict, load_weights_bytes
from task_data.registry import load_task

SIDE = {"config.json": b'{"model_type": "qwen2"}'}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn) -> tuple[float, Any]:
    t0 = time.monotonic()
    out = fn()
    return time.monotonic() - t0, out


# -- a chain of real versions -------------------------------------------------------------------
def version_chain(cfg: ModelConfig, lr: float, steps: int, warmup: int, batch: int, seed: int) -> tuple[Any, list]:
    """(model, [safetensors bytes]) of `steps` + 1 consecutive AdamW versions after `warmup` steps."""
    train, _ = load_task(TaskConfig(num_train=512, num_eval=16), seed)
    tokenizer = build_tokenizer([r["prompt"] + "\n" + r["answer"] for r in train], cfg.vocab_size)
    examples = sft_examples(tokenizer, train)
    model = build_tiny_model(cfg, len(tokenizer), seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))  # as the trainer
    rng = random.Random(seed)

    def step() -> None:
        loss = sft_loss(model, rng.sample(examples, batch), tokenizer.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(warmup):
        step()
    blobs = [state_dict_bytes(model)]
    for _ in range(steps):
        step()
        blobs.append(state_dict_bytes(model))
    return model, blobs


def pretrained_chain(path: str, lr: float, steps: int, warmup: int, batch: int, seed: int, lora_rank: int = 0):
    """(model, versions) of a pretrained checkpoint: safetensors bytes per version, or with
    `lora_rank` the adapter files (train/lora.py) per version of a LoRA-wrapped copy."""
    from areal_core.models import load_pretrained
    from areal_core.train.lora import adapter_files, apply_lora

    model, tokenizer = load_pretrained(path)
    train, _ = load_task(TaskConfig(num_train=256, num_eval=16), seed)
    examples = sft_examples(tokenizer, train)
    if lora_rank:
        model = apply_lora(model, r=lora_rank, alpha=2.0 * lora_rank)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    rng = random.Random(seed)
    snapshot = (lambda: adapter_files(model)) if lora_rank else (lambda: state_dict_bytes(model))
    versions = []
    for i in range(warmup + steps + 1):
        if i >= warmup:
            versions.append(snapshot())
        if i < warmup + steps:
            loss = sft_loss(model, rng.sample(examples, batch), tokenizer.pad_token_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
    return model, versions


def measure_adapter(store_uri: str, init_path: str, adapters: list[dict[str, bytes]], args) -> dict[str, Any]:
    """LoRA versions on a store whose init_model is `init_path`: stored bytes, publish and
    publish→loaded (a reader merging into the base), and staging a merged checkpoint."""
    from areal_core.layout import LAYOUT
    from areal_core.weights.reader import stage_verified

    uri = f"{store_uri}/lora-{uuid.uuid4().hex[:6]}"
    store = Store(uri)
    store.put_dir(init_path, LAYOUT.init_model)
    store.write_json(LAYOUT.committed(LAYOUT.init_model), {})
    rows = publish_followed(uri, adapters, False, args.full_every, args.poll)[1:]  # v0 also reads the base
    staged = []
    for v in range(1, len(adapters)):
        t, _ = timed(
            lambda v=v: stage_verified(store, v, Path(tempfile.mkdtemp(prefix="stage-", dir=args.root or None)))
        )
        staged.append(t)
    return {
        "adapter_mb": med([r["bytes"] / 1e6 for r in rows]),
        "adapter_publish_s": med([r["publish_s"] for r in rows]),
        "adapter_loaded_s": med([r["loaded_s"] for r in rows]),
        "adapter_stage_merged_s": med(staged),
    }


VLLM_MODES = ("merged", "native")


def measure_vllm(uri: str, init_path: str, adapters: list[dict[str, bytes]], mode: str, args) -> dict[str, Any]:
    """LoRA versions into a running vLLM server (idle): per version, publish → serving s (publish,
    stage + check, server paused), merged into a whole checkpoint or loaded as an adapter."""
    from areal_core.layout import LAYOUT
    from areal_core.rollout.vllm_engine import VLLMEngine
    from areal_core.rollout.vllm_server import VLLMServerSpec

    store = Store(uri)
    store.put_dir(init_path, LAYOUT.init_model)
    store.write_json(LAYOUT.committed(LAYOUT.init_model), {})
    side = {p.name: p.read_bytes() for p in Path(init_path).iterdir() if p.suffix != ".safetensors" and p.is_file()}
    side.pop(LAYOUT.manifest_name, None)
    pub = WeightPublisher(store, side)
    pub.publish_adapter(0, adapters[0])
    native = mode == "native"
    spec = VLLMServerSpec(kv_cache_mb=256, max_model_len=256, lora_rank=args.lora_rank if native else 0)
    t_start, engine = timed(lambda: VLLMEngine.launch(store, 0, None, spec, native_lora=native))
    rows = []
    try:
        for v in range(1, len(adapters)):
            t0 = time.monotonic()
            publish_s = pub.publish_adapter(v, adapters[v])
            engine.receive(store, v)
            rows.append({"publish_s": publish_s, "serving_s": time.monotonic() - t0, **engine.last_update})
    finally:
        engine.close()
    return {
        "server_start_s": t_start,
        "publish_to_serving_s": med([r["serving_s"] for r in rows]),
        "stage_s": med([r["stage_s"] for r in rows]),
        "paused_s": med([r["paused_s"] for r in rows]),
        "publish_s": med([r["publish_s"] for r in rows]),
        "each_s": [round(r["serving_s"], 3) for r in rows],
    }


# -- the reader: the rollout worker's WeightWatcher in its own process ---------------------------
def _reader(uri: str, poll_s: float, queue, stop) -> None:
    from areal_core.weights.watcher import WeightWatcher

    torch.set_num_threads(1)
    store = Store(uri)

    def on_version(version: int) -> None:  # what an in-process engine's receive does: read + verify
        state_dict = load_state_dict(store, version)
        queue.put((version, time.monotonic(), sum(t.numel() for t in state_dict.values())))

    watcher = WeightWatcher(store, on_version, poll_s)
    watcher.start()
    queue.put(("ready", time.monotonic(), 0))
    stop.wait()
    watcher.stop()


def publish_followed(uri: str, blobs: list[bytes], delta: bool, full_every: int, poll_s: float) -> list[dict]:
    """Publish `blobs` as versions 0.. on `uri` with a reader process following; per version:
    stored bytes, publish seconds, publish→loaded seconds."""
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_reader, args=(uri, poll_s, queue, stop), daemon=True)
    proc.start()
    try:
        if queue.get(timeout=120)[0] != "ready":
            raise RuntimeError("reader did not start")
        pub = WeightPublisher(Store(uri), SIDE, delta=delta, full_every=full_every)
        rows = []
        for v, blob in enumerate(blobs):
            t0 = time.monotonic()
            publish_s = pub.publish_adapter(v, blob) if isinstance(blob, dict) else pub.publish(v, blob)
            while True:
                got, t_loaded, _ = queue.get(timeout=120)
                if got == v:
                    break
            rows.append(
                {"version": v, "bytes": pub.last_weights_bytes, "publish_s": publish_s, "loaded_s": t_loaded - t0}
            )
        return rows
    finally:
        stop.set()
        proc.join(timeout=30)


# -- one model on one store ----------------------------------------------------------------------
def measure(store_uri: str, model, blobs: list[bytes], args) -> dict[str, Any]:
    store = Store(store_uri)
    blob = blobs[-1]
    raw, copy = [], []
    for i in range(args.repeats):
        name = f"scratch/raw-{i}.bin"
        t_w, _ = timed(lambda name=name: store.write_bytes(name, blob))
        t_r, back = timed(lambda name=name: store.read_bytes(name))
        assert back == blob
        raw.append(t_w + t_r)
        if store.local:
            t_c, _ = timed(lambda name=name: shutil.copyfile(store.local_path(name), store.local_path(name + ".copy")))
            copy.append(t_c)
    store.delete("scratch", recursive=True)  # kept until here, as published versions are
    serialize = [timed(lambda: state_dict_bytes(model))[0] for _ in range(args.repeats)]
    hashing = [timed(lambda: sha256(blob))[0] for _ in range(args.repeats)]
    full = publish_followed(f"{store_uri}/full-{uuid.uuid4().hex[:6]}", blobs, False, args.full_every, args.poll)
    delta_uri = f"{store_uri}/delta-{uuid.uuid4().hex[:6]}"
    delta = publish_followed(delta_uri, blobs, True, args.full_every, args.poll)
    deltas = [r for r in delta if r["version"] % args.full_every]  # delta-stored versions only
    last = len(blobs) - 1
    late_delta = []
    for _ in range(args.repeats):  # a reader with nothing cached: full snapshot + every delta after it
        t, data = timed(lambda: load_weights_bytes(Store(delta_uri), last))
        assert data == blob
        late_delta.append(t + timed(lambda data=data: st_load(data))[0])
    full_uri = f"{store_uri}/full-late-{uuid.uuid4().hex[:6]}"
    WeightPublisher(Store(full_uri), SIDE).publish(last, blob)
    late_full = [timed(lambda: load_state_dict(Store(full_uri), last))[0] for _ in range(args.repeats)]
    mb = len(blob) / 1e6
    out = {
        "store": "s3 (moto)" if store_uri.startswith("s3://") else "local folder",
        "mb": mb,
        "raw_copy_s": med(raw),
        "raw_mb_per_s": mb / med(raw),
        "file_copy_s": med(copy) if copy else None,
        "serialize_s": med(serialize),
        "sha256_s": med(hashing),
        "full_publish_s": med([r["publish_s"] for r in full]),
        "full_loaded_s": med([r["loaded_s"] for r in full]),
        "delta_mb": med([r["bytes"] / 1e6 for r in deltas]),
        "delta_bytes_each": [r["bytes"] for r in deltas],
        "delta_publish_s": med([r["publish_s"] for r in deltas]),
        "delta_loaded_s": med([r["loaded_s"] for r in deltas]),
        "late_join_deltas": last - last // args.full_every * args.full_every,
        "late_join_delta_load_s": med(late_delta),
        "late_join_full_load_s": med(late_full),
        "versions": len(blobs),
    }
    out["delta_saving"] = 1 - out["delta_mb"] / mb
    out["full_loaded_over_raw"] = out["full_loaded_s"] / out["raw_copy_s"]
    return out


def delta_sizes(blobs: list[bytes]) -> dict[str, float]:
    sizes = [len(encode_delta(a, b)[0]) for a, b in zip(blobs, blobs[1:])]
    full = len(blobs[-1])
    import zstandard

    return {
        "full_mb": full / 1e6,
        "delta_mb": med(sizes) / 1e6,
        "delta_saving": 1 - med(sizes) / full,
        "zstd_of_full_saving": 1 - len(zstandard.ZstdCompressor(level=1).compress(blobs[-1])) / full,
    }


# -- S3 (moto) -----------------------------------------------------------------------------------
def start_moto() -> tuple[subprocess.Popen, str]:
    import socket
    import urllib.request

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    bucket = f"wt-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return proc, f"s3://{bucket}"


def measure_pretrained(name: str, root: Path, args, bucket: str | None) -> dict[str, Any]:
    """Full, delta and LoRA-adapter publication of a real checkpoint (areal_core.pretrained)."""
    from areal_core.pretrained import ensure

    path = str(ensure(name))
    uri = bucket and f"{bucket}/{name}" or str(root / name)
    out = {"model": f"{name} (full fine-tuning, lr {args.lr:g})"}
    if not args.vllm_only:
        t_chain, (model, blobs) = timed(
            lambda: pretrained_chain(path, args.lr, args.steps, args.warmup, args.batch, args.seed)
        )
        print(f"{name}: {len(blobs[0]) / 1e6:.1f} MB, {args.steps} full steps in {t_chain:.0f}s", flush=True)
        out.update(measure(uri, model, blobs, args))
        print(markdown([out]), flush=True)
        del model, blobs
    t_chain, (_, adapters) = timed(
        lambda: pretrained_chain(path, args.lr * 10, args.steps, args.warmup, args.batch, args.seed, args.lora_rank)
    )
    print(f"{name}: LoRA r={args.lora_rank}, {args.steps} steps in {t_chain:.0f}s", flush=True)
    if args.vllm:
        out["vllm"] = {
            mode: measure_vllm(str(root / f"vllm-{mode}"), path, adapters, mode, args) for mode in VLLM_MODES
        }
        for mode, r in out["vllm"].items():
            print(
                f"| vLLM {mode} | publish {r['publish_s']:.2f} s | stage {r['stage_s']:.2f} s"
                f" | paused {r['paused_s']:.2f} s | publish → serving {r['publish_to_serving_s']:.2f} s"
                f" | server start {r['server_start_s']:.0f} s |",
                flush=True,
            )
    if args.vllm_only:
        return out
    out.update(lora_rank=args.lora_rank, **measure_adapter(uri, path, adapters, args))
    print(
        f"| {name} LoRA r={out['lora_rank']} | {out['adapter_mb']:.2f} MB | publish {out['adapter_publish_s']:.3f} s |"
        f" publish→loaded {out['adapter_loaded_s']:.3f} s | stage merged {out['adapter_stage_merged_s']:.3f} s |",
        flush=True,
    )
    return out


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | store | MB | raw copy s (MB/s) | serialize s | publish s | publish→loaded s | loaded / raw |"
        " delta MB (saving) | delta publish s | delta publish→loaded s | late join s: full + n deltas vs full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in results if "mb" in r):
        lines.append(
            f"| {r['model']} | {r['store']} | {r['mb']:.1f} | {r['raw_copy_s']:.3f} ({r['raw_mb_per_s']:.0f}) |"
            f" {r['serialize_s']:.3f} | {r['full_publish_s']:.3f} | {r['full_loaded_s']:.3f} |"
            f" {r['full_loaded_over_raw']:.1f}× | {r['delta_mb']:.2f} ({100 * r['delta_saving']:.0f}%) |"
            f" {r['delta_publish_s']:.3f} | {r['delta_loaded_s']:.3f} |"
            f" {r['late_join_delta_load_s']:.3f} (n={r['late_join_deltas']}) vs {r['late_join_full_load_s']:.3f} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,large", help="comma list of tiny, large, smollm2")
    ap.add_argument("--lora-rank", type=int, default=16, help="pretrained models: the LoRA chain's rank")
    ap.add_argument("--hidden", type=int, default=1024, help="large model: hidden size")
    ap.add_argument("--layers", type=int, default=8, help="large model: layers")
    ap.add_argument("--intermediate", type=int, default=ModelConfig().intermediate_size, help="large model: MLP width")
    lr_help = "AdamW lr of the measured chain (configs/default.yaml: 1e-4)"
    ap.add_argument("--lr", type=float, default=1e-4, help=lr_help)
    ap.add_argument("--lrs", default="1e-3", help="extra lrs, delta size only (comma list; empty: none)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps in the chain (versions - 1)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--full-every", type=int, default=8, help="train.weight_full_every")
    poll_help = f"reader poll interval (rollout default {RolloutConfig().poll_interval_s})"
    ap.add_argument("--poll", type=float, default=0.002, help=poll_help)
    ap.add_argument("--root", default="", help="local store folder (default: a temp folder)")
    ap.add_argument("--s3", action="store_true", help="also measure on a moto S3 server")
    ap.add_argument("--vllm", action="store_true", help="smollm2: LoRA versions into vLLM, merged vs native")
    ap.add_argument("--vllm-only", action="store_true", help="with --vllm: only the vLLM measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    return ap.parse_args()


def measure_shape(
    name: str, cfg: ModelConfig, root: Path, bucket: str | None, args: argparse.Namespace
) -> tuple[list[dict], list[dict]]:
    """One model shape's version chain, measured on the local store (and S3's `bucket`), and its
    delta sizes at --lr and every --lrs: (results, sizes)."""
    results, sizes = [], []
    label = f"{name} (h{cfg.hidden_size} L{cfg.num_layers} i{cfg.intermediate_size})"
    t_chain, (model, blobs) = timed(lambda: version_chain(cfg, args.lr, args.steps, args.warmup, args.batch, args.seed))
    print(f"{label}: {len(blobs[0]) / 1e6:.1f} MB, {args.steps} steps in {t_chain:.0f}s", flush=True)
    sizes.append({"model": label, "lr": args.lr, **delta_sizes(blobs)})
    uris = [str(root / name)] + ([f"{bucket}/{name}"] if bucket else [])
    for uri in uris:
        results.append({"model": label, **measure(uri, model, blobs, args)})
        print(markdown(results[-1:]), flush=True)
    for lr in [float(x) for x in args.lrs.split(",") if x]:
        _, (_, other) = timed(lambda lr=lr: version_chain(cfg, lr, args.steps, args.warmup, args.batch, args.seed))
        sizes.append({"model": label, "lr": lr, **delta_sizes(other)})
    return results, sizes


def print_tables(results: list[dict], sizes: list[dict]) -> None:
    """The timing table, then the delta sizes, as markdown."""
    print(f"\n{markdown(results)}\n")
    print("| model | AdamW lr | full MB | delta MB (median over steps) | delta saving | zstd of the full file |")
    print("|---|---|---|---|---|---|")
    for s in sizes:
        print(
            f"| {s['model']} | {s['lr']:g} | {s['full_mb']:.2f} | {s['delta_mb']:.2f} | "
            f"{100 * s['delta_saving']:.1f}% | {100 * s['zstd_of_full_saving']:.1f}% |"
        )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    shapes = {
        "tiny": ModelConfig(),
        "large": ModelConfig(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=args.intermediate),
    }
    root = Path(args.root or tempfile.mkdtemp(prefix="weight-transfer-"))
    moto, bucket = None, None
    results, sizes = [], []
    try:
        if args.s3:
            moto, bucket = start_moto()
        for name in args.models.split(","):
            if name == "smollm2":
                results.append(measure_pretrained(name, root, args, bucket))
                continue
            shape_results, shape_sizes = measure_shape(name, shapes[name], root, bucket, args)
            results += shape_results
            sizes += shape_sizes
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=10)
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    print_tables(results, sizes)
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "load": os.getloadavg()}
    meta.update(vars(args))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "sizes": sizes}, indent=1))


if __name__ == "__main__":
    main()
