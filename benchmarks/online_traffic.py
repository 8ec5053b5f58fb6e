"""Continuous online RL from simulated live traffic alone (issue 26): no rollout worker.

    PYTHONPATH=. .venv/bin/python benchmarks/online_traffic.py [--users 32] [--steps 60] [--promote-every 10]
        [--eval 100] [--engine continuous] [--temperature 0.7] [--root runs/online-traffic] [overrides...]

The calculator agent's run (configs/agent_calculator.yaml: its SFT warm start, B = 8 × G = 8 rows a
step, η = 2) as three processes, the way a service runs it:
  trainer  `online/continuous.py` (the trainer on the run's live sessions + the reward pool), with
           `online.promote_every` (the promotion gate scores every k-th version on --eval held-out tasks
           and moves the registry's champion only when it wins)
  proxy    `python -m areal_core.proxy --follow RUN/weights --store RUN --engine E`: serves each version
           the trainer publishes, writes each ended session into RUN, refuses new sessions (429
           trainer_behind) while (η + 1)·B·G of its rows wait
  users    here: --users concurrent synthetic users, each with its own API key, running the calculator
           agent (the real openai SDK) on a training task, then ending the session with its reward and
           the task's prompt_id; a 429 trainer_behind makes the user wait 0.2 s and try again (refused,
           not lost)
Measured: every request's latency (p50/p99, overall and for requests in flight while the served
version changed), requests lost (any failure but a refused new session: must be 0), sessions per
second, the served versions over time (from /health every 0.2 s), the staleness histogram of the
trained rows (the audit records), drops (DONE's counters) and held-out agent success over wall time
(the gate's scores). Prints a RESULT line and writes ROOT/online_traffic.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


class TimedTransport(httpx.AsyncHTTPTransport):
    """Records (sent, done, status) of every request through it."""

    def __init__(self, log: list[tuple[float, float, int]]):
        super().__init__()
        self.log = log

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent = time.time()
        try:
            response = await super().handle_async_request(request)
        except Exception:
            self.log.append((sent, time.time(), -1))
            raise
        if request.url.path.endswith("/chat/completions"):
            self.log.append((sent, time.time(), response.status_code))
        return response


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def simulate(args, url: str, keys: list[str], tasks: list[dict], running) -> dict[str, Any]:
    """The users and the /health poller until `running()` is false."""
    from openai import RateLimitError

    from areal_core.proxy.examples import calculator_agent
    from areal_core.proxy.sessions import session_id_for_key

    requests: list[tuple[float, float, int]] = []
    versions: list[tuple[float, int]] = []
    out = {"sessions": 0, "refused": 0, "lost": 0, "lost_examples": [], "rewards": []}
    rng = random.Random(args.seed)

    async def user(key: str) -> None:
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as http:
            while running():
                task = tasks[rng.randrange(len(tasks))]
                client = httpx.AsyncClient(transport=TimedTransport(requests), timeout=120)
                try:
                    reward = await calculator_agent(
                        task, f"{url}/v1", key, http_client=client, temperature=args.temperature
                    )
                    end = {"reward": reward, "prompt_id": task["prompt_id"]}
                    r = await http.post(f"/v1/sessions/{session_id_for_key(key)}/end", json=end)
                    r.raise_for_status()
                    out["sessions"] += 1
                    out["rewards"].append(reward)
                except RateLimitError as exc:
                    if exc.code != "trainer_behind":
                        raise
                    out["refused"] += 1
                    await asyncio.sleep(0.2)
                except Exception as exc:  # noqa: BLE001 - counted: must be none
                    out["lost"] += 1
                    out["lost_examples"] = (out["lost_examples"] + [repr(exc)[:300]])[:5]
                    await asyncio.sleep(0.2)

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while running():
                try:
                    health = (await http.get("/health")).json()
                    if not versions or versions[-1][1] != health["policy_version"]:
                        versions.append((time.time(), health["policy_version"]))
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)

    t0 = time.time()
    await asyncio.gather(poll(), *(user(k) for k in keys))
    out.update(wall_s=time.time() - t0, requests=requests, versions=versions)
    return out


def summarize(sim: dict[str, Any], store, t_start: float) -> dict[str, Any]:
    from areal_core.layout import LAYOUT

    lat = [done - sent for sent, done, status in sim["requests"] if status == 200]
    swaps = [t for t, _ in sim["versions"][1:]]
    across = [done - sent for sent, done, s in sim["requests"] if s == 200 and any(sent <= t <= done for t in swaps)]
    statuses = Counter(s for _, _, s in sim["requests"])
    staleness: Counter = Counter()
    steps = 0
    for rel in store.find(LAYOUT.trained_dir, ".json"):
        record = store.read_json(rel)
        staleness.update({int(k): v for k, v in record["staleness_histogram"].items()})
        steps += 1
    done = store.read_json(LAYOUT.done) if store.exists(LAYOUT.done) else {}
    gate = store.read_json(LAYOUT.promotions) if store.exists(LAYOUT.promotions) else {"offers": []}
    first_score = gate["offers"][0]["champion_score"] if gate["offers"] else None
    return {
        "sessions": sim["sessions"],
        "sessions_per_s": sim["sessions"] / sim["wall_s"],
        "requests": len(sim["requests"]),
        "statuses": dict(statuses),
        "requests_lost": sim["lost"],
        "lost_examples": sim["lost_examples"],
        "refused_sessions": sim["refused"],
        "latency_p50_s": percentile(lat, 0.5),
        "latency_p99_s": percentile(lat, 0.99),
        "latency_across_swap_p50_s": percentile(across, 0.5),
        "latency_across_swap_p99_s": percentile(across, 0.99),
        "requests_across_swap": len(across),
        "version_swaps": len(swaps),
        "served_versions": [(round(t - t_start, 1), v) for t, v in sim["versions"]],
        "trained_steps": steps,
        "staleness_histogram": dict(sorted(staleness.items())),
        "counters": done.get("counters", {}),
        "heldout_start": first_score,
        "heldout_over_time": [
            (round(o["time"] - t_start, 1), o["version"], round(o["score"], 3), o["promoted"]) for o in gate["offers"]
        ],
        "sampled_reward_first_last_200": [
            statistics.mean(sim["rewards"][:200]) if sim["rewards"] else None,
            statistics.mean(sim["rewards"][-200:]) if sim["rewards"] else None,
        ],
        "wall_s": sim["wall_s"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--promote-every", type=int, default=10)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--engine", default="continuous", choices=["torch", "continuous"])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--root", default="runs/online-traffic")
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args(argv)


def prepare_run(args: argparse.Namespace, root: Path) -> tuple[str, str]:
    """The calculator agent's run prepared under `root` and its SFT warm start: (run URI, checkpoint)."""
    from areal_core.run import pipeline

    ov = [
        f"store={root / 'run'}",
        f"train.steps={args.steps}",
        f"online.promote_every={args.promote_every}",
        "online.model_name=online-traffic",
        f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
        f"eval.num_samples={args.eval}",
        f"seed={args.seed}",
        *args.overrides,
    ]
    run_uri, _ = pipeline.prepare(str(ROOT / "configs/agent_calculator.yaml"), ov)
    return run_uri, pipeline.sft(run_uri)


