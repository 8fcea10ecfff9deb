"""benchmarks/gpu_wave.py's speed and collectives sections run on the CPU with --small (the GPU
checks' script must not first fail on the GPU): three modes each beside plain PyTorch, and every
collective path agreeing with its no-communication result."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_speed_and_collectives_sections_run_small_on_cpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_wave.py"), "--small", "--sections",
                          "speed,collectives", "--iters", "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    for mode in ("'eager'", "'compile'", "'compile + fp8'"):
        assert f"'mode': {mode}" in text, text
    assert text.count("'values and gradients': 'agrees'") >= 11 and "DIFFERS" not in text, text
