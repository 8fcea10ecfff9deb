"""Plans: JSON round trip, and every kind of bad plan rejected with the op and its source line."""
from __future__ import annotations

import json

import models
import pytest
import torch

import nnscaler_plugins as nns
from nnscaler_plugins import PlanBuilder, PlanError, op_assign, op_trans
from nnscaler_plugins.plan.plan import Plan


@pytest.fixture(scope="module")
def mlp_graph():
    model, inputs = models.mlp()
    return nns.capture(model, kwargs=inputs)


def _first_linear(b):
    return next(op for op in b.ops if op.node.op_name.startswith("aten.linear"))


def _replicate_rest(b, skip=()):
    for op in b.ops:
        if op.name not in skip and all(d is None for d in b.placement(op).devices):
            b.replicate(op)


def test_plan_round_trips_through_json(tmp_path, mlp_graph):
    p = nns.plan(mlp_graph, strategy="tp", world_size=2)
    path = tmp_path / "plan.json"
    p.save(path)
    text = path.read_text()
    assert json.loads(text)["format"] == "nnscaler-plan" and '"version": 2' in text
    assert json.loads(text)["mesh"] == {"axes": {"dp": 1, "tp": 2}, "replica_axes": 1}
    q = Plan.load(path, graph=mlp_graph, world_size=2)
    assert q.to_json() == p.to_json()
    assert q.mesh == p.mesh and q.knobs == p.knobs
    assert "world size 2" in q.explain()


