"""Capture: plain modules, Hugging Face models built from configs, and meta-device models."""
from __future__ import annotations

import resource

import models
import pytest
import torch

import nnscaler_plugins as nns


def test_mlp_graph_exposes_ops_shapes_params_and_sources():
    model, inputs = models.mlp()
    g = nns.capture(model, kwargs=inputs)
    assert g.ops and all(op.op_name for op in g.ops)
    params = g.parameters
    assert set(params) == {n for n, _ in model.named_parameters()}
    for fqn, v in params.items():
        assert v.meta.shape == tuple(model.get_parameter(fqn).shape)
        assert v.meta.dtype == torch.float32
    linears = [op for op in g.ops if op.op_name.startswith("aten.linear")]
    assert linears and all(op.module_path for op in linears)
    assert all(op.source.endswith(tuple(f":{i}" for i in range(1, 10000))) for op in linears)
    assert "models.py" in linears[0].source


def test_gpt2_and_llama_capture_without_cache_and_keep_tied_names():
    for build in (models.gpt2_small, models.llama_small):
        model, inputs = build()
        model.config.use_cache = True  # the capture switches it off for the capture only
        g = nns.capture(model, kwargs=inputs)
        assert model.config.use_cache is True
        names = set(g.parameters)
        assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}
        loss_ops = [op for op in g.ops if "cross_entropy" in op.op_name]
        assert loss_ops, "the loss is part of the captured graph"
        assert any("modeling_" in op.source for op in g.ops)


def test_meta_device_gpt2_48_layers_captures_without_allocating():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=48, n_embd=1600, n_head=25)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 128), device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = nns.capture(model, kwargs={"input_ids": ids, "labels": ids})
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    n_params = sum(v.meta.numel for v in g.values.values() if v.kind == "param")
    assert n_params > 1.5e9  # GPT-2 XL sized: 6 GB of fp32 weights were never allocated
    assert grown_mb < 2000, f"capture grew resident memory by {grown_mb:.0f} MB"
    assert len([op for op in g.ops if "scaled_dot_product" in op.op_name]) == 48


