#!/usr/bin/env bash
# Creates the separate virtual environment of the Flyte 2 front end (flyte2/, docs/flyte2.md):
# the project with its pinned dependencies, plus the `flyte` SDK 2.x and its plugins.
#
#   scripts/setup_flyte2_venv.sh [VENV_DIR]     (default: .venv-flyte2; `make flyte2-venv` calls this)
#
# Why not the project's .venv (docs/flyte2.md, "Packaging"): flyte 2.12.1 requires rich-click==1.8.9
# exactly, and `pip install --dry-run flyte==2.12.1 ...` into .venv would downgrade rich-click 1.9.9,
# the library pyflyte (the flytekit front end, which stays) draws its CLI with. Nothing in
# requirements-lock.txt changes, but the first front end's CLI would, so the two SDKs live apart.
# The project is installed editable under the same lock file, so both venvs run the same areal_core.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-flyte2}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
FLYTE_VERSION="${FLYTE_VERSION:-2.12.1}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
STAMP="$VENV/.installed-flyte-$FLYTE_VERSION"
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt requirements-lock.txt ]; then
  echo "flyte2 venv $VENV is ready"
  exit 0
fi
t0=$(date +%s)
test -d "$VENV" || "$PY" -m venv "$VENV"   # no --system-site-packages: nothing leaks in
"$VENV/bin/pip" install -q --upgrade pip
# torch first, pinned: pip takes the CPU wheel (as the Makefile does for .venv)
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q -c requirements-lock.txt -e . \
  "flyte==$FLYTE_VERSION" "flyteplugins-pytorch==$FLYTE_VERSION" \
  "flyteplugins-vllm==$FLYTE_VERSION" "flyteplugins-mlflow==$FLYTE_VERSION"
"$VENV/bin/python" -c "import flyte, flyteplugins.pytorch, flyteplugins.vllm, flyteplugins.mlflow, areal_core.run.pipeline
print('flyte', flyte.__version__)"
touch "$STAMP"
echo "flyte2 venv $VENV ready in $(( $(date +%s) - t0 )) s"