def test_a_version_1_plan_file_is_migrated_with_a_note(tmp_path, mlp_graph):
    """A plan file written before meshes and knobs: its degrees are read back once (unit, replicas,
    pipeline, the strategy's recorded options) and its option knobs move to typed fields."""
    import warnings

    from nnscaler_plugins.errors import PlanFormatWarning

    p = nns.plan(mlp_graph, strategy="hybrid", world_size=4, tp=2)
    old = p.to_json()
    old["version"] = 1
    del old["mesh"], old["knobs"]
    old["options"] = {"tp": 2, "dp": 2, "cp_comm": "allgather", "batch_statistics": "local", "recompute": "none"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = Plan.load(path, graph=mlp_graph, world_size=4)
    notes = [w for w in caught if issubclass(w.category, PlanFormatWarning)]
    assert len(notes) == 1 and "migrated" in str(notes[0].message) and "tp 2" in str(notes[0].message)
    assert q.mesh.axes == {"dp": 2, "pp": 1, "tp": 2} and q.version == 2
    assert q.knobs.cp_comm == "allgather" and q.knobs.batch_statistics == "local"
    assert q.options == {"tp": 2, "dp": 2}
    q.save(tmp_path / "new.json")
    assert json.loads((tmp_path / "new.json").read_text())["version"] == 2


def test_plan_knobs_and_mesh_are_typed(mlp_graph):
    """Knobs are fields, refused by name when misspelt (in a plan file and in code); the mesh must
    hold the plan's unit and replicas."""
    p = nns.plan(mlp_graph, strategy="tp", world_size=2, tp_comm_overlap=False, collective_timeout_s=30)
    assert p.knobs.tp_comm_overlap is False and p.knobs.collective_timeout_s == 30
    with pytest.raises(PlanError, match="'cp_com'.*did you mean 'cp_comm'"):
        p.knobs.replace(cp_com="ring")
    d = p.to_json()
    d["knobs"] = {"on_nonfinte": "skip"}
    with pytest.raises(PlanError, match="'on_nonfinte'.*did you mean 'on_nonfinite'"):
        Plan.from_json(d)
    d = p.to_json()
    d["mesh"] = {"axes": {"dp": 2, "tp": 2}}
    with pytest.raises(PlanError, match="mesh"):
        Plan.from_json(d)
    with pytest.raises(PlanError, match="collective_timeout_s"):
        nns.plan(mlp_graph, strategy="tp", world_size=2, collective_timeout_s=-1)


def test_nested_splits_compose(mlp_graph):
    b = PlanBuilder(mlp_graph, unit_size=4)
    lin = _first_linear(b)
    batch, out_features = lin.signature.outputs[0][0], lin.signature.outputs[0][-1]
    subs = op_trans(lin, dim=batch, num=2)
    nested = [op_trans(s, dim=out_features, num=2) for s in subs][-1]
    assert len(nested) == 4
    for d, s in enumerate(nested):
        op_assign(s, d)
    assert b.placement(lin).splits == [(batch, 2), (out_features, 2)]


def test_unassigned_subop_is_rejected_with_source_line(mlp_graph):
    b = PlanBuilder(mlp_graph, unit_size=2)
    lin = _first_linear(b)
    subs = op_trans(lin, dim=lin.signature.outputs[0][-1], num=2)
    op_assign(subs[0], 0)
    _replicate_rest(b, skip={lin.name})
    with pytest.raises(PlanError) as e:
        b.finish()
    assert lin.name in str(e.value) and "not assigned" in str(e.value) and lin.node.source in str(e.value)


def test_split_not_dividing_is_rejected(mlp_graph):
    b = PlanBuilder(mlp_graph, unit_size=3)
    lin = _first_linear(b)
    label = lin.signature.outputs[0][-1]
    size = mlp_graph.meta(lin.node.outputs[0]).shape[-1]
    assert size % 3
    for d, s in enumerate(op_trans(lin, dim=label, num=3)):
        op_assign(s, d)
    _replicate_rest(b, skip={lin.name})
    with pytest.raises(PlanError, match="does not divide"):
        b.finish()


def test_device_outside_world_is_rejected(mlp_graph):
    b = PlanBuilder(mlp_graph, unit_size=2)
    lin = _first_linear(b)
    subs = op_trans(lin, dim=lin.signature.outputs[0][-1], num=2)
    op_assign(subs[0], 0)
    op_assign(subs[1], 5)
    _replicate_rest(b, skip={lin.name})
    with pytest.raises(PlanError, match="outside the world"):
        b.finish()


def test_frozen_dim_is_rejected():
    model, inputs = models.vit_small()
    b = PlanBuilder(nns.capture(model, kwargs=inputs), unit_size=2)
    op = next(op for op in b.ops if op.node.op_name == "aten.softmax.int")
    label = next(l for l in op.signature.labels() if op.signature.is_frozen(l))
    with pytest.raises(PlanError, match="frozen"):
        op_trans(op, dim=label, num=2)


def test_plan_for_another_graph_or_world_size_is_rejected(tmp_path, mlp_graph):
    p = nns.plan(mlp_graph, strategy="tp", world_size=2)
    with pytest.raises(PlanError, match="world size"):
        nns.plan(mlp_graph, strategy=p, world_size=4)
    torch.manual_seed(0)
    other, inputs = models.mlp()
    inputs = {k: torch.cat([v, v]) for k, v in inputs.items()}  # another batch size: the same plan fits
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json", graph=nns.capture(other, kwargs=inputs), world_size=2).ops == p.ops
    wider, small = models.MLP(hidden=32), models.mlp()[1]  # another model: refused
    with pytest.raises(PlanError, match="made for another graph"):
        Plan.load(tmp_path / "p.json", graph=nns.capture(wider, kwargs=small), world_size=2)
    old = dict(p.to_json(), structure_fingerprint="")  # a file from before plans fitted other sizes
    (tmp_path / "old.json").write_text(__import__("json").dumps(old, default=str))
    with pytest.raises(PlanError, match=r"made for inputs \{'x': \[4, 16\], 'labels': \[4\]\}.* given \{'x': \[8, 16\]"):
        Plan.load(tmp_path / "old.json", graph=nns.capture(other, kwargs=inputs), world_size=2)


def test_unknown_strategy_names_the_registered_ones(mlp_graph):
    with pytest.raises(PlanError, match="registered"):
        nns.plan(mlp_graph, strategy="no-such-plan", world_size=2)
    assert {"dp", "tp", "hybrid"} <= set(nns.strategies())


def test_failed_save_keeps_previous_plan(tmp_path, mlp_graph):
    p = nns.plan(mlp_graph, strategy="tp", world_size=2)
    path = tmp_path / "plan.json"
    p.save(path)
    before = path.read_text()
    p.options = {"bad": object()}
    p.options = {"x": float("nan")}
    p.save(path)  # a good save replaces atomically
    p.ops = None  # a broken plan: to_json raises before anything is written
    with pytest.raises(Exception):
        p.save(path)
    assert path.read_text() != "" and json.loads(path.read_text())
    assert json.loads(before)["format"] == "nnscaler-plan"


def test_blocked_splits_are_checked_and_round_trip(tmp_path, mlp_graph):
    b = PlanBuilder(mlp_graph, unit_size=2)
    lin = _first_linear(b)
    out_features = lin.signature.outputs[0][-1]
    reduce = next(iter(lin.signature.reduce))
    with pytest.raises(PlanError, match="reduction"):
        op_trans(lin, dim=reduce, num=2, block=2)
    for d, s in enumerate(op_trans(lin, dim=out_features, num=2, block=2)):
        op_assign(s, d)
    _replicate_rest(b, skip={lin.name})
    plan = b.finish()
    assert plan.ops[lin.name].blocks == {out_features: 2}
    assert "in 2 blocks" in plan.explain()
    path = tmp_path / "blocked.json"
    plan.save(path)
    assert Plan.load(path, graph=mlp_graph, world_size=2).ops[lin.name].blocks == {out_features: 2}

    # A hand-edited plan that blocks the reduction is refused on load, naming the op.
    data = json.loads(path.read_text())
    data["ops"][lin.name]["blocks"] = {reduce: 2}
    data["ops"][lin.name]["splits"] = [[reduce, 2]]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=lin.name):
        Plan.load(path, graph=mlp_graph, world_size=2)


