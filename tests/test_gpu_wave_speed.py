"""benchmarks/gpu_wave.py's six sections run on the CPU with --small (the GPU checks' script must not
first fail on the GPU): the speed section's three modes each beside plain PyTorch, every collective
path agreeing with its no-communication result, and the meta, moe, ring and flex sections agreeing
with eager."""
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


def test_the_other_sections_run_small_on_cpu_and_agree_with_eager():
    """The meta, moe, ring and flex sections on the CPU with --small (about 10 s): each prints its
    rows, the generated code's MoE and FlexAttention losses equal eager's, and the ring blocks equal
    whole SDPA, so the GPU run does not first meet a broken section."""
    import ast

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_wave.py"), "--small", "--sections",
                          "meta,moe,ring,flex", "--iters", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [ast.literal_eval(line.strip()) for line in out.stdout.splitlines() if line.startswith("   {")]
    by_key = {key: [r for r in rows if key in r] for key in ("our first loss", "first loss rel diff", "mask")}
    assert len(by_key["our first loss"]) == 1 and float(by_key["our first loss"][0]["our first loss"]) > 0, rows
    assert len(by_key["first loss rel diff"]) >= 3, rows  # moe, and flex's two masks
    for r in by_key["first loss rel diff"]:
        assert float(r["first loss rel diff"]) < 1e-5, r
    assert {r["mask"] for r in by_key["mask"]} == {"causal", "full"}, rows
    for r in by_key["mask"]:
        assert float(r["max diff (rel. to max)"]) < 1e-5, r
