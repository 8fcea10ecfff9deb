"""Rules for the ops the zoo's architectures meet beyond the core families: every split each rule
allows is run piece by piece and compared with the whole op (test_rules.check_call), on random
inputs; plus the in-place and grouped-expert mechanisms and the weight views tensor parallelism
reads as matmul weights."""
from __future__ import annotations

import warnings

import pytest
import torch

from nnscaler_plugins.capture.graph import Ref
from nnscaler_plugins.rules import has_rule
from test_rules import call_of, check_random

aten = torch.ops.aten


def _t(*shape):
    return torch.randn(shape)


def _c(*shape):
    return torch.randn(shape, dtype=torch.complex64)


CASES = [
    ("where.ScalarOther", lambda: (aten.where.ScalarOther, (Ref("c"), Ref("x"), -1.5), {},
                                   {"c": torch.rand(4, 6) > 0.5, "x": _t(4, 6)})),
    ("floor_divide", lambda: (aten.floor_divide.default, (Ref("x"), Ref("y")), {},
                              {"x": torch.randint(0, 50, (4, 6)), "y": torch.randint(1, 5, (6,))})),
    ("repeat", lambda: (aten.repeat.default, (Ref("x"), [2, 1, 3]), {}, {"x": _t(4, 6)})),
    ("repeat_interleave", lambda: (aten.repeat_interleave.self_int, (Ref("x"), 2, 1), {}, {"x": _t(4, 6, 2)})),
    ("roll", lambda: (aten.roll.default, (Ref("x"), [1], [1]), {}, {"x": _t(4, 6, 2)})),
    ("numpy_T", lambda: (aten.numpy_T.default, (Ref("x"),), {}, {"x": _t(4, 6, 2)})),
    ("argsort.stable", lambda: (aten.argsort.stable, (Ref("x"),), {"stable": True, "dim": 0},
                                {"x": torch.randint(0, 4, (8, 6))})),
    ("argsort", lambda: (aten.argsort.default, (Ref("x"), 1, True), {}, {"x": _t(4, 6)})),
    ("sort.stable", lambda: (aten.sort.stable, (Ref("x"),), {"stable": True, "dim": -1}, {"x": _t(4, 6)})),
    ("view_as_complex", lambda: (aten.view_as_complex.default, (Ref("x"),), {}, {"x": _t(4, 6, 3, 2)})),
    ("view_as_real", lambda: (aten.view_as_real.default, (Ref("z"),), {}, {"z": _c(4, 6, 3)})),
    ("polar", lambda: (aten.polar.default, (Ref("r"), Ref("a")), {}, {"r": _t(6, 4).abs(), "a": _t(6, 4)})),
    ("complex", lambda: (aten.complex.default, (Ref("r"), Ref("i")), {}, {"r": _t(6, 4), "i": _t(6, 4)})),
    ("complex mul broadcast", lambda: (aten.mul.Tensor, (Ref("q"), Ref("f")), {},
                                       {"q": _c(2, 4, 3, 5), "f": _c(1, 4, 1, 5)})),
    ("real", lambda: (aten.real.default, (Ref("z"),), {}, {"z": _c(4, 6)})),
    ("angle", lambda: (aten.angle.default, (Ref("z"),), {}, {"z": _c(4, 6)})),
    ("histc", lambda: (aten.histc.default, (Ref("x"), 4, 0.0, 3.0), {},
                       {"x": torch.randint(0, 4, (8, 6)).float()})),
    ("index_put", lambda: (aten.index_put.default, (Ref("x"), [Ref("i")], Ref("v")), {},
                           {"x": _t(6, 4), "i": torch.tensor([0, 3, 5]), "v": _t(3, 4)})),
    ("max_pool2d", lambda: (aten.max_pool2d.default, (Ref("x"), [2, 2]), {}, {"x": _t(2, 4, 6, 6)})),
    ("avg_pool2d", lambda: (aten.avg_pool2d.default, (Ref("x"), [2, 2]), {}, {"x": _t(2, 4, 6, 6)})),
    ("adaptive_avg_pool2d", lambda: (aten.adaptive_avg_pool2d.default, (Ref("x"), [1, 1]), {},
                                     {"x": _t(2, 4, 6, 6)})),
    ("batch_norm train, no running stats", lambda: (aten.batch_norm.default,
                                                    (Ref("x"), Ref("w"), Ref("b"), None, None, True, 0.1, 1e-5,
                                                     False), {},
                                                    {"x": _t(4, 6, 3, 3), "w": _t(6), "b": _t(6)})),
    ("_weight_norm", lambda: (aten._weight_norm.default, (Ref("v"), Ref("g"), 0), {},
                              {"v": _t(6, 4, 3), "g": _t(6, 1, 1)})),
]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_split_of_the_op_matches_the_whole_op(case):
    target, args, kwargs, tensors = dict(CASES)[case]()
    call = call_of(target, args, kwargs, {k: v.clone() for k, v in tensors.items()})
    assert has_rule(target), f"{target} has no rule"
    from nnscaler_plugins.rules import signature_of
    sig = signature_of(call)
    assert sig.splittable(), f"{target}: the rule allows no split"
    check_random(target, args, kwargs, tensors)


