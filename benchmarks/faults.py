"""Faults injected into the online loop at once, and what they cost (issue 46).

    PYTHONPATH=. .venv/bin/python benchmarks/faults.py [--steps 8] [--root runs/faults] [--out F.json]

The continuous online loop of configs/agent_calculator.yaml (tiny model, η = 1, B·G = 4, delta-published versions, the
promotion gate every 2 steps) with:
  two proxies      proxy-0 and proxy-1 following RUN/weights and writing into RUN, two users each
                   (the openai SDK); a third proxy started as its own process with proxy-0's id must
                   be refused at start (WriterInUse);
  a hand-moved     once the gate has offered, the champion alias is moved by hand to a version
  alias            recorded at held-out 0.99, which no version of this run can beat;
  registry outage  the MLflow server sits behind a TCP forwarder, cut after the gate's second offer
                   until a third one has met the dead registry (the breaker then skips the rest);
  damaged versions the newest published version's delta is damaged at v2 and at v5 (a byte flipped
                   after publication), which breaks every later delta for a reader until a full
                   snapshot: readers report it and the waiting trainer republishes its version whole;
  a hostile MCP    episodes against stdio MCP servers whose tools start processes (a child, after
  server           setsid, an orphan of a double fork) and that print 2,000 lines of noise a call.
Reported, all of which must be 0: rows lost (written by the proxies but neither trained, dropped
with a record, nor untrained at the end: train/accounting.py, from the records alone), rows
trained or dropped twice, wrong promotions (the alias away from the hand-moved champion),
processes leaked, duplicate writers admitted; and the run must reach DONE. Prints a RESULT line
and writes --out (default ROOT/faults.json); exits non-zero when a row is not settled exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_mlflow(root: Path) -> tuple[subprocess.Popen, int]:
    from areal_core.procs import free_port
    from benchmarks.fault_kit import wait_http

    port = free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        + ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root", str(root / "art")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    wait_http(f"http://127.0.0.1:{port}/health", timeout_s=180)
    return proc, port


def flip_newest(run) -> int | None:
    from benchmarks.fault_kit import flip_byte

    v = run.latest_version()
    if v is not None:
        flip_byte(run, v)
    return v


def duplicate_writer_refused(run_uri: str) -> bool:
    """A proxy process started with proxy-0's id while proxy-0 serves: refused at start."""
    from areal_core.layout import LAYOUT

    out = subprocess.run(
        [sys.executable, "-m", "areal_core.proxy", "--follow", f"{run_uri}/{LAYOUT.weights_root}", "--store", run_uri]
        + ["--worker-id", "proxy-0", "--api-key", "sk-dup", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return out.returncode != 0 and "WriterInUse" in out.stdout + out.stderr


def accounting(run) -> dict:
    """Every row the proxies wrote: trained once, dropped with a record, or untrained at the end;
    `lost` from the records alone (train/accounting.py), no counter subtracted."""
    from areal_core.train.accounting import row_accounting

    return row_accounting(run)


def mcp_phase() -> dict:
    """Hostile MCP servers: processes their tools start and the noise they print."""
    from areal_core.agents.mcp import ServerSpec
    from areal_core.models import build_tokenizer
    from benchmarks.fault_kit import mcp_episodes, mcp_task, sleeping_pids

    tok = build_tokenizer(['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call> #### 42'], 300)
    seconds = 5000 + os.getpid() % 1000
    servers = "tests/test_mcp_servers.py"
    spawner = ServerSpec("spawner", command="python", args=(servers, "spawner"), call_timeout_s=300)
    noisy = ServerSpec("noisy", command="python", args=(servers, "search", "noisy"), call_timeout_s=300)
    calls = [("spawner.spawn", {"how": how, "seconds": seconds}) for how in ("child", "setsid", "orphan")]
    calls += [("noisy.chatter", {"lines": 2000})]
    results, stats = mcp_episodes(tok, [spawner, noisy], [mcp_task(f"ep{i}", calls) for i in range(5)])
    left: list[int] = []
    for _ in range(100):
        left = sleeping_pids(seconds)
        if not left:
            break
        time.sleep(0.1)
    return {
        "episodes": len(results),
        "episodes_failed": sum(r.error is not None for r in results),
        "leaked_processes": len(left),
        "noise_lines": stats.get("mcp", {}).get("noise_lines", stats.get("noise_lines")),
    }


KEYS = {"proxy-0": ["sk-a0", "sk-a1"], "proxy-1": ["sk-b0", "sk-b1"]}  # each proxy's users' API keys


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--root", default="runs/faults")
    ap.add_argument("--out", default="")
    return ap.parse_args()


def prepare_run(steps: int, root: Path, stamp: int, name: str, registry_uri: str) -> tuple[str, str]:
    """The calculator agent's continuous run (module docstring) prepared under `root`: (run URI, checkpoint)."""
    from areal_core.run import pipeline
    from benchmarks.tiny_run import MODEL

    ov = [*MODEL, f"store={root / f'run-{stamp}'}", "sft.enabled=false", "task.num_train=40", "task.num_eval=4"]
    ov += ["rollout.group_size=2", "train.batch_groups=2", f"train.steps={steps}", "train.eta=1"]
    ov += ["train.checkpoint_every=2", "train.lr_warmup_steps=0", "train.slow_step_s=1.0", "online.promote_every=2"]
    ov += ["train.weight_delta=true"]  # a damaged delta breaks the chain of every later version for a reader
    ov += [f"online.model_name={name}", "tracking.enabled=false", f"tracking.uri={registry_uri}"]
    run_uri, _ = pipeline.prepare("configs/agent_calculator.yaml", ov)
    return run_uri, pipeline.sft(run_uri)


def start_trainer(run_uri: str, ckpt: str) -> tuple[threading.Thread, dict, list[BaseException]]:
    """The continuous online loop in a thread: (the thread, its result once done, its error if it raised)."""
    from areal_core.online.continuous import run_continuous

    result: dict = {}
    err: list[BaseException] = []

    def train() -> None:
        try:
            result.update(run_continuous(run_uri, ckpt))
        except BaseException as exc:  # noqa: BLE001 - reported
            err.append(exc)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    return trainer, result, err


def proxy_apps(run, run_uri: str) -> dict:
    """proxy-0 and proxy-1: each follows RUN/weights and writes its sessions into RUN, with its users' keys."""
    from areal_core.layout import LAYOUT
    from areal_core.proxy.__main__ import build_app, parse_args

    flags = ["--tool-prompt", "none", "--default-max-tokens", "12", "--poll-interval-s", "0.1"]
    return {
        w: build_app(
            parse_args(
                ["--follow", run.url(LAYOUT.weights_root), "--store", run_uri, "--worker-id", w, *flags]
                + [x for k in ks for x in ("--api-key", k)]
            )
        )
        for w, ks in KEYS.items()
    }


def inject(run, trainer: threading.Thread, registry, name: str, faults: dict) -> None:
    """The faults, each once, at points of the run's own progress (not of the clock): a version
    damaged at v2 and at v5; the champion moved by hand after the gate's first offer; the
    registry cut after its second offer until a third one has met the dead registry."""
    from areal_core.layout import LAYOUT
    from areal_core.online.registry import aliased, register_if_better
    from areal_core.run.tracking import mlflow_client

    flipped: list[int] = []
    while trainer.is_alive():
        v = run.latest_version() or 0
        if len(flipped) < 2 and v >= 2 + 3 * len(flipped) and v not in flipped:
            flipped.append(flip_newest(run))
        offers = run.read_json(LAYOUT.promotions)["offers"] if run.exists(LAYOUT.promotions) else []
        if len(offers) >= 1 and "hand_moved_champion" not in faults:
            register_if_better(run.url(LAYOUT.init_model), name, registry.endpoint, 0.99, None, run_name="by-hand")
            faults["hand_moved_champion"] = aliased(mlflow_client(registry.endpoint), name).version
            faults["hand_moved_after_offer"] = offers[-1]["version"]
        if len(offers) >= 2 and "registry_down_after_offer" not in faults:
            faults["registry_down_after_offer"] = offers[-1]["version"]
            registry.down()
        if len(offers) >= 3 and "registry_up_after_offer" not in faults:
            faults["registry_up_after_offer"] = offers[-1]["version"]
            registry.up()
        time.sleep(0.1)
    if "registry_down_after_offer" in faults and "registry_up_after_offer" not in faults:
        registry.up()
    faults["flipped_versions"] = flipped


async def user(server, key: str, offset: int, tasks: list[dict], trainer: threading.Thread, lost: list) -> None:
    """One user of `server`: the calculator agent on every 4th task from `offset`, each session ended with its
    reward, while the trainer runs; a refused session waits 0.2 s, a failed one is recorded in `lost`."""
    import httpx
    import openai

    from areal_core.proxy.examples import calculator_agent
    from areal_core.proxy.sessions import session_id_for_key

    n = offset
    while trainer.is_alive():
        task = tasks[n % len(tasks)]
        try:
            reward = await calculator_agent(task, server.base_url, key, max_turns=1)
        except openai.RateLimitError:
            await asyncio.sleep(0.2)
            continue
        except Exception as exc:  # noqa: BLE001 - a failed request is a lost session
            lost.append(repr(exc)[:200])
            continue
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}) as http:
            r = await http.post(
                f"/v1/sessions/{session_id_for_key(key)}/end",
                json={"reward": reward, "prompt_id": task["prompt_id"]},
                timeout=120,
            )
            if r.status_code != 200:
                lost.append(r.text[:200])
        n += 4


