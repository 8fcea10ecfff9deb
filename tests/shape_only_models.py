"""Models whose forward reads the value of tensors made from sizes alone (tests/test_shape_values.py):
Lightning's demo Transformer (on torch.nn.Transformer, its masks made by its own
`generate_square_subsequent_mask`), an encoder language model on nn.TransformerEncoder with
nn.Transformer's causal mask (torch's `_detect_is_causal_mask` compares it with a causal one), and a
model whose `.item()` on a shape-only tensor decides what it computes, the answer changing with the
length. Each returns its loss; `build_*()` gives (model, batch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, WIDTH = 32, 16


class LightningDemoLM(torch.nn.Module):
    """lightning.pytorch.demos.transformer.Transformer as its LightningModule trains it: the nll loss of
    its log-probabilities against the targets."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        from lightning.pytorch.demos.transformer import Transformer

        self.model = Transformer(vocab_size=VOCAB, ninp=WIDTH, nhead=2, nhid=32, nlayers=1, dropout=dropout)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(self.model(inputs, target), target.view(-1))


class CausalEncoderLM(torch.nn.Module):
    """Two nn.TransformerEncoderLayers under nn.Transformer's generated causal mask; the encoder
    detects that the mask is causal by reading it."""

    def __init__(self, dropout: float = 0.1, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=dropout, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        h = self.encoder(self.embed(ids), mask=mask)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class LengthDecides(torch.nn.Module):
    """How many positions are multiples of 3, read with `.item()`, decides what the model computes:
    whether the features are doubled (`scale=False`: 2 at length 6, 3 at length 9, so the ops differ)
    or the factor they are scaled by (`scale=True`: a number in the program that follows the length)."""

    def __init__(self, scale: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        every_third = (torch.arange(x.shape[1], device=x.device) % 3 == 0).sum()
        h = self.proj(x)
        if self.scale:
            h = h * int(every_third.item())
        elif every_third.item() > 2:
            h = h * 2
        return h.square().mean()


class ReadsData(torch.nn.Module):
    """`.item()` on a value computed from the input: the data decides, capture must refuse it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if (x.sum() > 0).item():
            h = h * 2
        return h.square().mean()


def _tokens(batch: int = 4, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, length), generator=g), torch.randint(0, VOCAB, (batch, length), generator=g)


def build_lightning_demo(dropout: float = 0.1, length: int = 8) -> tuple[torch.nn.Module, dict]:
    inputs, target = _tokens(length=length)
    return LightningDemoLM(dropout), {"inputs": inputs, "target": target}


def build_causal_encoder(dropout: float = 0.1) -> tuple[torch.nn.Module, dict]:
    ids, labels = _tokens()
    return CausalEncoderLM(dropout), {"ids": ids, "labels": labels}


def whole_dropouts_only(model: torch.nn.Module) -> torch.nn.Module:
    """The model with the dropouts a tensor-parallel plan splits turned off (the feed-forward
    hidden's, attention's on its heads), those on the residual stream kept: every draw left is a
    whole op on one replica, which a one-process reference reproduces exactly (piece_rng)."""
    for m in model.modules():
        if isinstance(m, (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)):
            m.dropout.p = 0.0
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0
    return model


def build_length_decides(length: int = 6, scale: bool = False) -> tuple[torch.nn.Module, dict]:
    g = torch.Generator().manual_seed(2)
    return LengthDecides(scale), {"x": torch.randn(4, length, WIDTH, generator=g)}


def build_lightning_demo_tp() -> tuple[torch.nn.Module, dict]:
    model, batch = build_lightning_demo()
    return whole_dropouts_only(model), batch


def build_causal_encoder_tp() -> tuple[torch.nn.Module, dict]:
    model, batch = build_causal_encoder()
    return whole_dropouts_only(model), batch
