"""`kernels.reduce_scatter`: each rank ends with the sum of its own piece over the group.

On gloo the sum is formed on the owner from an all-to-all (gloo's own reduce-scatter is an
all-reduce in traffic); these tests hold it to the exact sum of every rank's input, for the flat
and the list forms, strided pieces, a sub-group and bf16, on 4 real gloo processes."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _inputs(rank: int, n: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input: n pieces of m elements, the same on every call."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n * m, generator=g).to(dtype)


def _check_flat_and_list(rank: int, world: int) -> dict:
    from nnscaler_plugins.kernels import reduce_scatter

    out: dict = {"gloo_sums_on_owner": not reduce_scatter.has_own_reduce_scatter(None)}
    m = 1000
    for dtype in (torch.float32, torch.bfloat16):
        want = sum(_inputs(r, world, m, torch.float64) for r in range(world)).view(world, m)[rank]
        flat = torch.empty(m, dtype=dtype)
        reduce_scatter.start(flat, _inputs(rank, world, m, dtype), None).wait()
        # Strided pieces: the input laid out (m, n), piece j its column j.
        cols = _inputs(rank, world, m, dtype).view(world, m).t().contiguous()
        listed = torch.empty(m, dtype=dtype)
        handle = reduce_scatter.start(listed, [cols[:, j] for j in range(world)], None)
        handle.wait()
        handle.wait()  # a second wait changes nothing
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        out[str(dtype)] = (float((flat.double() - want).abs().max()), float((listed.double() - want).abs().max()),
                           tol * float(want.abs().max()))
    # A sub-group of ranks 1 and 3: their own rank numbering inside it.
    sub = dist.new_group([1, 3])
    if rank in (1, 3):
        me = [1, 3].index(rank)
        want = (_inputs(1, 2, m, torch.float64) + _inputs(3, 2, m, torch.float64)).view(2, m)[me]
        got = torch.empty(m)
        reduce_scatter.start(got, _inputs(rank, 2, m, torch.float32), sub).wait()
        out["sub"] = float((got.double() - want).abs().max())
    return out


def test_each_rank_gets_the_exact_sum_of_its_piece(workers4):
    results = workers4.run(_check_flat_and_list)
    for rank, res in enumerate(results):
        assert res["gloo_sums_on_owner"], "gloo must take the all-to-all path"
        for dtype in ("torch.float32", "torch.bfloat16"):
            flat_err, list_err, tol = res[dtype]
            assert flat_err <= tol and list_err <= tol, (rank, dtype, res[dtype])
        if rank in (1, 3):
            assert res["sub"] <= 1e-5, res


def test_the_backend_is_read_per_device_type():
    """A group made for several device types runs CPU tensors on gloo (summed on the owner) and
    CUDA tensors on NCCL (its own reduce-scatter)."""
    from nnscaler_plugins.kernels.reduce_scatter import backend_for

    assert backend_for("gloo", "cpu") == "gloo"
    assert backend_for("nccl", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"
