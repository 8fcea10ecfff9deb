#!/usr/bin/env bash
# Set up, then run the whole test suite (real gloo processes on 127.0.0.1; no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
