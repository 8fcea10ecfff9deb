"""Transient host buffers (runtime/host_buffers.py): a mapping is lent again only when no tensor
uses it, idle ones stay within the pool's bound, and large ones are never kept."""
from __future__ import annotations

import importlib

import torch

host_buffers = importlib.import_module("nnscaler_plugins.runtime.host_buffers")

MiB = 2**20
LIKE = torch.zeros(1)  # float32 on the CPU


def test_a_buffer_in_use_through_any_view_is_never_lent_again():
    pool = host_buffers.MappedPool(buffer_bytes=8 * MiB, total_bytes=16 * MiB)
    a = torch.frombuffer(pool.take(4 * MiB), dtype=torch.float32)
    view = a.view(1024, 1024)[7:]
    view.fill_(3.0)
    del a  # the tensor is gone, its storage is not
    b = torch.frombuffer(pool.take(4 * MiB), dtype=torch.float32)
    b.fill_(-1.0)
    assert pool.mapped == 2 and bool((view == 3.0).all())
    del view
    c = torch.frombuffer(pool.take(4 * MiB), dtype=torch.float32)  # the first one is idle now
    assert pool.mapped == 2 and c.data_ptr() != b.data_ptr()


def test_the_pool_keeps_at_most_its_bound_and_never_a_large_buffer():
    pool = host_buffers.MappedPool(buffer_bytes=8 * MiB, total_bytes=10 * MiB)
    lent = [torch.frombuffer(pool.take(size * MiB), dtype=torch.uint8) for size in (4, 4, 2, 4)]
    assert pool.mapped == 4 and pool.kept() == [2 * MiB, 4 * MiB, 4 * MiB]  # the fourth: no room, not kept
    assert pool.idle_bytes() == 0
    del lent
    assert pool.idle_bytes() == 10 * MiB
    again = [torch.frombuffer(pool.take(size * MiB), dtype=torch.uint8) for size in (4, 4, 2)]
    assert pool.mapped == 4, "the kept mappings are lent again"
    del again
    pool.take(32 * MiB)  # above buffer_bytes: unmapped when its tensor goes, never kept
    assert pool.mapped == 5 and 32 * MiB not in pool.kept()
    pool.clear()
    assert pool.idle_bytes() == 0 and pool.kept() == []


def test_transient_buffers_come_from_the_pool_only_when_large(monkeypatch):
    pool = host_buffers.MappedPool()
    monkeypatch.setattr(host_buffers, "POOL", pool)
    small = host_buffers.transient_empty(1024, LIKE)
    assert pool.mapped == 0 and small.dtype == torch.float32 and small.numel() == 1024
    big = host_buffers.transient_empty(MiB, LIKE)  # 4 MiB of float32
    assert pool.mapped == 1 and big.numel() == MiB
    ptr = big.data_ptr()
    del big
    again = host_buffers.transient_empty(MiB, LIKE)
    assert pool.mapped == 1 and again.data_ptr() == ptr  # the same pages, no new mapping


def _resident_kib(t: torch.Tensor) -> int:
    """Resident KiB of the mapping holding `t` (its /proc/self/smaps entry)."""
    addr = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError("no mapping holds the tensor")


def test_idle_buffers_hand_their_pages_back_and_stay_for_reuse():
    """`release_idle` (called by ZeRO-3 when a forward ends, its peak) frees the pages of idle mappings
    only: the one still lent keeps its pages and values, the idle one keeps its mapping, so its next
    use is lent the same address without a new mapping."""
    pool = host_buffers.MappedPool(buffer_bytes=8 * MiB, total_bytes=16 * MiB)
    lent = torch.frombuffer(pool.take(4 * MiB), dtype=torch.float32)
    idle = torch.frombuffer(pool.take(4 * MiB), dtype=torch.float32)
    lent.fill_(2.0)
    idle.fill_(5.0)
    idle_ptr = idle.data_ptr()
    assert _resident_kib(idle) >= 4096
    del idle
    assert pool.release_idle() == 4 * MiB
    again = torch.frombuffer(pool.take(4 * MiB), dtype=torch.float32)
    assert pool.mapped == 2 and again.data_ptr() == idle_ptr
    assert _resident_kib(again) == 0  # the pages went back; reading would fault in zero pages
    assert bool((lent == 2.0).all()) and _resident_kib(lent) >= 4096
