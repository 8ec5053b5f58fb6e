#!/usr/bin/env bash
# Creates the separate virtual environment of the Flyte 2 front end (flyte2/, docs/flyte2.md):
# the project's dependencies under its lock file, the `flyte` SDK 2.x and its PyTorch plugin, and the
# repository itself on the path (a .pth file), so this venv runs the same areal_core as .venv.
#
#   scripts/setup_flyte2_venv.sh [VENV_DIR]     (default: .venv-flyte2; `make flyte2-venv` calls this)
#
# Why not the project's .venv (docs/flyte2.md, "Packaging"): flyte 2.12.1 requires rich-click==1.8.9
# exactly; `pip install --dry-run flyte==2.12.1 ...` into .venv changes no package of
# requirements-lock.txt, but would downgrade rich-click 1.9.9, the library pyflyte (the flytekit
# front end, which stays) draws its command line with, in a venv other work shares.
# The project is not installed editable here: `make venv` (which .ci/run runs at the same time)
# writes the same areal_flyte.egg-info in the repository; a .pth file needs no build.
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
echo '*' > "$VENV/.gitignore"              # git and ruff skip it (as python >= 3.13's venv does)
"$VENV/bin/pip" install -q --upgrade pip
# torch first, pinned: pip takes the CPU wheel (as the Makefile does for .venv)
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
mapfile -t DEPS < <("$VENV/bin/python" -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
# only what flyte2/ imports: the SDK and the Elastic plugin (flyteplugins-vllm and -mlflow are not
# used, docs/flyte2.md; vllm's folder name would also make tests/test_architecture.py's file walk,
# which does not skip this venv, check docs/vllm.md's references to vLLM's own source files)
"$VENV/bin/pip" install -q -c requirements-lock.txt "${DEPS[@]}" "flyte==$FLYTE_VERSION" "flyteplugins-pytorch==$FLYTE_VERSION"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
pwd > "$SITE/areal-flyte-repo.pth"
"$VENV/bin/pip" check
"$VENV/bin/python" -c "import flyte, flyteplugins.pytorch, areal_core.run.pipeline, flyte2.grpo
print('flyte', flyte.__version__)"
touch "$STAMP"
echo "flyte2 venv $VENV ready in $(( $(date +%s) - t0 )) s"
