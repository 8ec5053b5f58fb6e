"""Load test of the agent proxy on 127.0.0.1: N concurrent sessions x T turns, checked for lost
or mixed turns, with the proxy's overhead per call against calling the engine directly.

    PYTHONPATH=. .venv/bin/python benchmarks/proxy_load.py [--sessions 200] [--turns 5] [--out docs/benchmarks_proxy.md]

The proxy runs as its own process (`python -m areal_core.proxy`, one torch thread)
over a tiny random Qwen2 checkpoint; the client is this process (one event loop, a minimal keep-alive HTTP/1.1 client).
Half the sessions are keyed by their own API key, half by X-Session-Id under a shared key.

Overhead per call = client-observed latency − the engine time of the batched generate() call
the request ran in (reported by the server in `areal.timing.engine_s`). It holds HTTP, JSON,
auth, templating, session bookkeeping and the wait for the engine thread (queue_s, shown
apart). The direct baseline calls TorchEngine.generate in-process on the same prompts.
Decoding is greedy on both sides, so the proxy and the direct engine do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_core.config import ModelConfig  # noqa: E402
from areal_core.models import build_tiny_model, build_tokenizer, save_pretrained  # noqa: E402
from areal_core.proxy.templating import ChatTemplate  # noqa: E402
from areal_core.rollout.engine import SamplingParams  # noqa: E402
from areal_core.rollout.torch_engine import TorchEngine  # noqa: E402

CORPUS = [
    "Ann has 23 pens and gets 45 more. How many pens now?",
    "23+45=68\n#### 68",
    "session turn question answer please continue",
]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def user_text(i: int, t: int) -> str:
    return f"session {i} turn {t} question"


class Conn:
    """A minimal keep-alive HTTP/1.1 JSON client on one connection. httpx's pool costs more CPU
    than the proxy itself at 200 connections on 2 cores, so it would measure the client."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict, headers: dict) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode()
        head = f"POST /v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await self.writer.drain()
        status_line, *lines = (await self.reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        length = next(int(v) for k, _, v in (ln.partition(":") for ln in lines) if k.lower() == "content-length")
        payload = json.loads(await self.reader.readexactly(length))
        status = int(status_line.split()[1])
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {payload}")
        return payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def session(port: int, i: int, key: str, turns: int, max_tokens: int, shared: bool) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    if shared:
        headers["X-Session-Id"] = f"load-{i}"
    conn = Conn(port)
    msgs: list[dict] = []
    calls = []
    for t in range(turns):
        msgs.append({"role": "user", "content": user_text(i, t)})
        t0 = time.perf_counter()
        body = await conn.post(
            "/chat/completions", {"model": "m", "messages": msgs, "max_tokens": max_tokens, "temperature": 0}, headers
        )
        lat = time.perf_counter() - t0
        msgs.append(body["choices"][0]["message"])
        calls.append({"latency": lat, **body["areal"]})
    sid = calls[0]["session_id"]
    end = await conn.post(f"/sessions/{sid}/end", {"return_trajectory": True, "reward": 1.0}, headers)
    conn.close()
    return {"i": i, "calls": calls, "end": end}


def check(results: list[dict], tok, turns: int) -> dict:
    """No lost turn (every session has all its turns in one row) and no mixed turn (a row holds
    exactly its own user messages, in order, and exactly the ids served to it)."""
    lost = mixed = 0
    sids = set()
    for res in results:
        i, calls, end = res["i"], res["calls"], res["end"]
        sids.add(calls[0]["session_id"])
        rows = end["trajectories"]
        if len(calls) != turns or len(rows) != 1 or end["turns"] != turns:
            lost += 1
            continue
        row = rows[0]
        ok = row["input_ids"] == calls[-1]["prompt_token_ids"] + calls[-1]["token_ids"]
        for a, b in zip(calls, calls[1:]):
            ok &= b["prompt_token_ids"][: len(a["prompt_token_ids"]) + len(a["token_ids"])] == (
                a["prompt_token_ids"] + a["token_ids"]
            )
        served = sum(len(c["token_ids"]) for c in calls)
        ok &= sum(row["loss_mask"]) == served and all(c["session_id"] == calls[0]["session_id"] for c in calls)
        text = tok.decode(row["input_ids"])
        users = [seg.split("<|im_end|>")[0] for seg in text.split("<|im_start|>user\n")[1:]]
        ok &= users == [user_text(i, t) for t in range(turns)]
        mixed += 0 if ok else 1
    return {"lost": lost, "mixed": mixed, "distinct_sessions": len(sids)}


def direct_engine(model, tok, prompts: list[list[int]], max_tokens: int, reps: int) -> dict:
    engine = TorchEngine(model, tok.pad_token_id, tok.eos_token_id, 0, seed=0)
    params = SamplingParams(max_new_tokens=max_tokens, greedy=True, temperature=0.0)
    engine.generate(prompts[:1], params)  # warm-up
    single = []
    for p in prompts[:reps]:
        t0 = time.perf_counter()
        engine.generate([p], params)
        single.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return {"single": single, "batch_s": time.perf_counter() - t0}


SHARED_KEY = "sk-load-shared"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--sequential-calls", type=int, default=100)
    ap.add_argument("--out", default="")
    return ap.parse_args()


def tiny_checkpoint() -> tuple[Any, Any, str]:
    """A tiny random Qwen2 (hidden 32, 1 layer) and its tokenizer, saved to a temp folder: (tok, model, folder)."""
    tok = build_tokenizer(CORPUS, 300)
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cfg.max_position_embeddings = 512
    model = build_tiny_model(cfg, len(tok), 0)
    tmp = tempfile.mkdtemp(prefix="proxy-load-")
    save_pretrained(model, tok, tmp)
    return tok, model, tmp


def start_proxy(folder: str, keys: list[str], port: int) -> subprocess.Popen:
    """The proxy over `folder` as its own process (one torch thread), accepting `keys`
    ($PROXY_LOAD_SERVER: another module to start instead of areal_core.proxy)."""
    env = {**os.environ, "AREAL_PROXY_KEYS": ",".join(keys), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [
            sys.executable,
            *os.environ.get("PROXY_LOAD_SERVER", "-m areal_core.proxy").split(),
            "--model",
            folder,
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def wait_started(server: subprocess.Popen, port: int) -> None:
    """Until the proxy answers /health; SystemExit with its stderr's end after 120 s or if it exits."""
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline or server.poll() is not None:
            raise SystemExit(f"proxy did not start: {server.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)


async def sequential_calls(port: int, args: argparse.Namespace) -> list[dict]:
    """One call at a time, a fresh session per call (no batching, no queue), after 3 warm-up calls."""
    conn = Conn(port)
    seq = []
    for k in range(3):  # warm-up (first forward passes, allocator)
        await conn.post(
            "/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": args.max_tokens},
            {"Authorization": f"Bearer {SHARED_KEY}", "X-Session-Id": f"warm-{k}"},
        )
    for k in range(args.sequential_calls):
        t0 = time.perf_counter()
        body = await conn.post(
            "/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": user_text(k, 0)}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
            },
            {"Authorization": f"Bearer {SHARED_KEY}", "X-Session-Id": f"seq-{k}"},
        )
        seq.append({"latency": time.perf_counter() - t0, **body["areal"]})
    conn.close()
    return seq


async def load(port: int, args: argparse.Namespace, own_keys: list[str]) -> tuple[list[dict], list[dict], float]:
    """The sequential calls, then every session at once (the first half under their own keys, the rest by
    X-Session-Id under the shared key): (sequential calls, sessions, the sessions' wall seconds)."""
    seq = await sequential_calls(port, args)
    n_own = len(own_keys)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(
            session(port, i, own_keys[i] if i < n_own else SHARED_KEY, args.turns, args.max_tokens, i >= n_own)
            for i in range(args.sessions)
        )
    )
    return seq, results, time.perf_counter() - t0