def serve_users(run, run_uri: str, trainer: threading.Thread, registry, name: str, out: dict) -> list[str]:
    """Both proxies up, a duplicate writer tried, the faults injected and two users a proxy until the
    trainer ends; the failed requests."""
    from areal_core.proxy.runner import ProxyServer
    from task_data.arithmetic import generate

    tasks, _ = generate(7, 40, 1, ops="+-", lo=1, hi=9, max_steps=1)
    apps = proxy_apps(run, run_uri)
    failed_requests: list[str] = []
    with ProxyServer(apps["proxy-0"]) as p0, ProxyServer(apps["proxy-1"]) as p1:
        out["duplicate_writer_refused"] = duplicate_writer_refused(run_uri)
        injector = threading.Thread(target=inject, args=(run, trainer, registry, name, out["faults"]), daemon=True)
        injector.start()
        pairs = [(p0, k) for k in KEYS["proxy-0"]] + [(p1, k) for k in KEYS["proxy-1"]]

        async def users() -> None:
            await asyncio.gather(*(user(s, k, i, tasks, trainer, failed_requests) for i, (s, k) in enumerate(pairs)))

        asyncio.run(users())
        trainer.join()
        injector.join(timeout=60)
    return failed_requests


def settle(out: dict, run, registry, name: str, err: list[BaseException], failed_requests: list[str]) -> None:
    """What the faults cost, into `out`: DONE, the trainer's error, the rows' accounting, failed requests,
    wrong promotions, republished versions, the gate's offers and the MCP phase."""
    from areal_core.events import read_events
    from areal_core.layout import LAYOUT
    from areal_core.online.registry import aliased
    from areal_core.run.tracking import mlflow_client

    champion = aliased(mlflow_client(registry.endpoint), name)
    out["done"] = run.done()
    out["error"] = repr(err[0]) if err else None
    out["rows"] = accounting(run) if run.done() else {}
    out["failed_requests"] = len(failed_requests)
    out["wrong_promotions"] = int(champion is None or champion.version != out["faults"].get("hand_moved_champion"))
    events = read_events(run)
    out["republished"] = [e["version"] for e in events if e.get("kind") == "republish"]
    out["offers"] = run.read_json(LAYOUT.promotions)["offers"] if run.exists(LAYOUT.promotions) else []
    out["mcp"] = mcp_phase()


