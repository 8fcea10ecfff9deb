#!/usr/bin/env bash
# Lightning's own multi-process CPU tests (selection.txt), on stock Lightning and with the DDP strategies
# swapped for "nnscaler" (nns_shim.py). Usage: run.sh LIGHTNING_CHECKOUT [OUT_DIR]
# LIGHTNING_CHECKOUT is a clone of github.com/Lightning-AI/pytorch-lightning at the installed release's tag
# (its tests need `pip install "jsonargparse[signatures]"`). Prints both counts over the tests the swap reached.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SRC="$1"
OUT="${2:-$(mktemp -d)}"
mkdir -p "$OUT"
cd "$SRC/tests"
SEL=$(cat "$HERE/selection.txt")
export PYTHONPATH="$HERE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
NNS_SHIM=0 python3 -m pytest -p nns_shim -q -rf $SEL -p no:cacheprovider > "$OUT/stock.log" 2>&1 || true
rm -f "$OUT/swapped.txt"
NNS_SHIM=1 NNS_SHIM_LOG="$OUT/swapped.txt" python3 -m pytest -p nns_shim -q -rf $SEL -p no:cacheprovider \
  > "$OUT/nnscaler.log" 2>&1 || true
python3 - "$OUT" <<'PY'
import sys, os
out = sys.argv[1]
def failed(name):
    return {l.split(" - ")[0].replace("FAILED ", "").replace("ERROR ", "").strip()
            for l in open(os.path.join(out, name)) if l.startswith(("FAILED ", "ERROR "))}
swapped = {l.split("\t")[0] for l in open(os.path.join(out, "swapped.txt")) if l.strip()}
counted = swapped - failed("stock.log")
passing = counted - failed("nnscaler.log")
print(f"{len(passing)} of {len(counted)} tests the swap reached (and that pass on stock Lightning) pass with strategy='nnscaler'")
for t in sorted(counted - passing):
    print("  failing:", t)
PY
