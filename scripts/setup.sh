#!/usr/bin/env bash
# Installs nnscaler-plugins and its test dependencies into the current Python, never letting pip
# replace or pull torch: an installed torch (CPU or CUDA) is pinned as it is; without one, the CPU
# build 2.13.0 is installed first. DeepSpeed (a test-only reference) is built with no native ops.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch found: installing torch==2.13.0 (CPU build)"
  "${PIP[@]}" "torch==2.13.0"
fi
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
echo "[setup] using torch ${TORCH_VERSION}"

if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation -c "$CONSTRAINTS" "deepspeed>=0.19,<0.20"
fi
# .[dev] includes torchao (float8 training, the fp8 extra), pinned to the torch above by the constraints
"${PIP[@]}" -c "$CONSTRAINTS" -e ".[dev]"
"$PY" -c "import torch; assert torch.__version__ == '${TORCH_VERSION}', 'setup changed torch'"
# The package is installed editable, so its bytecode is not compiled at install time; where the
# interpreter is told not to write bytecode (PYTHONDONTWRITEBYTECODE), every process the jobs and the
# tests start would compile the whole package again (about a second each). Compile it once here.
"$PY" -m compileall -q nnscaler_plugins tests benchmarks recipes >/dev/null
