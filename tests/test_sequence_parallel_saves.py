"""Sequence parallelism keeps the shard of a column-parallel matmul's gathered input for backward
(as Megatron does) and gathers it again there, and reduce-scatters the input's gradient: the
gradients must be one process's and those of keeping the whole gathered input, and what backward
holds must shrink by the group size."""
from __future__ import annotations


def _column_parallel_block(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from nnscaler_plugins.kernels import collectives as C

    torch.manual_seed(0)
    seq, hidden, out = 8 * world, 16, 12
    x_whole = torch.randn(2, seq, hidden)
    weights = [torch.randn(out, hidden) for _ in range(3)]  # q, k and v read one gathered input
    group = dist.new_group(list(range(world)))

    def run(hooks):
        x = x_whole.chunk(world, 1)[rank].clone().requires_grad_(True)
        ws = [w.chunk(world, 0)[rank].clone().requires_grad_(True) for w in weights]
        saved = [0]

        def pack(t):
            packed = C.pack_saved(t) if hooks else t
            saved[0] += C.saved_bytes(packed)
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, C.unpack_saved):
            gathered = C.identity_fwd_allreduce_bwd(C.all_gather(x, 1, group), group)
            outs = [torch.nn.functional.linear(gathered, w) for w in ws]
            del gathered
        loss = sum((o * o).sum() for o in outs)
        loss.backward()
        return x.grad, [w.grad for w in ws], saved[0]

    kept = run(hooks=False)
    regathered = run(hooks=True)
    x_ref = x_whole.clone().requires_grad_(True)
    w_ref = [w.clone().requires_grad_(True) for w in weights]
    sum((torch.nn.functional.linear(x_ref, w) ** 2).sum() for w in w_ref).backward()
    problems = []
    if not torch.allclose(kept[0], x_ref.grad.chunk(world, 1)[rank], rtol=1e-5, atol=1e-3):
        problems.append("input gradient differs from one process")
    if not all(torch.allclose(a, w.grad.chunk(world, 0)[rank], rtol=1e-5, atol=1e-3) for a, w in zip(kept[1], w_ref)):
        problems.append("weight gradients differ from one process")
    if not torch.equal(kept[0], regathered[0]):
        problems.append("input gradient differs")
    if not all(torch.equal(a, b) for a, b in zip(kept[1], regathered[1])):
        problems.append("weight gradients differ")
    whole = 2 * seq * hidden * 4
    # without: the gathered input for each of the three matmuls (one tensor, counted per saver);
    # with: its shard once
    if kept[2] != 3 * whole + 3 * (out // world) * hidden * 4:
        problems.append(f"saved {kept[2]} bytes keeping the gathered input")
    if regathered[2] != whole // world + 3 * (out // world) * hidden * 4:
        problems.append(f"saved {regathered[2]} bytes keeping the shard")
    return problems


def test_column_parallel_input_saved_as_shard_2(workers2):
    problems = workers2.run(_column_parallel_block)
    assert not any(problems), problems


def _written_after_gather(rank: int, world: int) -> list[str]:
    """A gathered value written in place before it feeds split pieces (a router's `weights /= sum`
    after the gather) must be kept as written: gathering the shard again in backward would give
    the value from before the write."""
    import torch
    import torch.distributed as dist

    from nnscaler_plugins.kernels import collectives as C

    torch.manual_seed(0)
    x_whole, w_whole = torch.randn(4 * world, 6) + 3, torch.randn(8, 6)
    group = dist.new_group(list(range(world)))
    x = x_whole.chunk(world, 0)[rank].clone().requires_grad_(True)
    w = w_whole.chunk(world, 0)[rank].clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(C.pack_saved, C.unpack_saved):
        gathered = C.all_gather(x * 1, 0, group)
        gathered.div_(gathered.sum(-1, keepdim=True))
        out = torch.nn.functional.linear(C.identity_fwd_allreduce_bwd(gathered, group), w)
    (out * out).sum().backward()
    x_ref, w_ref = x_whole.clone().requires_grad_(True), w_whole.clone().requires_grad_(True)
    y = x_ref * 1
    y = y / y.sum(-1, keepdim=True)
    (torch.nn.functional.linear(y, w_ref) ** 2).sum().backward()
    problems = []
    if not torch.allclose(w.grad, w_ref.grad.chunk(world, 0)[rank], rtol=1e-5, atol=1e-6):
        problems.append("weight gradient differs from one process")
    if not torch.allclose(x.grad, x_ref.grad.chunk(world, 0)[rank], rtol=1e-5, atol=1e-6):
        problems.append("input gradient differs from one process")
    return problems


def test_value_written_after_its_gather_is_kept_whole(workers2):
    problems = workers2.run(_written_after_gather)
    assert not any(problems), problems