def test_tp_splits_gpt2_fused_qkv_in_three_blocks():
    model, inputs = models.gpt2_small()
    g = nns.capture(model, kwargs=inputs)
    plan = nns.plan(g, strategy="tp", world_size=2)
    qkv = [op for op in g.ops if op.module_path.endswith("attn.c_attn") and op.op_name == "aten.addmm.default"]
    assert len(qkv) == model.config.n_layer
    for op in qkv:
        assert list(plan.ops[op.name].blocks.values()) == [3], plan.ops[op.name]


# -- op-order ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_graph():
    model, inputs = models.gpt2_small()
    return nns.capture(model, kwargs={k: v[:2] for k, v in inputs.items()})


def test_broken_user_schedule_is_refused_before_launch(gpt2_graph):
    from nnscaler_plugins.plan.schedules import BACKWARD, FORWARD, Task, one_f_one_b

    def backwards_first(shape):
        lists = one_f_one_b(shape)
        lists[1] = sorted(lists[1], key=lambda t: t.kind != BACKWARD)  # B1.0 before F1.0
        return lists

    with pytest.raises(PlanError, match=r"deadlocks: rank 1 cannot run B1.0 .*waits for F1.0"):
        nns.plan(gpt2_graph, strategy="pipeline", world_size=2, pp=2, micro_batches=2, schedule=backwards_first)

    def forgets_a_backward(shape):
        lists = one_f_one_b(shape)
        lists[0] = [t for t in lists[0] if t != Task(0, 1, BACKWARD)]
        return lists

    with pytest.raises(PlanError, match="never runs the backward of stage 0 micro-batch 1"):
        nns.plan(gpt2_graph, strategy="pipeline", world_size=2, pp=2, micro_batches=2, schedule=forgets_a_backward)


def test_user_schedule_is_kept_in_the_saved_plan(tmp_path, gpt2_graph):
    from nnscaler_plugins.plan.schedules import gpipe

    def my_gpipe(shape):
        return gpipe(shape)

    p = nns.plan(gpt2_graph, strategy="pipeline", world_size=2, pp=2, micro_batches=2, schedule=my_gpipe)
    p.save(tmp_path / "p.json")
    q = Plan.load(tmp_path / "p.json", graph=gpt2_graph, world_size=2)
    assert q.pipeline.schedule == "my_gpipe" and q.pipeline.task_lists() == p.pipeline.task_lists()
    assert "pipeline: 2 stages on 2 ranks, 2 micro-batches, schedule my_gpipe" in q.explain()


