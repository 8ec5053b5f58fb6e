"""moto's S3 server on 127.0.0.1 for a benchmark (the tests start theirs in tests/conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def start_moto(bucket: str) -> tuple[subprocess.Popen, str]:
    """(the server process, `s3://bucket` on it); the AWS_* variables are set for this process."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1"
    )
    for _ in range(100):
        try:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            return proc, f"s3://{bucket}"
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("moto did not start")
