"""Stacks of identical layers are traced two deep and copied: the graph must be the one a full
trace gives (ops, module paths, parameters, results), and every model that does not fit the
pattern (a layer that reads its index, layers that differ further down, outputs per layer, a
model that checks its layer count) must fall back to the full trace with correct results."""
from __future__ import annotations

import copy
import os
import time
import types

import models
import torch

from nnscaler_plugins.capture.repeated_layers import find_stack
from nnscaler_plugins.capture.tracing import capture


def _structure(g):
    return ([(op.op_name, op.module_path, op.grad_enabled) for op in g.ops],
            sorted((v.fqn, v.meta) for v in g.values.values() if v.kind in ("param", "buffer")),
            [g.meta(o) if o else None for o in g.outputs])


def _loss_and_grads(model, inputs):
    from nnscaler_plugins.outputs import extract_loss

    loss = extract_loss(model(**inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _check_generated(model, inputs):
    """Our generated code on one process gives eager's loss bit for bit, and its gradients within
    fp32 rounding (Llama's differ from eager's in the last bits)."""
    import nnscaler_plugins as nns

    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(model), inputs)
    pm = nns.parallelize(copy.deepcopy(model), inputs, plan="dp", world_size=1, cache_dir="/tmp/nns_test_cache")
    loss = pm.train_step(inputs)
    assert torch.equal(loss, ref_loss)
    for v in pm.held_keys:
        s = pm.program.shards[v]
        if s.kind == "param":
            g = pm.parameter(s.fqn).grad
            if g is not None:
                assert torch.allclose(g, ref_grads[s.fqn], rtol=1e-5, atol=1e-7), s.fqn


def test_hf_stacks_match_the_full_trace():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=5, n_embd=32, n_head=4, vocab_size=models.VOCAB, n_positions=16,
                                      use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=5, hidden_size=32, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=models.VOCAB,
                                         max_position_embeddings=16, use_cache=False))
    ids = models._ids()
    inputs = {"input_ids": ids, "labels": ids}
    for model, path in ((gpt2, "transformer.h"), (llama, "model.layers")):
        stack = find_stack(model)
        assert stack is not None and stack.path == path and len(stack.modules) == 5
        fast = capture(model, kwargs=inputs)
        full = capture(model, kwargs=inputs, trace_repeated_layers_once=False)
        assert _structure(fast) == _structure(full)
        assert len(list(model.modules())) == len(list(copy.deepcopy(model).modules()))  # the stack is restored
        _check_generated(model, inputs)


class Block(torch.nn.Module):
    def __init__(self, i: int, d: int = 16, window: int | None = None):
        super().__init__()
        self.layer_idx = i
        self.window = window
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class IndexedBlock(Block):
    """Reads its own index: layers 0 and 1 trace to different programs."""

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * (self.layer_idx + 1)