def test_stages_out_of_model_order_and_ops_off_their_stage(tmp_path, gpt2_graph):
    p = nns.plan(gpt2_graph, strategy="1f1b", world_size=2, pp=2, micro_batches=2)
    data = p.to_json()
    last = gpt2_graph.ops[-1].name
    data["ops"][gpt2_graph.ops[0].name]["stage"] = 1  # the first op moved to the last stage
    data["ops"][gpt2_graph.ops[0].name]["devices"] = [1]
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="made in the later stage 1"):
        Plan.load(tmp_path / "a.json", graph=gpt2_graph, world_size=2)
    data = p.to_json()
    data["ops"][last]["devices"] = [0]  # the loss on a device of the first stage
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=f"{last}.*outside its pipeline stage 1"):
        Plan.load(tmp_path / "b.json", graph=gpt2_graph, world_size=2)


def test_pipeline_options_are_checked(gpt2_graph):
    with pytest.raises(PlanError, match="2 layers cannot fill 4 pipeline stages"):
        nns.plan(gpt2_graph, strategy="1f1b", world_size=4, pp=4, micro_batches=2)
    with pytest.raises(PlanError, match="micro-batches .* divisible"):
        nns.plan(models.gpt2_small(4)[0], strategy="interleaved", world_size=2, pp=2, micro_batches=3,
                 example_inputs={k: v[:3] for k, v in models.gpt2_small(4)[1].items()})


def test_plan_file_with_unknown_ops_or_keys_is_refused_by_name(tmp_path, mlp_graph):
    p = nns.plan(mlp_graph, strategy="tp", world_size=2)
    path = tmp_path / "plan.json"
    p.save(path)
    original = path.read_text()

    def edited(change) -> str:
        d = json.loads(original)
        change(d)
        out = tmp_path / "edited.json"
        out.write_text(json.dumps(d))
        return str(out)

    first = next(iter(json.loads(original)["ops"]))
    extra = edited(lambda d: d["ops"].__setitem__(first + "_x", d["ops"][first]))
    with pytest.raises(PlanError, match=rf"does not have: '{first}_x' \(closest op: '"):
        Plan.load(extra, graph=mlp_graph, world_size=2)
    with pytest.raises(PlanError, match="does not have"):
        nns.parallelize(models.mlp()[0], models.mlp()[1], plan=extra, world_size=1)  # refused before running
    with pytest.raises(PlanError, match=r"unknown key\(s\) 'micro_batchs' \(did you mean 'micro_batches'\?\)"):
        Plan.load(edited(lambda d: d.__setitem__("micro_batchs", 2)))
    with pytest.raises(PlanError, match=rf"op '{first}': unknown key\(s\) 'replicas' \(did you mean 'replicate'\?\)"):
        Plan.load(edited(lambda d: d["ops"][first].__setitem__("replicas", 2)))
    with pytest.raises(PlanError, match="world_size 8 but unit_size 2 x dp 1"):
        Plan.load(edited(lambda d: d.__setitem__("world_size", 8)))
    assert path.read_text() == original  # nothing already written is touched


@pytest.mark.parametrize("name,options", [("mlp", {"strategy": "tp"}), ("gpt2_small", {"strategy": "tp"}),
                                          ("gpt2_small", {"strategy": "megatron", "tp": 3}),
                                          ("llama_small", {"strategy": "coshard"})])
def test_tp_degree_that_splits_no_weight_is_refused_with_the_sizes(name, options):
    """tp=3 on 64-wide models used to replicate every op on every device without a word."""
    model, inputs = getattr(models, name)()
    with pytest.raises(PlanError, match=r"tensor.parallel.* 3 .*(sizes|weight dims) [0-9, ]+.*for example 2"):
        nns.plan(model, world_size=3, example_inputs=inputs, **options)