def report(out: dict, path: Path) -> None:
    """`out` written to `path`, the RESULT line; SystemExit when a row is not settled exactly once."""
    summary = {
        "done": out["done"],
        "lost": out["rows"].get("lost"),
        "trained_twice": out["rows"].get("trained_twice"),
        "dropped_twice": out["rows"].get("dropped_twice"),
        "wrong_promotions": out["wrong_promotions"],
        "leaked_processes": out["mcp"]["leaked_processes"],
        "duplicate_writer_refused": out["duplicate_writer_refused"],
        "republished": out["republished"],
    }
    path.write_text(json.dumps(out, indent=1, default=str))
    print("RESULT " + json.dumps(summary))
    unsettled = {k: summary[k] for k in ("lost", "trained_twice", "dropped_twice") if summary[k] != 0}
    if unsettled:
        raise SystemExit(f"rows not settled exactly once: {unsettled} ({out['rows']})")


def main() -> None:
    from areal_core.store import Store
    from benchmarks.fault_kit import Forwarder

    a = parse_args()
    root = Path(a.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    mlflow_proc, port = start_mlflow(root)
    registry = Forwarder(port)
    name = f"faults-{int(t0)}"
    run_uri, ckpt = prepare_run(a.steps, root, int(t0), name, registry.endpoint)
    run = Store(run_uri)
    out: dict = {"steps": a.steps, "faults": {}}
    trainer, _, err = start_trainer(run_uri, ckpt)
    failed_requests = serve_users(run, run_uri, trainer, registry, name, out)
    settle(out, run, registry, name, err, failed_requests)
    out["seconds"] = round(time.time() - t0, 1)
    mlflow_proc.terminate()
    report(out, Path(a.out or root / "faults.json"))


if __name__ == "__main__":
    main()
