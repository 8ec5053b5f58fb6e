"""One pod: a task's own container command in a fresh process, with a pod's environment.

The process environment is built from nothing: what the task spec declares (container env,
secrets), what Flyte injects into every task pod (FLYTE_INTERNAL_* execution ids, the platform's
S3 settings), what the plugin's operator adds (array index, PET_*), and what the image provides
(PATH to its python, PYTHONPATH to its code, HOME). Nothing of the test process leaks in: no
$AREAL_CLUSTER_CONFIG, no PYTHONPATH of a developer, no AWS_* but the endpoint's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from flyteidl.core import errors_pb2, literals_pb2, tasks_pb2

# what propeller substitutes in a container's command and args (names are case-insensitive)
_TEMPLATE_VAR = re.compile(r"\{\{\s*\.(\w+)\s*\}\}")
# the array plugin's index variable: Flyte names it in BATCH_JOB_ARRAY_INDEX_VAR_NAME
ARRAY_INDEX_VAR = "FLYTE_K8S_ARRAY_INDEX"
TAIL = 3000


def s3_client():
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def _split(uri: str) -> tuple[str, str]:
    u = urlparse(uri)
    return u.netloc, u.path.lstrip("/")


def put_bytes(uri: str, data: bytes) -> None:
    bucket, key = _split(uri)
    s3_client().put_object(Bucket=bucket, Key=key, Body=data)


def get_bytes(uri: str) -> bytes | None:
    bucket, key = _split(uri)
    try:
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:  # botocore's NoSuchKey is generated per client
        if "NoSuchKey" in type(exc).__name__ or "NoSuchKey" in str(exc) or "404" in str(exc):
            return None
        raise


def put_literal_map(uri: str, literals: dict[str, literals_pb2.Literal]) -> None:
    put_bytes(uri, literals_pb2.LiteralMap(literals=literals).SerializeToString())


def get_literal_map(uri: str) -> dict[str, literals_pb2.Literal] | None:
    data = get_bytes(uri)
    return None if data is None else dict(literals_pb2.LiteralMap.FromString(data).literals)


def image_env(root: Path, home: Path) -> dict[str, str]:
    """What the image provides: its python on PATH, its code on PYTHONPATH (the working dir)."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str(root),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(home / "tmp"),
    }


def s3_env(endpoint: str, key_id: str = "testing", secret: str = "testing") -> dict[str, str]:
    """The platform's storage settings for every pod: flytekit's (FLYTE_AWS_*) and the SDKs'."""
    return {
        "FLYTE_AWS_ENDPOINT": endpoint,
        "FLYTE_AWS_ACCESS_KEY_ID": key_id,
        "FLYTE_AWS_SECRET_ACCESS_KEY": secret,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": key_id,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def execution_env(project: str, domain: str, name: str, template: tasks_pb2.TaskTemplate) -> dict[str, str]:
    """What propeller injects into every task pod (flytekit reads them for current_context())."""
    tid = template.id
    return {
        "FLYTE_INTERNAL_EXECUTION_ID": name,
        "FLYTE_INTERNAL_EXECUTION_PROJECT": project,
        "FLYTE_INTERNAL_EXECUTION_DOMAIN": domain,
        "FLYTE_INTERNAL_EXECUTION_WORKFLOW": "",
        "FLYTE_ATTEMPT_NUMBER": "0",
        "FLYTE_INTERNAL_TASK_PROJECT": tid.project,
        "FLYTE_INTERNAL_TASK_DOMAIN": tid.domain,
        "FLYTE_INTERNAL_TASK_NAME": tid.name,
        "FLYTE_INTERNAL_TASK_VERSION": tid.version,
        "FLYTE_INTERNAL_PROJECT": tid.project,
        "FLYTE_INTERNAL_DOMAIN": tid.domain,
        "FLYTE_INTERNAL_NAME": tid.name,
        "FLYTE_INTERNAL_VERSION": tid.version,
    }


def secret_env(template: tasks_pb2.TaskTemplate, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The task's secret requests as Flyte's webhook injects them (env var _FSEC_<GROUP>_<KEY>,
    or the variable the request names); a request with no value given is an error, as on a cluster."""
    out: dict[str, str] = {}
    for s in template.security_context.secrets:
        value = secrets.get((s.group, s.key))
        if value is None:
            raise KeyError(f"task {template.id.name} requests secret {s.group}/{s.key}, which is not defined")
        out[f"_FSEC_{s.group.upper()}_{s.key.upper()}"] = value
        if s.env_var:
            out[s.env_var] = value
    return out


@dataclass
class Container:
    """The primary container of a task: `container`, or the pod template's primary container."""

    args: list[str]
    env: dict[str, str]
    image: str


def container(template: tasks_pb2.TaskTemplate) -> Container:
    if template.HasField("container"):
        c = template.container
        return Container([*c.command, *c.args], {kv.key: kv.value for kv in c.env}, c.image)
    from google.protobuf.json_format import MessageToDict

    primary = template.config["primary_container_name"]
    spec = MessageToDict(template.k8s_pod.pod_spec)
    c = next(c for c in spec["containers"] if c["name"] == primary)
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    return Container([*c.get("command", []), *c.get("args", [])], env, c["image"])


def fill(args: list[str], values: dict[str, str]) -> list[str]:
    """Propeller's template substitution: {{.input}}, {{.outputPrefix}}, ... (case-insensitive)."""

    def one(m: re.Match) -> str:
        key = m.group(1).lower()
        if key not in values:
            raise KeyError(f"unknown template variable {m.group(0)}")
        return values[key]

    return [_TEMPLATE_VAR.sub(one, a) for a in args]


@dataclass
class Pod:
    """One container run: `name` for messages, its literal-map locations on S3 and its log."""

    name: str
    template: tasks_pb2.TaskTemplate
    inputs_uri: str
    output_prefix: str
    raw_prefix: str
    env: dict[str, str]
    log: Path
    cwd: Path
    image: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started_at: float = 0.0

    @property
    def command(self) -> list[str]:
        return fill(
            container(self.template).args,
            {
                "input": self.inputs_uri,
                "inputprefix": self.inputs_uri.rsplit("/", 1)[0],
                "outputprefix": self.output_prefix,
                "rawoutputdataprefix": self.raw_prefix,
                "checkpointoutputprefix": f"{self.raw_prefix}/_flytecheckpoints",
                "prevcheckpointprefix": '""',
            },
        )

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        Path(self.env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as f:
            f.write(f"# pod {self.name} image={self.image}\n# {' '.join(self.command)}\n")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.env,
            stdout=self.log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopping the pod stops its children
        )

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def outputs(self) -> dict[str, literals_pb2.Literal] | None:
        return get_literal_map(f"{self.output_prefix}/outputs.pb")

    def error(self) -> str:
        data = get_bytes(f"{self.output_prefix}/error.pb")
        if data is None:
            return ""
        doc = errors_pb2.ErrorDocument.FromString(data)
        return f"{doc.error.code}: {doc.error.message}"

    def report(self) -> str:
        """The pod's state, error document and log tail, for a failure message."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        error = self.error() if self.poll() not in (None, 0) else ""
        head = f"--- pod {self.name} (rc={self.poll()}) {error[:TAIL]}"
        return f"{head}\n{text[-TAIL:]}"
