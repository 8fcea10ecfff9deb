"""Run a job script of tests/ under torchrun on 127.0.0.1 (a free port) and read the JSON its rank 0
writes: `run_job(tmp_path, "hf_mlm_job.py", "tp", nproc=2)`. The scripts take (OUT, PLAN)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_job(tmp_path, job: str, plan: str, nproc: int = 2, timeout: int = 600) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"{plan}-{nproc}.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.join(HERE, job),
                           str(out), plan], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text())
