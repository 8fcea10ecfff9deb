"""The box arithmetic sharded checkpoints stand on: a device's piece of any layout (splits, blocked
and mirrored splits, replicas), and any flat range of it (a ZeRO chunk), read box by box from the
whole tensor equals `Layout.slice_full`; pieces written as raw bytes and read back by boxes of
another layout give that layout's pieces."""
from __future__ import annotations

import random

import torch

from nnscaler_plugins.checkpoint.format import PieceWriter, TensorReader, piece_entry, stored_tensor_entry
from nnscaler_plugins.checkpoint.regions import Region, box_slices, read_piece
from nnscaler_plugins.layout import Layout


def _layout(rng: random.Random) -> Layout:
    nd = rng.randint(1, 3)
    splits = [rng.choice([1, 2, 3]) for _ in range(nd)]
    blocks = [rng.choice([1, 2, -2, 3]) for _ in range(nd)]
    shape = [n * abs(b) * rng.randint(1, 3) for n, b in zip(splits, blocks)]
    replicas = rng.choice([1, 2])
    devices = replicas * int(torch.tensor(splits).prod())
    return Layout(tuple(shape), tuple(range(devices)), replicas=replicas, splits=tuple(splits), blocks=tuple(blocks))


def test_pieces_and_chunks_of_any_layout_are_read_exactly():
    rng = random.Random(0)
    for _ in range(80):
        lay = _layout(rng)
        full = torch.randn(lay.shape)
        for dev in lay.group:
            want = lay.slice_full(full, dev).reshape(-1)
            lo = rng.randint(0, want.numel())
            hi = rng.randint(lo, want.numel())
            got = read_piece(Region.of_layout(lay, dev), lambda box: full[box_slices(box)], torch.float32, lo, hi)
            assert torch.equal(got, want[lo:hi]), (lay, dev, lo, hi)


def test_pieces_written_under_one_layout_read_under_another(tmp_path):
    rng = random.Random(1)
    for trial in range(15):
        save, load = _layout(rng), None
        while load is None or load.shape != save.shape:
            load = _layout(rng) if rng.random() < 0.5 else Layout(save.shape, (0, 1), replicas=2)
        full = torch.randn(save.shape)
        path = str(tmp_path / f"r{trial}.bin")
        w = PieceWriter(path)
        pieces = []
        for dev in save.group:
            r, _, _ = save.digits(save.position_of(dev))
            if r:
                continue  # one copy of each piece
            piece = save.slice_full(full, dev).reshape(-1)
            cut = rng.randint(0, piece.numel())  # stored as two chunks, like two ZeRO replicas
            for lo, hi in ((0, cut), (cut, piece.numel())):
                off = w.add(piece[lo:hi])
                pieces.append(piece_entry(f"r{trial}.bin", off, Region.of_layout(save, dev), lo, hi))
        w.close()
        entry = stored_tensor_entry(save.shape, torch.float32, pieces)
        reader = TensorReader(str(tmp_path))
        for dev in load.group:
            got = read_piece(Region.of_layout(load, dev), lambda box: reader.read("t", entry, box), None)
            assert torch.equal(got, load.slice_full(full, dev).reshape(-1)), (save, load, dev)
