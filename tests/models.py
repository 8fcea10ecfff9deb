"""Small models every test builds from configs (no download). Each builder returns
(model, example_inputs) with a global batch of 4 so data parallelism up to 4 divides it."""
from __future__ import annotations

import torch

BATCH = 4
SEQ = 16
VOCAB = 128


def _ids(vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


class MLP(torch.nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64, classes: int = 8):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return torch.nn.functional.cross_entropy(self.head(h), labels)


def mlp():
    model = MLP()
    return model, {"x": torch.randn(BATCH, 16), "labels": torch.randint(0, 8, (BATCH,))}


def gpt2_small(layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids.clone()}


def llama_small(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids.clone()}


def bert_small():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                     vocab_size=VOCAB, max_position_embeddings=32, type_vocab_size=2, pad_token_id=0)
    model = BertForMaskedLM(cfg)
    ids = _ids()
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.norm2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = torch.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyViT(torch.nn.Module):
    """ViT-style classifier: patch embedding by conv, class token, position embedding, blocks, head."""

    def __init__(self, image: int = 16, patch: int = 4, d: int = 32, heads: int = 4, depth: int = 2, classes: int = 10):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, d, kernel_size=patch, stride=patch)
        n = (image // patch) ** 2
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, d))
        self.pos = torch.nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        self.blocks = torch.nn.ModuleList([_Block(d, heads) for _ in range(depth)])
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x)[:, 0])
        return torch.nn.functional.cross_entropy(logits, labels)


def vit_small():
    model = TinyViT()
    return model, {"pixels": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 10, (BATCH,))}


def vit_hf():
    """Hugging Face's ViT image classifier from a small config."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    image_size=16, patch_size=4, num_labels=10)
    model = ViTForImageClassification(cfg)
    return model, {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 10, (BATCH,))}


class _WindowAttention(torch.nn.Module):
    """Self-attention inside non-overlapping windows, with a learned bias per head and position pair."""

    def __init__(self, d: int, heads: int, window: int):
        super().__init__()
        self.heads, self.window = heads, window
        # No bias on k: softmax ignores what it would add, its gradient is exactly zero, and Adam would
        # turn rounding noise in that zero into full-size steps that no comparison can follow.
        self.q, self.k, self.v = torch.nn.Linear(d, d), torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d)
        self.proj = torch.nn.Linear(d, d)
        self.bias = torch.nn.Parameter(torch.randn(heads, window * window, window * window) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, H, W, C]
        b, h, w, c = x.shape
        ws, nh = self.window, self.heads
        win = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        n = win.shape[0]

        def heads(t):
            return t.view(n, ws * ws, nh, c // nh).transpose(1, 2)

        q, k, v = heads(self.q(win)), heads(self.k(win)), heads(self.v(win))
        att = torch.softmax(q @ k.transpose(-2, -1) * (c // nh) ** -0.5 + self.bias, dim=-1)
        y = self.proj((att @ v).transpose(1, 2).reshape(n, ws * ws, c))
        return y.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


class _SwinBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int, window: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = _WindowAttention(d, heads, window)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class TinySwin(torch.nn.Module):
    """A Swin-style classifier: patch embedding, windowed-attention blocks, mean pooling, head."""

    def __init__(self, image: int = 32, patch: int = 4, d: int = 32, heads: int = 8, window: int = 4,
                 depth: int = 2, classes: int = 10):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, d, kernel_size=patch, stride=patch)
        self.blocks = torch.nn.ModuleList(_SwinBlock(d, heads, window) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).permute(0, 2, 3, 1)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x).mean(dim=(1, 2)))
        return torch.nn.functional.cross_entropy(logits, labels)


def swin_small():
    model = TinySwin()
    return model, {"pixels": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 10, (BATCH,))}


ALL = {"mlp": mlp, "gpt2_small": gpt2_small, "llama_small": llama_small, "bert_small": bert_small,
       "vit_small": vit_small, "vit_hf": vit_hf, "swin_small": swin_small}
