#!/usr/bin/env bash
# Creates the separate virtual environment with megatron-core for tests/test_megatron_core.py
# (docs/megatron.md): torch 2.13.0 (CPU wheel) and megatron-core 0.16.1, nothing else.
#
#   scripts/setup_megatron_venv.sh [VENV_DIR]     (default: .venv-megatron)
#
# Why not the project's .venv: megatron-core installs there cleanly (it needs only torch>=2.6,
# numpy and packaging), but tests/test_cluster.py checks that `import_megatron` names the
# missing package where megatron-core is absent, as in the dev/CI venv. The tests run the
# project's code in this venv (`python -m areal_core.megatron.selfcheck`, with PYTHONPATH set to
# the repository) and compare with the HF model in the main venv through files.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-megatron}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
MCORE_VERSION="${MCORE_VERSION:-0.16.1}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
STAMP="$VENV/.installed-megatron-core-$MCORE_VERSION"
if [ -f "$STAMP" ]; then
  echo "megatron venv $VENV is ready"
  exit 0
fi
t0=$(date +%s)
test -d "$VENV" || "$PY" -m venv "$VENV"   # no --system-site-packages: nothing leaks in
echo '*' > "$VENV/.gitignore"              # git and ruff skip it (as python >= 3.13's venv does)
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"   # first and pinned: the CPU wheel, never replaced
"$VENV/bin/pip" install -q "megatron-core==$MCORE_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -W ignore -c "import megatron.core as m, torch; print('megatron-core', m.__version__)"
touch "$STAMP"
echo "megatron venv $VENV ready in $(( $(date +%s) - t0 )) s"
