"""Codegen: readable per-rank source, and a cache that never serves a stale file."""
from __future__ import annotations

import importlib.util
import sys
import textwrap

import torch

import nnscaler_plugins as nns
from nnscaler_plugins.codegen.generate import cache_key, generate
from nnscaler_plugins.lower.lowering import lower

MODEL_SRC = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        h = torch.relu(self.fc1(x))
        return torch.nn.functional.mse_loss(self.fc2(h), y)
"""


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


def _program(mod):
    torch.manual_seed(0)
    model = mod.Net()
    inputs = {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}
    g = nns.capture(model, kwargs=inputs)
    return model, inputs, lower(g, nns.plan(g, strategy="tp", world_size=2))


def test_generated_source_has_one_statement_per_op_with_source_comments(tmp_path):
    path = tmp_path / "netmod_a.py"
    path.write_text(MODEL_SRC)
    _, _, program = _program(_load(path, "netmod_a"))
    src = generate(program, 0)
    compile(src, "rank0.py", "exec")
    for op in program.graph.ops:
        names = [o for o in op.outputs if o]
        # a row-parallel matmul fused with the sum of its partial outputs (lower/tp_overlap.py) is named
        # in the fused call's comment
        assert any(f"{o} = " in src or f"{o}," in src or f"# {o} (the matmul)" in src for o in names), op.name
    assert "netmod_a.py:" in src  # comments point at the model's own lines
    assert "h = torch.relu(self.fc1(x))" in src
    # The communication object is named for what it is and passed first, by position.
    assert "def forward(_comm, _device, _P, x, y):" in src and "_groups" not in src
    # One source comment per run of statements from one line (linear + relu share line "h = ...").
    forward = src.split("\ndef forward(", 1)[1].split("\ndef ", 1)[0]
    assert forward.count("h = torch.relu(self.fc1(x))") == 1
    # Every collective names the devices it runs over.
    comm = [line for line in src.splitlines() if "_comm." in line]
    assert comm and all("devices [0, 1]" in line for line in comm), comm
    # The loss is the model's only output: forward_loss is forward, not a second copy.
    assert "\nforward_loss = forward" in src and "def forward_loss(" not in src


SLICE_SRC = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return (h[:, 1:] * h[:, :-1]).sum() + h[:, 2:6].sum() + h[:, ::2].sum()
"""


def test_plain_slices_are_written_without_int64_max_and_compute_the_same(tmp_path):
    path = tmp_path / "netmod_slice.py"
    path.write_text(SLICE_SRC)
    mod = _load(path, "netmod_slice")
    torch.manual_seed(0)
    model = mod.Net()
    x = torch.randn(4, 8)
    g = nns.capture(model, kwargs={"x": x})
    src = generate(lower(g, nns.plan(g, strategy="dp", world_size=1)), 0)
    assert str(2 ** 63 - 1) not in src
    assert "aten.slice.Tensor(" in src
    pm = nns.parallelize(model, {"x": x}, plan="dp", cache_dir=str(tmp_path / "cache"))
    torch.testing.assert_close(pm(x=x), model(x=x), rtol=0, atol=0)


def test_editing_the_model_invalidates_the_cache(tmp_path):
    path = tmp_path / "netmod_b.py"
    path.write_text(MODEL_SRC)
    _, _, p1 = _program(_load(path, "netmod_b"))
    path.write_text(MODEL_SRC.replace("torch.relu", "torch.tanh"))
    _, _, p2 = _program(_load(path, "netmod_b"))
    assert cache_key(p1) != cache_key(p2)
    path.write_text(MODEL_SRC.replace("return torch", "# the loss\n        return torch"))
    _, _, p3 = _program(_load(path, "netmod_b"))
    assert cache_key(p3) != cache_key(p1)  # any source change: never serve a file made from old code


def test_single_process_parallel_module_matches_eager(tmp_path):
    path = tmp_path / "netmod_c.py"
    path.write_text(MODEL_SRC)
    mod = _load(path, "netmod_c")
    torch.manual_seed(0)
    model = mod.Net()
    inputs = {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}
    pm = nns.parallelize(model, inputs, plan="dp", cache_dir=str(tmp_path / "cache"))
    assert pm.dp_size == 1 and pm.dp_rank == 0
    loss = pm.train_step(inputs)
    ref = model(**inputs)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    grads = {n: p.grad for n, p in pm.named_parameters()}
    assert len(grads) == 4 and all(g is not None for g in grads.values())
    assert "def forward(" in pm.generated_source()
    sd = pm.full_state_dict()
    assert set(sd) == set(model.state_dict())
    pm.load_full_state_dict({k: torch.zeros_like(v) for k, v in sd.items()})
    assert all((v == 0).all() for v in pm.full_state_dict().values())
