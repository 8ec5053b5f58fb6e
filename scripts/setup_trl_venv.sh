#!/usr/bin/env bash
# Creates the separate virtual environment that runs TRL's GRPOTrainer for
# benchmarks/vs_trl.py (the side-by-side comparison of issue 17).
#
#   scripts/setup_trl_venv.sh [VENV_DIR]     (default: .venv-trl)
#
# The project never imports trl: benchmarks/vs_trl.py runs its TRL side with this venv's python.
# torch is pinned first (the CPU wheel the project uses) so that trl's dependencies keep it.
# peft gives TRL's side the LoRA adapter of a LoRA config (GRPOTrainer's peft_config), and
# reasoning-gym grades a reasoning-gym task with the dataset's own scorer (vs_trl.py --gym, issue 53).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-trl}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
TRL_VERSION="${TRL_VERSION:-1.16.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PEFT_VERSION="${PEFT_VERSION:-0.21.2}"
RG_VERSION="${RG_VERSION:-0.1.25}"
# bumped when the venv's contents change (2: peft and reasoning-gym), so an older venv is completed
STAMP="$VENV/.installed-trl-$TRL_VERSION-2"
if [ -f "$STAMP" ]; then
  echo "trl venv $VENV is ready"
  exit 0
fi
t0=$(date +%s)
test -d "$VENV" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q "trl==$TRL_VERSION" "peft==$PEFT_VERSION" "reasoning-gym==$RG_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import trl, torch, peft; from importlib.metadata import version; print('trl', trl.__version__, 'torch', torch.__version__, \
  'peft', peft.__version__, 'reasoning-gym', version('reasoning-gym'))"
touch "$STAMP"
echo "trl venv $VENV ready in $(( $(date +%s) - t0 )) s"