def start_trainer(run_uri: str, checkpoint: str, env: dict[str, str], logs: Path) -> subprocess.Popen:
    """`online/continuous.py`'s trainer on the run's live sessions, logging to logs/trainer.log."""
    code = "import sys; from areal_core.online.continuous import continuous_task; continuous_task(*sys.argv[1:])"
    return subprocess.Popen(
        [sys.executable, "-c", code, run_uri, checkpoint], env=env, stdout=open(logs / "trainer.log", "w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def start_proxy(
    args: argparse.Namespace, run_uri: str, root: Path, keys: list[str], port: int, env: dict[str, str], logs: Path
) -> subprocess.Popen:
    """The proxy following the run's weights and writing its sessions into it, logging to logs/proxy.log."""
    from areal_core.layout import LAYOUT
    from areal_core.store import Store

    follow = Store(run_uri).url(LAYOUT.weights_root)
    proxy_cmd = [
        *(sys.executable, "-m", "areal_core.proxy", "--follow", follow, "--store", run_uri),
        *("--engine", args.engine, "--port", str(port), "--threads", "1", "--poll-interval-s", "0.5"),
        *("--config", str(root / "run" / LAYOUT.config), "--default-max-tokens", "40", "--tool-prompt", "none"),
        *(a for k in keys for a in ("--api-key", k)),
    ]
    return subprocess.Popen(proxy_cmd, env=env, stdout=open(logs / "proxy.log", "w"), stderr=subprocess.STDOUT)


def wait_healthy(url: str, processes: list[subprocess.Popen], logs: Path) -> None:
    """Until the proxy answers /health (at most 10 minutes); SystemExit when a process exits first."""
    for _ in range(1200):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if any(p.poll() is not None for p in processes):
            raise SystemExit(f"a process exited early; see {logs}")
        time.sleep(0.5)


def stop(proxy: subprocess.Popen, trainer: subprocess.Popen) -> None:
    """Both processes stopped (the trainer only if it still runs), each waited for."""
    proxy.terminate()
    if trainer.poll() is None:
        trainer.terminate()
    proxy.wait(timeout=60)
    trainer.wait(timeout=60)


def report(args: argparse.Namespace, root: Path, trainer_rc: int | None, measured: dict[str, Any]) -> None:
    """ROOT/online_traffic.json and the RESULT line (without the served versions)."""
    res = {
        "users": args.users,
        "engine": args.engine,
        "steps": args.steps,
        "trainer_rc": trainer_rc,
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), ""),
        "load_1min_after": os.getloadavg()[0],
        **measured,
    }
    (root / "online_traffic.json").write_text(json.dumps(res, indent=2))
    print("RESULT", json.dumps({k: v for k, v in res.items() if k != "served_versions"}), flush=True)


def main(argv: list[str] | None = None) -> None:
    from areal_core.logs import setup_logging
    from areal_core.prompts import load_prompts
    from areal_core.store import Store

    args = parse_args(argv)
    setup_logging()
    root = Path(args.root).resolve()
    run_uri, checkpoint = prepare_run(args, root)
    store = Store(run_uri)
    tasks = load_prompts(store, "train")
    keys = [f"sk-user-{i}" for i in range(args.users)]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    trainer = start_trainer(run_uri, checkpoint, env, logs)
    proxy = start_proxy(args, run_uri, root, keys, port, env, logs)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proxy, trainer], logs)
        sim = asyncio.run(simulate(args, url, keys, tasks, lambda: trainer.poll() is None))
    finally:
        stop(proxy, trainer)
    report(args, root, trainer.returncode, summarize(sim, store, t_start))


if __name__ == "__main__":
    sys.exit(main())
