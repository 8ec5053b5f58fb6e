"""Shared fixtures: tiny configs, run roots on a local folder and on a real S3 endpoint
(moto's server on 127.0.0.1, started here), and an MLflow server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from benchmarks.fault_kit import Forwarder, wait_http
from benchmarks.tiny_run import TINY

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
# GSM8K's train.jsonl and test.jsonl: $AREAL_GSM8K, else ../shared/datasets/gsm8k beside the checkout
GSM8K = Path(os.environ.get("AREAL_GSM8K") or SHARED / "datasets" / "gsm8k")
BIN = Path(sys.executable).parent


def gsm8k_file(split: str = "test") -> Path:
    """GSM8K's `split` JSONL file; a test that needs it is skipped, with one line saying why, when
    the data folder is absent (a clone made elsewhere passes `make test`)."""
    path = GSM8K / f"{split}.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K} (set AREAL_GSM8K to the folder holding {path.name})")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def baseline_s(fn, repeat: int = 3) -> float:
    """The slowest of `repeat` calls of `fn`, in seconds: how long legitimate work of that kind
    takes on this machine now. Tests scale the limits such work must fit in by it (issue 46:
    never a fixed wall-clock budget that a loaded machine can exceed)."""
    worst = 0.0
    for _ in range(repeat):
        t0 = time.monotonic()
        fn()
        worst = max(worst, time.monotonic() - t0)
    return worst


def scaled(floor_s: float, baseline: float, factor: float = 20.0) -> float:
    """A limit for work measured at `baseline` seconds: `factor` times it, never below `floor_s`."""
    return max(floor_s, factor * baseline)


def wait_until(cond, timeout_s: float = 120.0, what: str = "the condition", poll_s: float = 0.05):
    """Poll `cond` until it returns something truthy (returned); fail naming `what` after `timeout_s`,
    a deadline only a hang reaches."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)
    return value


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (their proxy and engine share the CPU with the suite)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted SmolLM2-135M-Instruct folder (areal_core.pretrained). CI (.ci/run, which sets
    CI) fetches it once before the tests: there its absence fails; locally it is built on first use."""
    from areal_core import pretrained

    if os.environ.get("CI"):
        try:
            pretrained.verify(pretrained.model_dir("smollm2"))
        except pretrained.PretrainedError as e:
            pytest.fail(f"CI must fetch the model first (python -m areal_core.pretrained smollm2): {e}")
        return pretrained.model_dir("smollm2")
    return pretrained.ensure("smollm2")


@pytest.fixture
def tiny_overrides(tmp_path) -> list[str]:
    return [*TINY, f"store={tmp_path / 'run'}"]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible endpoint: moto's server as a separate process on 127.0.0.1."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        wait_http(endpoint + "/moto-api/")
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server) -> str:
    import boto3

    name = f"areal-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (sqlite backend) on 127.0.0.1."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root",
            str(root / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_http(uri + "/health", timeout_s=120)
        yield uri
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def s3_forwarder(s3_server):
    fwd = Forwarder(int(s3_server.rsplit(":", 1)[1]))
    try:
        yield fwd
    finally:
        fwd.close()
