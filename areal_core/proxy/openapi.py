"""The proxy's OpenAPI description, for clients in other languages (C++, Java, ...).

    python -m areal_core.proxy.openapi docs/proxy-openapi.json

writes the description generated from the app itself; a test keeps the checked-in copy
current. Feed it to any OpenAPI generator (openapi-generator: cpp-restsdk, java, go, ...).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class _NoEngine:
    """A RolloutEngine that never serves: the app is built for its description only."""

    version = swaps = 0

    def generate(self, prompts, params):  # pragma: no cover - never served
        raise RuntimeError("documentation-only app")

    def receive(self, store, version) -> None:  # pragma: no cover
        pass

    def load_version(self, version) -> None:
        pass

    def health(self) -> dict:  # pragma: no cover
        return {"ok": False}

    def close(self) -> None:  # pragma: no cover
        pass


def build_openapi() -> dict[str, Any]:
    """The OpenAPI 3 document of `create_app` (built without a model)."""
    from areal_core.models import build_tokenizer
    from areal_core.proxy.app import create_app
    from areal_core.rollout.async_engine import AsyncEngine

    backend = AsyncEngine(_NoEngine())
    try:
        spec = create_app(backend, build_tokenizer(["a"], 260)).openapi()
    finally:
        backend.close()
    spec.setdefault("components", {}).setdefault("securitySchemes", {})
    spec["security"] = [{"HTTPBearer": []}]
    spec["paths"]["/health"]["get"]["security"] = []  # the only route without a key
    spec["servers"] = [{"url": "http://127.0.0.1:8000", "description": "a local proxy"}]
    return spec


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    text = json.dumps(build_openapi(), indent=1, sort_keys=True) + "\n"
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
