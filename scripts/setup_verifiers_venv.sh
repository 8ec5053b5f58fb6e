#!/usr/bin/env bash
# Creates the separate virtual environment that runs verifiers 0.4 environments for
# `rollout.environment=verifiers:<taskset>` (areal_core/environments/verifiers_env.py,
# docs/environments.md) and tests/test_verifiers_env.py.
#
#   scripts/setup_verifiers_venv.sh [VENV_DIR]     (default: .venv-verifiers)
#
# Why a side venv: verifiers 0.4.0 pins mcp==2.0.0 and openai<3, the project's are newer. The
# project never imports verifiers: the rollout role runs areal_core/environments/verifiers_runner.py
# with this venv's python and talks JSON lines to it.
#
# Offline runs: a verifiers harness runs its model loop as a PEP 723 script that `uv sync --script`
# installs on first use (openai, mcp, httpx, httpx2, tenacity, certifi). The runner's `warm` command
# does that here, once, and locks the script (`uv lock --script`), so that a run syncs it from the
# lock and the venv's own uv cache (`uv-cache/` in the venv) without the package index.
# hatchling is installed so an environment package can be installed editable without the index
# (`pip install --no-index --no-build-isolation -e PATH`, as the tests do).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-verifiers}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VERIFIERS_VERSION="${VERIFIERS_VERSION:-0.4.0}"
UV_VERSION="${UV_VERSION:-0.13.9}"
STAMP="$VENV/.installed-verifiers-$VERIFIERS_VERSION"
if [ -f "$STAMP" ]; then
  echo "verifiers venv $VENV is ready"
  exit 0
fi
t0=$(date +%s)
test -d "$VENV" || "$PY" -m venv "$VENV"   # no --system-site-packages: nothing leaks in
echo '*' > "$VENV/.gitignore"              # git and ruff skip it
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "verifiers==$VERIFIERS_VERSION" "uv==$UV_VERSION" "hatchling==1.33.0" "editables==0.5"
"$VENV/bin/python" areal_core/environments/verifiers_runner.py warm
"$VENV/bin/pip" check
"$VENV/bin/python" -c "import verifiers, verifiers.v1 as vf; print('verifiers', verifiers.__version__)"
touch "$STAMP"
echo "verifiers venv $VENV ready in $(( $(date +%s) - t0 )) s"
