"""Models capture cannot take (data-dependent sizes, values read in Python), written the way outside
code writes them: each runs in one process, so plans that keep whole layers on each device must run
it too (the eager executor). `build_*()` returns (model, global batch of 8 rows); deterministic
under a fixed seed."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class MaskedLMHead(torch.nn.Module):
    """A BERT-style masked-LM head: the masked tokens are picked with `torch.nonzero` before the
    vocabulary projection (HelloDeepSpeed's BERT does this), then a cross-entropy over them."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                           for _ in range(2)])
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        h = self.norm(h).reshape(-1, h.shape[-1])
        picked = torch.nonzero(labels.reshape(-1) != -100).squeeze(1)
        logits = self.head(h[picked])
        return F.cross_entropy(logits, labels.reshape(-1)[picked], reduction="sum") / input_ids.shape[0]


def build_masked_lm() -> tuple[torch.nn.Module, dict]:
    model = MaskedLMHead()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 32, (8, 6), generator=g)
    labels = torch.where(torch.rand(8, 6, generator=g) < 0.4, ids, torch.full_like(ids, -100))
    return model, {"input_ids": ids, "labels": labels}


class ItemControlFlow(torch.nn.Module):
    """A forward that reads a value with `.item()` and branches on it (a gate, a skipped block)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.extra = torch.nn.Linear(16, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        if h.mean().item() > -10.0:  # always taken here; capture cannot know
            h = h + torch.relu(self.extra(h))
        return F.mse_loss(self.down(h), y)


def build_item() -> tuple[torch.nn.Module, dict]:
    g = torch.Generator().manual_seed(6)
    return ItemControlFlow(), {"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)}


class DetectionHead(torch.nn.Module):
    """An object-detection-style head: a conv backbone with batch norm, then boolean indexing of the
    positive anchors before the box regression (the count depends on the data)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.cls = torch.nn.Conv2d(8, 1, 1)
        self.box = torch.nn.Conv2d(8, 4, 1)

    def forward(self, images: torch.Tensor, targets: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.bn(self.conv(images)))
        scores = self.cls(f).flatten(1)
        boxes = self.box(f).permute(0, 2, 3, 1).reshape(images.shape[0], -1, 4)
        cls_loss = F.binary_cross_entropy_with_logits(scores, positive.float(), reduction="sum")
        box_loss = F.smooth_l1_loss(boxes[positive], targets[positive], reduction="sum")
        return (cls_loss + box_loss) / images.shape[0]


def build_detection() -> tuple[torch.nn.Module, dict]:
    g = torch.Generator().manual_seed(7)
    images = torch.randn(8, 3, 4, 4, generator=g)
    return DetectionHead(), {"images": images, "targets": torch.randn(8, 16, 4, generator=g),
                             "positive": torch.rand(8, 16, generator=g) < 0.3}


BUILDERS = {"masked_lm": build_masked_lm, "item": build_item, "detection": build_detection}


class WeightPenalty(ItemControlFlow):
    """`.item()` control flow plus an L2 penalty over `self.parameters()` inside the forward: under
    ZeRO-3 the penalty must see whole weights, not this replica's chunks."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        penalty = sum((p ** 2).sum() for p in self.parameters())
        return super().forward(x, y) + 1e-2 * penalty


def build_penalty() -> tuple[torch.nn.Module, dict]:
    g = torch.Generator().manual_seed(8)
    return WeightPenalty(), {"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)}


BUILDERS["penalty"] = build_penalty
