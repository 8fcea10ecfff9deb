import torch
import torch.nn.functional as F


class Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, d / heads)
        return self.out(a.transpose(1, 2).reshape(b, s, d))


class Block(torch.nn.Module):
    """One transformer layer: causal self-attention and an MLP, each behind a layer norm."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1, self.attn = torch.nn.LayerNorm(d), Attention(d, heads)
        self.norm2, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # the output is the loss
