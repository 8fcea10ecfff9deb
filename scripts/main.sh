#!/usr/bin/env bash
# The main job: set up, search plans for a GPT-2 small config on this machine (renderings in
# nnscaler_out/), then train it on 4 gloo processes under the `tp`, `hybrid` and `auto` plans and
# compare every loss with a single-process run of the same global batch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" recipes/train_gpt2.py "$@"
