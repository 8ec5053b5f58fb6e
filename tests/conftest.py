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

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
GSM8K = SHARED / "datasets" / "gsm8k"
BIN = Path(sys.executable).parent

TINY = [
    "task.num_train=400",
    "task.num_eval=40",
    "task.min_value=1",
    "task.max_value=9",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "model.vocab_size=300",
    "sft.steps=3",
    "sft.batch_size=8",
    "rollout.group_size=4",
    "rollout.max_batch_groups=2",
    "rollout.max_new_tokens=8",
    "train.batch_groups=2",
    "train.steps=4",
    "train.checkpoint_every=2",
    "eval.num_samples=20",
    "eval.max_new_tokens=8",
    "tracking.enabled=false",
    "launcher.progress=false",
    "launcher.timeout_s=300",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except Exception:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not come up in {timeout_s}s")


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
        proc.wait(timeout=10)
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