def engine_alone(model, tok, seq: list[dict], results: list[dict], args: argparse.Namespace) -> tuple[dict, float]:
    """The direct engine on the same first-turn prompts (single calls), and the same load on the engine alone,
    perfectly batched: one generate() per turn over the prompts the proxy fed at that turn (all sessions at
    once): (direct_engine's timings, the batched rounds' seconds)."""
    t = ChatTemplate(tok, tool_prompt="none")
    prompts = [
        t.render([{"role": "user", "content": user_text(k, 0)}], generation_prompt=True) for k in range(len(seq))
    ]
    direct = direct_engine(model, tok, prompts, args.max_tokens, len(seq))
    rounds = [[r["calls"][t]["prompt_token_ids"] for r in results] for t in range(args.turns)]
    direct_rounds_s = sum(direct_engine(model, tok, prompts_t, args.max_tokens, 0)["batch_s"] for prompts_t in rounds)
    return direct, direct_rounds_s


def correctness_section(args: argparse.Namespace, n_calls: int, verdict: dict) -> list[str]:
    cpu = platform.processor() or platform.machine()
    machine = f"{os.cpu_count()} vCPU, {cpu}, Python {platform.python_version()}, torch {torch.__version__}"
    return [
        "# Proxy load test",
        "",
        f"`benchmarks/proxy_load.py --sessions {args.sessions} --turns {args.turns} --max-tokens {args.max_tokens}` "
        f"on {machine}; load average at start {os.getloadavg()[0]:.1f} (the machine is shared).",
        "Proxy: its own process (uvicorn, h11, one event loop, one torch thread) over a tiny random Qwen2 "
        "(hidden 32, 1 layer); client: one process, one keep-alive connection per session (a minimal asyncio "
        "HTTP/1.1 client), all sessions at once, 127.0.0.1 only. Greedy decoding, so the proxy and the "
        "direct engine do the same work.",
        "",
        "## Correctness",
        "",
        "| sessions | turns each | calls | lost turns | mixed turns | distinct session ids |",
        "|---|---|---|---|---|---|",
        f"| {args.sessions} | {args.turns} | {n_calls} | {verdict['lost']} | {verdict['mixed']} | "
        f"{verdict['distinct_sessions']} |",
        "",
        "Each session's row must equal the ids served to it turn by turn, hold exactly its own user "
        "messages in order, and have loss_mask on exactly the served tokens.",
        "",
    ]


