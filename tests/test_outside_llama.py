"""Llama as its projects write it (tests/outside_llama.py): RoPE with complex numbers has rules, so
a standard Llama captures with no warning, and q and k stay split through the rotation under tensor
parallelism (heads) and context parallelism (sequence). Training under every plan is in
test_outside_zoo.py."""
from __future__ import annotations

import warnings

import pytest
import torch

import outside_llama
from nnscaler_plugins.rules import ReplicateOnlyWarning


def _capture(build):
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = nns.capture(model, kwargs=batch)
    return graph, [str(w.message) for w in caught if issubclass(w.category, ReplicateOnlyWarning)]


@pytest.mark.parametrize("build", [outside_llama.reference_llama, outside_llama.titan_llama])
def test_a_standard_llama_captures_with_no_warning(build):
    graph, warned = _capture(build)
    assert not warned, warned
    assert any(op.op_name == "aten.view_as_complex.default" for op in graph.ops)


ROTATION = ("aten.view_as_complex.default", "aten.mul.Tensor", "aten.view_as_real.default")


def _rotary_ops(graph):
    """The ops of the complex rotation: view_as_complex, the complex multiply, view_as_real."""
    return [op for op in graph.ops if op.op_name in ROTATION
            and any(graph.meta(v).dtype.is_complex for v in list(op.inputs) + [o for o in op.outputs if o])]


@pytest.mark.parametrize("strategy,label_dim", [("tp", 2), ("cp", 1)])
def test_q_and_k_stay_split_through_the_rotation(strategy, label_dim):
    """Under tp every op of the rotation runs on its device's heads, under cp on its piece of the
    sequence: q and k are never gathered around it."""
    import nnscaler_plugins as nns

    graph, _ = _capture(outside_llama.titan_llama)
    plan = nns.plan(graph, strategy=strategy, world_size=2)
    ops = _rotary_ops(graph)
    assert len(ops) == 2 * 3 * 2, [op.name for op in ops]  # q and k, three ops each, two layers
    for op in ops:
        splits = plan.ops[op.name].splits
        assert splits, f"{op.name} ({op.op_name}) runs whole under {strategy}"
        assert splits[0][0] == f"d{label_dim}", (op.name, splits)


def test_a_value_that_only_lends_its_dtype_needs_no_gradient():
    """The reference code's causal mask, `torch.triu(mask).type_as(h)`: h lends the dtype, no gradient
    reaches the mask (a pipeline stage receiving it once waited for one forever)."""
    graph, _ = _capture(outside_llama.reference_llama)
    masks = [op for op in graph.ops if op.op_name == "aten.type_as.default"
             and graph.values[op.inputs[0]].producer is not None and "triu" in graph.values[op.inputs[0]].producer]
    assert masks, "no mask.type_as(h) in the graph"
    assert not any(graph.meta(op.outputs[0]).requires_grad for op in masks)
    rotary = [op for op in graph.ops if op.op_name == "aten.view_as_real.default"]
    assert rotary and all(graph.meta(op.outputs[0]).requires_grad for op in rotary)


def _document_masks(batch: dict) -> dict:
    """torchtitan's training loop: the block mask made from each batch's end-of-sequence tokens
    (here token 1) outside the model, passed to forward as `attention_masks`."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    tokens = batch["tokens"]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    documents = outside_llama.get_document_mask_mod(tokens.clone(), 1)
    mask = create_block_mask(and_masks(causal, documents), tokens.shape[0], None, tokens.shape[1], tokens.shape[1],
                             device="cpu")
    return {**batch, "attention_masks": mask}


def _titan_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, outside_llama.VOCAB, (outside_llama.BATCH, outside_llama.SEQ), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.2] = 1  # documents end at other places in every batch
    return _document_masks({"tokens": ids, "labels": torch.roll(ids, -1, 1)})


def test_torchtitan_flex_attention_with_masks_passed_to_forward():
    """TitanLlama on FlexAttention, its document masks made from each batch outside the model:
    captured with no warning, the op takes the mask's tensors, every plan keeps it one op, and the
    captured program computes each new batch's loss as the model does (forward: the CPU build of
    FlexAttention has no backward)."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model = outside_llama.WithLoss(outside_llama.TitanLlama(use_flex_attn=True)).eval()
    batch = _titan_batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = nns.capture(model, kwargs=batch)
    assert not [str(w.message) for w in caught if issubclass(w.category, ReplicateOnlyWarning)]
    flex = [op for op in graph.ops if "FlexAttentionCall" in str(op.target)]
    assert len(flex) == 2 and all(len(op.inputs) > 3 for op in flex), [op.inputs for op in flex]
    for strategy in ("tp", "cp"):
        plan = nns.plan(graph, strategy=strategy, world_size=2)
        assert all(plan.ops[op.name].splits for op in flex), (strategy, {op.name: plan.ops[op.name].splits for op in flex})
    pm = nns.parallelize(model, batch, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")
    with torch.no_grad():
        for seed in (1, 2):
            other = _titan_batch(seed)
            torch.testing.assert_close(pm(**other), model(**other), msg=f"batch {seed}")