IN_PLACE = [
    (aten.relu_.default, aten.relu.default, (Ref("x"),), {"x": _t(4, 6)}),
    (aten.add_.Tensor, aten.add.Tensor, (Ref("x"), Ref("y")), {"x": _t(4, 6), "y": _t(6)}),
    (aten.masked_fill_.Scalar, aten.masked_fill.Scalar, (Ref("x"), Ref("m"), 0.0),
     {"x": _t(4, 6), "m": torch.rand(4, 6) > 0.5}),
    (aten.fill_.Scalar, aten.fill.Scalar, (Ref("x"), 2.0), {"x": _t(4, 6)}),
    (aten.copy_.default, aten.copy.default, (Ref("x"), Ref("y")), {"x": _t(4, 6), "y": _t(4, 6)}),
    (aten.div_.Tensor, aten.div.Tensor, (Ref("x"), Ref("y")), {"x": _t(4, 6), "y": _t(4, 1)}),
]


@pytest.mark.parametrize("in_place, functional, args, tensors", IN_PLACE, ids=[str(c[0]) for c in IN_PLACE])
def test_in_place_ops_take_the_rule_of_their_functional_op(in_place, functional, args, tensors):
    """Same labels as the functional op (whose splits test_rules checks); and running the in-place
    op on each piece's own chunk gives the chunks of the whole in-place result."""
    from nnscaler_plugins.rules import signature_of
    fresh = {k: v.clone() for k, v in tensors.items()}
    sig = signature_of(call_of(in_place, args, {}, {k: v.clone() for k, v in fresh.items()}))
    want = signature_of(call_of(functional, args, {}, {k: v.clone() for k, v in fresh.items()}))
    assert (sig.inputs, sig.outputs, sig.reduce) == (want.inputs, want.outputs, want.reduce)
    assert sig.splittable()
    whole = in_place(*[fresh[a.name].clone() if isinstance(a, Ref) else a for a in args])
    label = sig.outputs[0][0]
    pieces = []
    for i in range(2):
        local = []
        for a, labels in zip([a for a in args if isinstance(a, Ref)], sig.inputs):
            t = fresh[a.name].clone()
            if labels and label in labels:
                d = labels.index(label)
                t = t.chunk(2, d)[i].clone()
            local.append(t)
        it = iter(local)
        pieces.append(in_place(*[next(it) if isinstance(a, Ref) else a for a in args]))
    torch.testing.assert_close(torch.cat(pieces, 0), whole)


def test_batch_norm_in_evaluation_splits_batch_and_channels_with_the_running_statistics():
    """Checked by hand: the generic checker differentiates every float input, and the running
    statistics are not differentiable."""
    from nnscaler_plugins.rules import signature_of
    x, w, b, m, v = _t(4, 6, 3, 3), _t(6), _t(6), _t(6), torch.rand(6) + 0.5
    args = (Ref("x"), Ref("w"), Ref("b"), Ref("m"), Ref("v"), False, 0.1, 1e-5, False)
    call = call_of(aten.batch_norm.default, args, {}, {"x": x, "w": w, "b": b, "m": m, "v": v})
    sig = signature_of(call)
    assert set(sig.splittable()) == {"b", "c"}
    assert sig.inputs[3] == sig.inputs[4] == ("c",)
    whole = aten.batch_norm.default(x, w, b, m, v, False, 0.1, 1e-5, False)
    pieces = [aten.batch_norm.default(x[:, i:i + 3], w[i:i + 3], b[i:i + 3], m[i:i + 3], v[i:i + 3], False, 0.1,
                                      1e-5, False) for i in (0, 3)]
    torch.testing.assert_close(torch.cat(pieces, 1), whole)
    halves = [aten.batch_norm.default(x[i:i + 2], w, b, m, v, False, 0.1, 1e-5, False) for i in (0, 2)]
    torch.testing.assert_close(torch.cat(halves, 0), whole)


def test_batch_norm_updating_running_statistics_runs_whole():
    from nnscaler_plugins.rules import signature_of
    tensors = {"x": _t(4, 6, 3, 3), "w": _t(6), "b": _t(6), "m": _t(6), "v": torch.rand(6) + 0.5}
    args = (Ref("x"), Ref("w"), Ref("b"), Ref("m"), Ref("v"), True, 0.1, 1e-5, False)
    call = call_of(aten.batch_norm.default, args, {}, {k: v.clone() for k, v in tensors.items()})
    assert not signature_of(call).splittable()