def latency_section(args: argparse.Namespace, seq: list[dict], calls: list[dict], direct: dict) -> list[str]:
    lat = [c["latency"] for c in calls]
    over = [c["latency"] - c["timing"]["engine_s"] for c in calls]
    queue = [c["timing"]["queue_s"] for c in calls]
    server_s = [c["timing"]["server_s"] for c in calls]
    engine_s = [c["timing"]["engine_s"] for c in calls]
    batch = [c["timing"]["batch_size"] for c in calls]
    seq_lat = [c["latency"] for c in seq]
    seq_over = [c["latency"] - c["timing"]["engine_s"] for c in seq]
    return [
        "## Latency and overhead per call (ms)",
        "",
        "| mode | p50 latency | p99 latency | p50 overhead | p99 overhead | p50 queue | p99 queue | mean batch |",
        "|---|---|---|---|---|---|---|---|",
        f"| sequential, 1 at a time ({len(seq)} calls) | {ms(pct(seq_lat, 50))} | {ms(pct(seq_lat, 99))} | "
        f"{ms(pct(seq_over, 50))} | {ms(pct(seq_over, 99))} | {ms(pct([c['timing']['queue_s'] for c in seq], 50))} | "
        f"{ms(pct([c['timing']['queue_s'] for c in seq], 99))} | 1.0 |",
        f"| {args.sessions} concurrent x {args.turns} turns | {ms(pct(lat, 50))} | {ms(pct(lat, 99))} | "
        f"{ms(pct(over, 50))} | {ms(pct(over, 99))} | {ms(pct(queue, 50))} | {ms(pct(queue, 99))} | "
        f"{statistics.mean(batch):.1f} |",
        "",
        f"Under load, the server-side time (request arrival to response built) was p50 {ms(pct(server_s, 50))} / "
        f"p99 {ms(pct(server_s, 99))} ms, of which the batched generate() call p50 {ms(pct(engine_s, 50))} / "
        f"p99 {ms(pct(engine_s, 99))} ms.",
        "",
        "| direct engine (in-process), same first-turn prompts | p50 | p99 |",
        "|---|---|---|",
        f"| generate([prompt]) single call | {ms(pct(direct['single'], 50))} | {ms(pct(direct['single'], 99))} |",
        f"| proxy − direct, sequential | {ms(pct(seq_lat, 50) - pct(direct['single'], 50))} | "
        f"{ms(pct(seq_lat, 99) - pct(direct['single'], 99))} |",
        "",
    ]


def throughput_section(args: argparse.Namespace, n_calls: int, load_s: float, direct_rounds_s: float) -> list[str]:
    return [
        "## Throughput",
        "",
        "| | wall s | calls/s |",
        "|---|---|---|",
        f"| proxy, {args.sessions} sessions x {args.turns} turns (+{args.sessions} session ends) | {load_s:.2f} | "
        f"{n_calls / load_s:.0f} |",
        f"| engine alone: {args.turns} generate() calls of {args.sessions} prompts (the prompts the proxy fed) | "
        f"{direct_rounds_s:.2f} | {n_calls / direct_rounds_s:.0f} |",
        "",
        "overhead = latency − engine time of the generate() call the request was batched into; queue = "
        "time waiting for the engine thread while it ran earlier batches (included in overhead).",
    ]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    tok, model, folder = tiny_checkpoint()
    own_keys = [f"sk-load-{i}" for i in range(args.sessions // 2)]
    port = free_port()
    server = start_proxy(folder, [SHARED_KEY, *own_keys], port)
    try:
        wait_started(server, port)
        seq, results, load_s = asyncio.run(load(port, args, own_keys))
    finally:
        server.terminate()
        server.wait(timeout=30)
    verdict = check(results, tok, args.turns)
    calls = [c for r in results for c in r["calls"]]
    direct, direct_rounds_s = engine_alone(model, tok, seq, results, args)
    lines = (
        correctness_section(args, len(calls), verdict)
        + latency_section(args, seq, calls, direct)
        + throughput_section(args, len(calls), load_s, direct_rounds_s)
    )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    if verdict["lost"] or verdict["mixed"]:
        raise SystemExit(f"lost or mixed turns: {verdict}")


if __name__ == "__main__":
    main()