class Net(torch.nn.Module):
    def __init__(self, blocks, collect: bool = False, check_count: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = torch.nn.Linear(16, 4)
        self.collect = collect
        self.count = len(blocks) if check_count else None

    def forward(self, x, labels):
        if self.count is not None and len(self.blocks) != self.count:
            raise RuntimeError("layer count changed")
        seen = []
        for b in self.blocks:
            x = b(x)
            seen.append(x)
        loss = torch.nn.functional.cross_entropy(self.head(x), labels)
        return (loss, *seen) if self.collect else loss


def _net_inputs():
    return {"x": torch.randn(4, 16), "labels": torch.randint(0, 4, (4,))}


def test_plain_stack_is_copied():
    torch.manual_seed(0)
    net = Net([Block(i) for i in range(6)])
    inputs = _net_inputs()
    assert find_stack(net) is not None
    assert _structure(capture(net, kwargs=inputs)) == _structure(
        capture(net, kwargs=inputs, trace_repeated_layers_once=False))
    _check_generated(net, inputs)


def test_layers_that_differ_further_down_are_traced_whole():
    torch.manual_seed(0)
    net = Net([Block(i, window=3 if i >= 4 else None) for i in range(6)])
    assert find_stack(net) is None


def test_models_outside_the_pattern_fall_back_to_the_full_trace():
    torch.manual_seed(0)
    inputs = _net_inputs()
    for net in (Net([IndexedBlock(i) for i in range(6)]),  # reads its index
                Net([Block(i) for i in range(6)], collect=True),  # every layer's output is an output
                Net([Block(i) for i in range(6)], check_count=True)):  # minds its layer count
        assert find_stack(net) is not None
        fast = capture(net, kwargs=inputs)
        full = capture(net, kwargs=inputs, trace_repeated_layers_once=False)
        assert _structure(fast) == _structure(full)
        assert len(net.blocks) == 6
        _check_generated(net, inputs)


def test_capture_says_how_it_traced_the_stack():
    torch.manual_seed(0)
    inputs = _net_inputs()
    assert capture(Net([Block(i) for i in range(6)]), kwargs=inputs).traced == "two layers"
    minds = capture(Net([Block(i) for i in range(6)], check_count=True), kwargs=inputs)
    assert minds.traced.startswith("whole: tracing two layers failed") and "layer count changed" in minds.traced
    assert "not trace as one program" in capture(Net([IndexedBlock(i) for i in range(6)]), kwargs=inputs).traced
    assert capture(Net([Block(i) for i in range(6)]), kwargs=inputs, trace_repeated_layers_once=False).traced == ""


def test_a_plan_from_a_capture_that_traced_the_layers_the_other_way_fits():
    """Whether a stack was traced two deep or whole changes op names, not the program: a plan made
    from one capture must serve a model whose own capture went the other way (a process where
    tracing two layers failed, say), in both directions."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    net, inputs = Net([Block(i) for i in range(6)]), _net_inputs()
    whole = capture(net, kwargs=inputs, trace_repeated_layers_once=False)
    fast = capture(net, kwargs=inputs)
    assert whole.fingerprint() != fast.fingerprint()  # else this test shows nothing
    for graph in (whole, fast):
        plan = nns.plan(graph, strategy="dp", world_size=1)
        _check_generated_with(net, inputs, plan)
    other = Net([Block(i) for i in range(5)])  # another model: still refused
    try:
        nns.parallelize(other, inputs, plan=nns.plan(whole, strategy="dp", world_size=1), world_size=1,
                        cache_dir="/tmp/nns_test_cache")
    except PlanError as e:
        assert "another graph" in str(e)
    else:
        raise AssertionError("a plan for six layers ran a model of five")


def _check_generated_with(model, inputs, plan):
    import nnscaler_plugins as nns

    ref_loss, _ = _loss_and_grads(copy.deepcopy(model), inputs)
    pm = nns.parallelize(copy.deepcopy(model), inputs, plan=plan, world_size=1, cache_dir="/tmp/nns_test_cache")
    assert torch.equal(pm.train_step(inputs), ref_loss)


def test_config_with_per_layer_values_is_traced_whole():
    class Config:
        layer_types = ["sliding", "sliding", "sliding", "full", "sliding", "sliding"]

    net = Net([Block(i) for i in range(6)])
    net.config = Config()
    assert find_stack(net) is None


def test_layers_that_differ_only_in_hooks_attributes_or_an_instance_forward_are_traced_whole():
    """What a layer computes can change through a hook, a plain tensor attribute or a forward set on
    one instance; copies of layer 0 would silently drop it, so such stacks are traced whole."""
    torch.manual_seed(0)
    inputs = _net_inputs()

    hooked = Net([Block(i) for i in range(6)])
    hooked.blocks[3].fc.register_forward_hook(lambda mod, args, out: out * 3)

    def scaled_forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.scale

    scaled = Net([Block(i) for i in range(6)])
    for i, b in enumerate(scaled.blocks):
        b.scale = torch.full((16,), float(i == 4) + 1.0)  # a plain attribute, not a buffer
    for b in scaled.blocks:
        b.forward = types.MethodType(scaled_forward, b)

    def negated_forward(self, x):
        return x - torch.tanh(self.fc(x))

    patched = Net([Block(i) for i in range(6)])
    patched.blocks[5].forward = types.MethodType(negated_forward, patched.blocks[5])

    for net in (hooked, scaled, patched):
        assert find_stack(net) is None
        _check_generated(net, inputs)

    same_hook = Net([Block(i) for i in range(6)])
    hook = lambda mod, args, out: out * 0.5  # noqa: E731 - one hook on every layer keeps them identical
    for b in same_hook.blocks:
        b.register_forward_hook(hook)
    assert find_stack(same_hook) is not None
    _check_generated(same_hook, inputs)


class FlakyNet(Net):
    """Its two-layer trace fails once, on one rank only (as an error one process hits and another
    does not), so that rank traces the stack whole."""

    failed: set = set()  # tokens of the models that failed once in this process (copies share it)

    def __init__(self, blocks, flaky_rank: int, extra_op_on_rank: int = -1, token: str = ""):
        super().__init__(blocks)
        self.layers = len(blocks)
        self.flaky_rank = flaky_rank
        self.extra_op_on_rank = extra_op_on_rank
        self.token = token

    def forward(self, x, labels):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        if len(self.blocks) != self.layers and rank == self.flaky_rank and self.token not in FlakyNet.failed:
            FlakyNet.failed.add(self.token)
            raise RuntimeError("a failure of this process alone")
        if rank == self.extra_op_on_rank:
            x = torch.nn.functional.relu(x)  # another program on that rank
        return super().forward(x, labels)


def _captured_on_two_ranks(rank: int, world: int, extra_op_on_rank: int, token: str) -> dict:
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    net = FlakyNet([Block(i) for i in range(6)], flaky_rank=1, extra_op_on_rank=extra_op_on_rank, token=token)
    inputs = _net_inputs()
    _, ref_grads = _loss_and_grads(copy.deepcopy(net), inputs)  # every rank trains on the same batch here
    try:
        pm = nns.parallelize(net, inputs, plan="dp", cache_dir="/tmp/nns_test_cache")
    except PlanError as e:
        return {"error": str(e)}
    pm.train_step(inputs)
    grads = {s.fqn: pm.parameter(s.fqn).grad for s in pm.program.shards.values() if s.kind == "param"}
    return {"traced": pm.program.graph.traced, "program": pm.program.graph.structure_fingerprint(),
            "equal": all(torch.allclose(g, ref_grads[k], rtol=1e-5, atol=1e-7) for k, g in grads.items())}


def test_ranks_agree_on_how_their_layers_were_traced(workers2):
    """Rank 1's two-layer trace fails once and it traces the stack whole; rank 0's does not. The
    ranks compare their captures before planning: rank 1 traces again rank 0's way, and both run
    one program, the loss equal to one process's. A rank whose program really differs is named."""
    token = f"{os.getpid()}-{time.time()}"
    same = workers2.run(_captured_on_two_ranks, -1, token)
    assert [r.get("traced") for r in same] == ["two layers", "two layers"], same
    assert same[0]["program"] == same[1]["program"] and all(r["equal"] for r in same), same
    differ = workers2.run(_captured_on_two_ranks, 1, token + "-differ")
    for r in differ:
        assert "ranks captured different programs" in r.get("error", ""), r
        assert "rank 1: program" in r["error"] and "rank 0: program" in r["error"], r
