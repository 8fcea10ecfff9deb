#!/usr/bin/env bash
# The main job: set up (one line says how it went; the whole pip log is in nnscaler_out/setup.log),
# search plans for a tiny GPT-2 on this machine (renderings in nnscaler_out/), then train it on 4
# gloo processes under the `tp`, `hybrid` and `auto` plans, printing each step's loss as it comes,
# and compare every loss with a single-process run of the same global batch. Ends with a table;
# exits non-zero, naming the plan and the reason on the last line, if any plan fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p nnscaler_out
LOG=nnscaler_out/setup.log
echo "[setup] installing nnscaler-plugins and its dependencies into $("$PY" -c 'import sys; print(sys.prefix)') (log: $LOG) ..."
start=$SECONDS
PYTHON="$PY" bash scripts/setup.sh > "$LOG" 2>&1 &
pid=$!
next=15
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  if (( SECONDS - start >= next )); then
    echo "[setup] still installing ($((SECONDS - start)) s): $(grep -v '^\s*$' "$LOG" | tail -n 1 | cut -c1-100)"
    next=$((next + 15))
  fi
done
if ! wait "$pid"; then
  tail -n 20 "$LOG"
  echo "[setup] FAILED after $((SECONDS - start)) s; the whole log is $LOG"
  exit 1
fi
VERSIONS="$("$PY" -c 'import importlib.metadata as m; print(", ".join(f"{n} {m.version(n)}" for n in ("nnscaler-plugins", "torch", "transformers")))')"
echo "[setup] done in $((SECONDS - start)) s: ${VERSIONS}"
echo "[main job] starting: importing torch and transformers ..."
exec "$PY" -u recipes/train_gpt2.py "$@"