class _BranchesOnValues(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent control flow
            h = h * 2
        return h.sum()


def test_capture_error_is_a_few_lines_naming_the_model_line(capfd):
    from nnscaler_plugins.capture.tracing import CaptureError

    with pytest.raises(CaptureError) as e:
        nns.capture(_BranchesOnValues(), (torch.randn(2, 4),))
    text = str(e.value)
    assert len(text.splitlines()) <= 5, text
    assert "test_capture.py:" in text and "if h.sum() > 0:" in text and "torch.where" in text
    assert "GuardOnDataDependentSymNode" in e.value.details  # torch's report is kept, not printed
    out, err = capfd.readouterr()
    assert "def forward" not in out + err and len((out + err).splitlines()) < 5, out + err


def test_meta_capture_has_the_real_models_fingerprint():
    """A plan made on a meta-device capture (a large model planned on a laptop) fits the real
    model's graph: devices and stride-dependent no-op calls (.contiguous() on a tensor whose layout
    the device's kernels already made contiguous) no longer tell the two apart."""
    for name in ("gpt2_small", "llama_small"):
        torch.manual_seed(0)
        real, batch = getattr(models, name)()
        real.eval()  # dropout off, to compare with eager
        with torch.device("meta"):
            meta, _ = getattr(models, name)()
        meta.eval()
        g_meta = nns.capture(meta, kwargs={k: v.to("meta") for k, v in batch.items()})
        g_real = nns.capture(real, kwargs=batch)
        assert g_meta.fingerprint() == g_real.fingerprint(), name
        plan = nns.plan(g_meta, strategy="dp", world_size=1)
        pm = nns.parallelize(real, batch, plan=plan, world_size=1, cache_dir="/tmp/nns_test_cache")
        assert torch.allclose(pm.train_step(batch), real(**batch).loss)


def test_plan_zero_override_sticks():
    import dataclasses

    from nnscaler_plugins.plan.plan import Plan

    model, inputs = models.mlp()
    p = nns.plan(model, strategy="dp", world_size=2, example_inputs=inputs, zero=2)
    p.options["zero"] = 2  # as plans written by older searches carry it
    q = dataclasses.replace(p, zero=0)
    assert q.zero == 0
    assert Plan.from_json({**q.to_json(), "zero": 0}).zero == 0
    legacy = q.to_json()
    del legacy["zero"]
    assert Plan.from_json(legacy).zero == 2


def test_one_tensor_given_as_two_inputs_stays_two_inputs():
    """`{"input_ids": ids, "labels": ids}` must not let the graph read labels where the model reads
    input_ids: a later batch with padded labels (-100) would be embedded as tokens."""
    import models

    torch.manual_seed(0)
    model, batch = models.gpt2_small()
    g = nns.capture(model, {"input_ids": batch["input_ids"], "labels": batch["input_ids"]})
    embedding = next(op for op in g.ops if op.op_name == "aten.embedding.default")
    token_ids = g.values[embedding.inputs[1]]
    while token_ids.kind == "op":  # back through the view to the input it reads
        token_ids = g.values[g.op(token_ids.producer).inputs[0]]
    assert token_ids.name == next(i.name for i in g.inputs if i.path[1] == "input_ids")


def test_no_captured_op_computes_what_nothing_reads():
    """Hugging Face models build a causal mask that the capture folds into `is_causal`; export's
    assertions still read the mask's chain, and without removing them it stayed in every rank's
    program (index ops and comparisons each step). Random ops stay even when unread: removing one
    would shift the random stream of every later one."""
    for build in (models.llama_small, models.gpt2_small):
        model, inputs = build()
        g = nns.capture(model, kwargs=inputs)
        read = {v for op in g.ops for v in op.inputs} | {v for v in g.outputs if v is not None}
        unread = [op.name for op in g.ops if op.outputs and not any(o in read for o in op.outputs if o is not None)
                  and not op.op_name.endswith("_") and "copy_" not in op.op_name]
        assert unread == [], (build.__name__, unread[:10])


def test_dead_code_keeps_random_draws_nothing_reads():
    class DrawsAndDiscards(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            torch.rand(3)  # read by nothing: still moves the random stream
            return torch.nn.functional.dropout(self.lin(x), 0.5, training=True)

    g = nns.capture(DrawsAndDiscards(), (torch.randn(2, 4),))
    assert any(op.op_name.startswith("aten.rand") for op in g.ops), [op.op_name for op in g.ops]


@pytest.mark.parametrize("whole", [False, True])
def test_the_model_is_freed_as_soon_as_the_caller_drops_it(whole):
    """torch.export leaves reference cycles that hold the traced model; capture collects them, so a
    model the caller lets go of (its whole weights, beside a ZeRO-3 rank's shard) is freed then,
    not whenever Python's cyclic collector next runs. The collector is off here: only capture's
    own collection can free the cycles."""
    import gc
    import weakref

    model, inputs = models.gpt2_small()
    alive = weakref.ref(model.transformer.wte.weight)
    was = gc.isenabled()
    gc.disable()
    try:
        graph = nns.capture(model, kwargs=inputs, trace_repeated_layers_once=not whole)
        del model
        assert alive() is None, "the model outlived its last reference"
        assert graph.ops  # the graph itself is kept
    finally:
        if was:
            gc.enable()


def test_a_stray_fake_constant_from_torch_export_is_traced_again_once(monkeypatch):
    """torch.export once reported a fake constant on a model it traces without fault otherwise: one
    more trace is taken; the same message twice is the model's and refuses it by name."""
    from nnscaler_plugins.capture import tracing

    real = torch.export.export
    failures = {"left": 1}

    def flaky(*args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("We found a fake tensor in the exported program constant's list. "
                               "... model attribute: lifted_tensor_0.")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", flaky)
    model, inputs = models.mlp()
    g = nns.capture(model, kwargs=inputs)
    assert g.ops and failures["left"] == 0
    failures["left"] = 2
    with pytest.raises(tracing.CaptureError, match="lifted_tensor_0"):
        nns.capture(model, kwargs=inputs)