def _grouped_mm_available() -> bool:
    try:
        import transformers.integrations.moe  # noqa: F401 - registers the op
        return hasattr(torch.ops.transformers, "grouped_mm_fallback")
    except ImportError:
        return False


@pytest.mark.skipif(not _grouped_mm_available(), reason="transformers without its grouped_mm op")
def test_grouped_expert_matmul_splits_experts_and_both_feature_dims():
    from nnscaler_plugins.rules import signature_of
    op = torch.ops.transformers.grouped_mm_fallback.default
    offs = torch.tensor([3, 3, 7, 12], dtype=torch.int32)  # expert 1 gets no rows
    tensors = {"x": _t(12, 8), "w": _t(4, 8, 6), "offs": offs}
    args = (Ref("x"), Ref("w"), Ref("offs"))
    call = call_of(op, args, {}, {k: v.clone() for k, v in tensors.items()})
    assert set(signature_of(call).splittable()) == {"e", "k", "n"}
    check_random(op, args, {}, tensors)


class _MutatesInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        y.relu_()
        return (y * 3).sum()


def test_an_in_place_op_is_split_only_when_its_result_is_read_through_its_output():
    """Capture reads a mutated tensor through the in-place op's output; a graph that read it by its
    old name after the mutation (built here by hand) would see only chunks mutated, so the op
    then runs whole."""
    import dataclasses

    from nnscaler_plugins.capture.graph import Graph
    from nnscaler_plugins.capture.tracing import capture
    from nnscaler_plugins.rules import signature_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(_MutatesInPlace(), (torch.randn(4, 8),))
    relu = next(op for op in graph.ops if str(op.target) == "aten.relu_.default")
    assert signature_for(graph, relu).splittable()
    mutated = relu.inputs[0]
    reader = graph.ops[graph.ops.index(relu) + 1]
    rewired = dataclasses.replace(reader, inputs=[mutated if v == relu.outputs[0] else v for v in reader.inputs],
                                  args=tuple(Ref(mutated) if isinstance(a, Ref) and a.name == relu.outputs[0]
                                             else a for a in reader.args))
    ops = [rewired if op is reader else op for op in graph.ops]
    old_name_read = dataclasses.replace(graph, ops=ops)
    assert isinstance(old_name_read, Graph)
    assert not signature_for(old_name_read, relu).splittable()


def test_a_matmul_reading_a_transposed_parameter_is_a_matmul_with_a_weight():
    from nnscaler_plugins.capture.tracing import capture
    from nnscaler_plugins.rules import signature_for
    from nnscaler_plugins.rules.anchors import matmul_anchor

    class FalconStyle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(16, 8))
            self.w2 = torch.nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            return torch.relu(x @ self.w1.T) @ self.w2.T

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(FalconStyle(), (torch.randn(4, 8),))
    matmuls = [op for op in graph.ops if "matmul" in str(op.target)]
    assert len(matmuls) == 2
    assert all(matmul_anchor(graph, op, signature_for(graph, op)) is not None for op in matmuls)


def test_a_rule_whose_piece_cannot_be_localized_refuses_by_name():
    """No raw exception escapes from a rule: a failing `localize` is a PlanError naming the op and
    where it is in the model."""
    from nnscaler_plugins import plugins
    from nnscaler_plugins.capture.graph import TensorMeta
    from nnscaler_plugins.errors import PlanError
    from nnscaler_plugins.hookspecs import hookimpl
    from nnscaler_plugins.rules import LocalCall, OpCall, Signature, refresh, signature_of

    def broken(call):
        def localize(lc):
            raise IndexError("tuple index out of range")
        return Signature(inputs=(("d0", "d1"),), outputs=(("d0", "d1"),), localize=localize)

    class Plugin:
        @hookimpl
        def nnscaler_register_op_rules(self):
            return {"aten.relu.default": broken}

    plugin = Plugin()
    plugins.register(plugin)
    refresh()
    try:
        meta = TensorMeta((4, 8), torch.float32)
        call = OpCall(aten.relu.default, (Ref("x"),), {}, (meta,), (meta,), ("x",))
        sig = signature_of(call, "relu (aten.relu.default) in block.act at model.py:12")
        piece = LocalCall(call, {"d0": 2}, {"d0": 1}, (TensorMeta((2, 8), torch.float32),),
                          (TensorMeta((2, 8), torch.float32),))
        with pytest.raises(PlanError, match=r"aten\.relu\.default at relu .* in block\.act at model\.py:12"):
            sig.localize(piece)
    finally:
        plugins.unregister(plugin)
        refresh()
