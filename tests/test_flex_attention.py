"""FlexAttention (`torch.nn.attention.flex_attention.flex_attention`, with block masks) is captured as
one op with a rule: batch rows and heads split, each piece calling FlexAttention on its rows / heads
with the matching slice of the block mask (the same mask where the mask broadcasts a dim), and a
score_mod / mask_mod that reads `b` or `h` sees the global index. Under context parallelism the
queries split too (contiguous or mirrored), keys and values gathered whole, each piece's block mask
built from the mask_mod for its global query positions.

The CPU build runs FlexAttention forward only (no backward), so here the projections feeding it are
frozen and the layers after it train: forward exactness of every split, planning, and SGD steps of
the rest of the model are checked on CPU; FlexAttention's own backward is a GPU check.
"""
from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from outside_llama import get_document_mask_mod
from sgd_check import sgd_equivalence
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

import nnscaler_plugins as nns
from nnscaler_plugins.capture.tracing import CaptureError
from nnscaler_plugins.kernels.flex_attention_piece import (
    FlexAttentionCall,
    flex_attention_piece,
)

SEQ = 128  # FlexAttention's block size: the smallest sequence a block mask describes
BATCH, HEADS = 4, 4
EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 32)


#: one document id per token of a row, rows packed differently (a per-token doc id tensor)
DOCS = torch.tensor([[0] * 50 + [1] * 78, [0] * 100 + [1] * 28, [0] * 20 + [1] * 60 + [2] * 48, [0] * 128])


def document(b, h, q, kv):
    return (DOCS[b, q] == DOCS[b, kv]) & (q >= kv)


def head_window(b, h, q, kv):
    """A window whose width depends on the head: a mask that reads `h`."""
    return (q >= kv) & (q - kv <= 16 * (h + 1))


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def alibi(score, b, h, q, kv):
    """A score_mod that reads the global head (and row) index."""
    return score - SLOPES[h] * (q - kv) + 0.1 * b


MASKS = {  # name -> (mask_mod, B, H): B / H None where the mask broadcasts that dim
    "causal": (causal, None, None),
    "sliding_window": (sliding_window, None, None),
    "document": (document, BATCH, None),
    "head_window": (head_window, None, HEADS),
}


def _mask(name: str, batch: int = BATCH):
    mod, b, h = MASKS[name]
    return create_block_mask(mod, None if b is None else batch, h, SEQ, SEQ, device="cpu")


# -- the op's rule: pieces reassembled equal the whole op --------------------------------------------

PIECE_CASES = [(n, s) for n in MASKS for s in (None, alibi)] if EVERY else [("document", alibi), ("head_window", alibi)]


@pytest.mark.parametrize("name,score_mod", PIECE_CASES)
def test_pieces_of_rows_and_heads_reassemble_the_whole_op(name, score_mod):
    from nnscaler_plugins.kernels.flex_attention_piece import FlexSpec, register

    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, 8) for _ in range(3))
    key = register(FlexSpec(_mask(name), score_mod, None, False, False, None))
    whole = FlexAttentionCall.apply(q, k, v, key)
    assert torch.allclose(whole, flex_attention(q, k, v, score_mod=score_mod, block_mask=_mask(name)))
    for nb, nh in ((2, 1), (1, 2), (2, 2), (4, 4)) if EVERY else ((2, 2),):
        b, h = BATCH // nb, HEADS // nh
        rows = []
        for i in range(nb):
            heads = [flex_attention_piece(q[i * b:(i + 1) * b, j * h:(j + 1) * h], k[i * b:(i + 1) * b, j * h:(j + 1) * h],
                                          v[i * b:(i + 1) * b, j * h:(j + 1) * h], key, i * b, j * h) for j in range(nh)]
            rows.append(torch.cat(heads, dim=1))
        torch.testing.assert_close(torch.cat(rows), whole, msg=f"{name} {score_mod} in {nb}x{nh} pieces")


def test_grouped_query_heads_split_with_their_groups():
    from nnscaler_plugins.kernels.flex_attention_piece import FlexSpec, register

    torch.manual_seed(0)
    q = torch.randn(2, 4, SEQ, 8)
    k, v = torch.randn(2, 2, SEQ, 8), torch.randn(2, 2, SEQ, 8)
    key = register(FlexSpec(_mask("head_window"), alibi, None, True, False, None))
    whole = FlexAttentionCall.apply(q, k, v, key)
    pieces = [flex_attention_piece(q[:, 2 * j:2 * j + 2], k[:, j:j + 1], v[:, j:j + 1], key, 0, 2 * j) for j in range(2)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole)


# -- a small Llama-style model ----------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, score_mod):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.score_mod = heads, kv_heads, dim // heads, score_mod
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, block_mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        o = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask,
                           enable_gqa=self.kv_heads != self.heads)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, score_mod):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, score_mod)
        self.w1, self.w2, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False), \
            nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x, block_mask):
        x = x + self.attn(self.attn_norm(x).detach(), block_mask)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class FlexLlama(nn.Module):
    """torchtitan's shape: the block mask made once before the layers (`mask_in_forward`) or held by
    the model, built outside forward; the embedding and q/k/v projections frozen, everything after
    them trains; each layer's attention reads its input detached (the CPU build has no FlexAttention
    backward, and a second layer's input depends on trainable weights)."""

    def __init__(self, mask: str, mask_in_forward: bool, score_mod=None, vocab: int = 32, dim: int = 32,
                 heads: int = HEADS, kv_heads: int = HEADS, layers: int = 2, batch: int = BATCH):
        super().__init__()
        self.mask_name, self.mask_in_forward = mask, mask_in_forward
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, score_mod) for _ in range(layers))
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.block_mask = None if mask_in_forward else _mask(mask, batch)
        self.embed.requires_grad_(False)
        for layer in self.layers:
            for lin in (layer.attn.wq, layer.attn.wk, layer.attn.wv):
                lin.requires_grad_(False)
            layer.attn_norm.requires_grad_(False)

    def forward(self, ids, labels):
        mod, b, h = MASKS[self.mask_name]
        mask = create_block_mask(mod, None if b is None else ids.shape[0], h, ids.shape[1], ids.shape[1],
                                 device="cpu") if self.mask_in_forward else self.block_mask
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(mask: str, mask_in_forward: bool, score_mod=None, kv_heads: int = HEADS, batch: int = BATCH):
    model = FlexLlama(mask, mask_in_forward, score_mod, kv_heads=kv_heads, batch=batch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (batch, SEQ), generator=g)
    return model, {"ids": ids, "labels": torch.roll(ids, -1, 1)}


@pytest.mark.parametrize("mask_in_forward", [False, True])
def test_flex_attention_is_one_op_with_rows_heads_and_queries_split_and_keys_whole(mask_in_forward):
    from nnscaler_plugins.rules import signature_for

    model, batch = build("document", mask_in_forward, alibi)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = nns.capture(model, batch)
    assert not [w for w in caught if "no dimension rule" in str(w.message)], [str(w.message) for w in caught]
    ops = [op for op in graph.ops if isinstance(op.target, type(graph.ops[0].target)) or "FlexAttentionCall" in str(op.target)]
    ops = [op for op in ops if "FlexAttentionCall" in str(op.target)]
    assert len(ops) == 2, [str(op.target) for op in graph.ops]
    sig = signature_for(graph, ops[0])
    assert sig.inputs[0] == ("b", "h", "l", "^e") and sig.inputs[1][2] == "^s" and sig.outputs[0][:3] == ("b", "h", "l"), sig
    plan = nns.plan(graph, strategy="tp", world_size=2)
    assert all(plan.ops[op.name].splits and plan.ops[op.name].splits[0][0] == "h" for op in ops), \
        [plan.ops[op.name].splits for op in ops]


QUERY_CASES = [(n, s) for n in MASKS for s in (None, alibi)] if EVERY else [("document", alibi), ("sliding_window", None)]


@pytest.mark.parametrize("name,score_mod", QUERY_CASES)
def test_pieces_of_queries_with_whole_keys_reassemble_the_whole_op(name, score_mod):
    """Context parallelism's pieces: each holds some global query positions (contiguous, the
    mirrored split that balances a causal mask, or shares of blocks), with every key and value."""
    from nnscaler_plugins.kernels.flex_attention_piece import FlexSpec, query_chunks_of, register

    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, 8) for _ in range(3))
    key = register(FlexSpec(_mask(name), score_mod, None, False, False, None))
    whole = FlexAttentionCall.apply(q, k, v, key)
    for n, blocks in ((2, 1), (2, -2), (4, -2), (2, 2)):
        out = torch.full_like(whole, float("nan"))
        for j in range(n):
            chunks = query_chunks_of(SEQ, n, j, blocks)
            rows = torch.cat([torch.arange(start, start + length) for start, length in chunks])
            for b0, h0, nb, nh in ((0, 0, BATCH // 2, HEADS), (BATCH // 2, HEADS // 2, BATCH // 2, HEADS // 2),
                                   (BATCH // 2, 0, BATCH // 2, HEADS // 2)):
                part = (slice(b0, b0 + nb), slice(h0, h0 + nh))
                out[part[0], part[1], rows] = flex_attention_piece(q[part][:, :, rows], k[part], v[part], key, b0, h0,
                                                                   chunks)
        torch.testing.assert_close(out, whole, msg=f"{name} {score_mod}: {n} pieces, blocks {blocks}")


def test_context_parallelism_splits_flex_attention_queries_and_refuses_explicit_block_masks():
    from torch.nn.attention.flex_attention import BlockMask

    from nnscaler_plugins.errors import PlanError

    model, batch = build("causal", False)
    graph = nns.capture(model, batch)
    plan = nns.plan(graph, strategy="cp", world_size=2)
    flex = [name for name in plan.ops if name.startswith("flex_attention")]
    assert flex and all(plan.ops[name].splits == [("l", 2)] for name in flex), {n: plan.ops[n].splits for n in flex}

    blocks = SEQ // 128  # a causal mask of one block, given as block indices: no mask_mod to rebuild from
    explicit = BlockMask.from_kv_blocks(torch.ones(1, 1, blocks, dtype=torch.int32),
                                        torch.zeros(1, 1, blocks, blocks, dtype=torch.int32))
    model.block_mask = explicit
    graph = nns.capture(model, batch)
    with pytest.raises(PlanError) as err:
        nns.plan(graph, strategy="cp", world_size=2)
    assert "explicit block indices" in str(err.value) and "create_block_mask" in str(err.value), str(err.value)


# -- masks made from the batch ---------------------------------------------------------------------

EOS = 0


def padding_bias(pad):
    """A score_mod reading the batch: keys at padding pushed down (a mask as a bias)."""
    def biased(score, b, h, q, kv):
        return score - 5.0 * pad[b, kv]

    return biased


class DocLlama(FlexLlama):
    """The block mask made in forward from the batch's end-of-sequence tokens (causal within each
    document), and a score_mod reading the batch's padding, as a packed-sequence model does."""

    def __init__(self, score_from_batch: bool = False, **kwargs):
        super().__init__("causal", True, **kwargs)
        self.score_from_batch = score_from_batch

    def forward(self, ids, labels):
        mask = create_block_mask(and_masks(causal, get_document_mask_mod(ids, EOS)), ids.shape[0], None, ids.shape[1],
                                 ids.shape[1], device="cpu")
        x = self.embed(ids)
        score_mod = padding_bias((ids == 1).float()) if self.score_from_batch else None
        for layer in self.layers:
            layer.attn.score_mod = score_mod
            x = layer(x, mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class MaskInputLlama(FlexLlama):
    """torchtitan's way: the block mask built outside the model from each batch and passed to
    forward as `attention_masks`."""

    def __init__(self, **kwargs):
        super().__init__("causal", True, **kwargs)

    def forward(self, ids, labels, attention_masks):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, attention_masks)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def with_document_mask(batch: dict) -> dict:
    """What a torchtitan-style training loop does before calling the model."""
    ids = batch["ids"]
    mask = create_block_mask(and_masks(causal, get_document_mask_mod(ids.clone(), EOS)), ids.shape[0], None,
                             ids.shape[1], ids.shape[1], device="cpu")
    return {**batch, "attention_masks": mask}


def doc_batch(seed: int, batch: int = BATCH, seq: int = SEQ) -> dict:
    """Rows of 2-4 documents, their ends at other places in every batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 32, (batch, seq), generator=g)
    for row in ids:
        for end in torch.randint(8, seq - 8, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g):
            row[end] = EOS
        row[-int(torch.randint(0, 12, (1,), generator=g)):] = 1  # padding at the end
    return {"ids": ids, "labels": torch.roll(ids, -1, 1)}


def test_a_mask_made_from_the_batch_is_an_input_of_the_op_and_built_each_call():
    model = DocLlama(score_from_batch=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = nns.capture(model, doc_batch(0))
    assert not [w for w in caught if "no dimension rule" in str(w.message)], [str(w.message) for w in caught]
    flex = [op for op in graph.ops if "FlexAttentionCall" in str(op.target)]
    assert len(flex) == 2 and all(len(op.inputs) == 5 for op in flex), [op.inputs for op in flex]
    # the op, called on other batches, computes what FlexAttention computes with their masks
    for op in flex[:1]:
        key = op.args[3]
        torch.manual_seed(0)
        q, k, v = (torch.randn(BATCH, HEADS, SEQ, 8) for _ in range(3))
        for seed in (1, 2):
            ids = doc_batch(seed)["ids"]
            docs, pad = get_document_mask_mod(ids.clone(), EOS), (ids == 1).float()
            want = flex_attention(q, k, v, score_mod=padding_bias(pad), block_mask=create_block_mask(
                and_masks(causal, docs), BATCH, None, SEQ, SEQ, device="cpu"))
            seq_ids = docs.__closure__[0].cell_contents
            got = FlexAttentionCall.apply(q, k, v, key, 0, 0, None, seq_ids, pad)
            torch.testing.assert_close(got, want, msg=f"batch {seed}")
            halves = [flex_attention_piece(q[i * 2:i * 2 + 2, :, rows], k[i * 2:i * 2 + 2], v[i * 2:i * 2 + 2], key,
                                           i * 2, 0, chunks, seq_ids, pad)
                      for i in range(2) for chunks, rows in [(((0, 64),), slice(0, 64)), (((64, 64),), slice(64, 128))]]
            torch.testing.assert_close(torch.cat([torch.cat(halves[:2], 2), torch.cat(halves[2:], 2)]), want)
    for strategy in ("dp", "tp", "cp"):
        plan = nns.plan(graph, strategy=strategy, world_size=2)
        assert plan is not None


def window_mask(ids, width: int):
    """A sliding window within each document: the width a plain int the function closes over."""
    docs = get_document_mask_mod(ids.clone(), EOS)

    def windowed(b, h, q, kv):
        return docs(b, h, q, kv) & (q >= kv) & (q - kv <= width)

    return create_block_mask(windowed, ids.shape[0], None, ids.shape[1], ids.shape[1], device="cpu")


def test_a_mask_passed_to_forward_runs_with_each_batch_and_refuses_another_function():
    torch.manual_seed(0)
    model = MaskInputLlama(kv_heads=2).eval()
    batch = doc_batch(0)
    pm = nns.parallelize(model, {**batch, "attention_masks": window_mask(batch["ids"], 16)}, plan="dp", world_size=1,
                         cache_dir="/tmp/nns_test_cache")
    for seed in (1, 2):
        other = doc_batch(seed)
        other["attention_masks"] = window_mask(other["ids"], 16)
        torch.testing.assert_close(pm.train_step(other), model(**other), msg=f"batch {seed}")
    other["attention_masks"] = window_mask(other["ids"], 32)  # another width: not what was captured
    with pytest.raises(RuntimeError, match="made by another function than the one captured"):
        pm.train_step(other)


def test_a_batch_tensor_read_through_an_attribute_is_refused_by_name():
    class ThroughAnAttribute(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x, docs):
            self.docs = docs + 0

            def same_doc(b, h, q, kv):
                return self.docs[b, q] == self.docs[b, kv]

            mask = create_block_mask(same_doc, x.shape[0], None, SEQ, SEQ, device="cpu")
            q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, 1, 8).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v, block_mask=mask).sum()

    with pytest.raises(CaptureError) as err:
        nns.capture(ThroughAnAttribute().requires_grad_(False), (torch.randn(2, SEQ, 8), DOCS[:2].clone()))
    msg = str(err.value)
    assert "FlexAttention" in msg and "mask_mod" in msg and "closure" in msg and "test_flex_attention.py:" in msg, msg


def test_a_mask_made_for_another_batch_size_is_refused_by_name():
    model, batch = build("document", False, batch=BATCH)
    half = {k: v[:2] for k, v in batch.items()}  # what a replica or a micro-batch holds
    with pytest.raises(CaptureError) as err:
        nns.capture(model, half)
    msg = str(err.value)
    assert "FlexAttention" in msg and "made for 4 rows" in msg and "B=None" in msg, msg


def test_a_score_mod_reading_a_learned_tensor_is_refused_by_name():
    class LearnedBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.bias = nn.Linear(8, 24), nn.Parameter(torch.zeros(SEQ))

        def forward(self, x):
            bias = self.bias

            def biased(score, b, h, q, kv):
                return score + bias[kv]

            q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, 1, 8).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v, score_mod=biased).sum()

    with pytest.raises(CaptureError) as err:
        nns.capture(LearnedBias(), (torch.randn(2, SEQ, 8),))
    assert "FlexAttention" in str(err.value) and "gradient" in str(err.value), str(err.value)


def test_flex_attention_called_through_a_held_reference_is_refused_by_name_with_the_way_out():
    class Held(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.attend = nn.Linear(8, 24), flex_attention  # a reference capture does not replace

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, 1, 8).permute(2, 0, 3, 1, 4)
            return self.attend(q, k, v, block_mask=_mask("causal")).sum()

    with pytest.raises(CaptureError) as err:
        nns.capture(Held().requires_grad_(False), (torch.randn(2, SEQ, 8),))
    msg = str(err.value)
    assert "FlexAttention" in msg and "test_flex_attention.py:" in msg and "attribute" in msg, msg


# -- equivalence with one process on two workers ------------------------------------------------------

# by default one case that reaches every piece of the rule: a per-head mask made in forward (sliced
# under tp), a score_mod reading the global head, grouped-query heads
CASES = [("head_window", True, alibi, 2)]
ALL_CASES = CASES + [("document", False, alibi, HEADS), ("causal", True, None, HEADS), ("sliding_window", False, None, HEADS),
                     ("sliding_window", True, alibi, 2), ("head_window", False, None, HEADS), ("document", True, None, 2),
                     ("causal", False, alibi, 2)]
PLANS_2 = [("dp", {}, 2), ("tp", {}, 1), ("1f1b", {"pp": 2, "micro_batches": 2}, 1), ("cp", {}, 1)]


def _equivalence(rank, world, cases):
    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mask, in_forward, score_mod, kv_heads in cases:
            for strategy, options, dp in PLANS_2:
                # a mask with a row dim reads DOCS by row: a replica's or a micro-batch's rows are others
                if (dp > 1 or "pp" in options) and MASKS[mask][1] is not None:
                    continue
                builder = functools.partial(build, mask, in_forward, score_mod, kv_heads)
                problems += sgd_equivalence(rank, world, builder, strategy, options, dp, training=True,
                                            what=f"{mask} (in forward: {in_forward}, {score_mod}) under {strategy}")
    return problems


def test_flex_llama_trains_like_one_process_under_dp_tp_and_a_pipeline(workers2):
    problems = workers2.run(_equivalence, ALL_CASES if EVERY else CASES)
    assert problems == [[], []], problems


def _doc_llama(score_from_batch: bool):
    return DocLlama(score_from_batch=score_from_batch, kv_heads=2), doc_batch(0)


def _batch_mask_equivalence(rank, world, plans, score_from_batch):
    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy, options, dp in plans:
            problems += sgd_equivalence(rank, world, functools.partial(_doc_llama, score_from_batch), strategy, options,
                                        dp, steps=3, training=True, batch_of_step=doc_batch,
                                        what=f"mask from the batch (score_mod from it: {score_from_batch}) under {strategy}")
    return problems


def _mask_input_equivalence(rank, world, plans):
    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy, options, dp in plans:
            problems += sgd_equivalence(rank, world, lambda: (MaskInputLlama(kv_heads=2), doc_batch(0)), strategy,
                                        options, dp, steps=3, training=True, batch_of_step=doc_batch,
                                        with_inputs=with_document_mask, what=f"mask passed to forward under {strategy}")
    return problems


def test_masks_passed_to_forward_train_like_one_process(workers2):
    """torchtitan passes each batch's block mask to forward; under a pipeline each micro-batch
    reads its own rows of it."""
    problems = workers2.run(_mask_input_equivalence, PLANS_2)
    assert problems == [[], []], problems


class WindowLlama(FlexLlama):
    """A mask function reading the module's own setting (`self.window`), as model code often does."""

    def __init__(self, **kwargs):
        super().__init__("causal", True, **kwargs)
        self.window = 24

    def forward(self, ids, labels):
        def windowed(b, h, q, kv):
            return (q >= kv) & (q - kv <= self.window)

        mask = create_block_mask(windowed, None, None, ids.shape[1], ids.shape[1], device="cpu")
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def _window_equivalence(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sgd_equivalence(rank, world, lambda: (WindowLlama(kv_heads=2), doc_batch(0)), "dp", {}, 2,
                               training=True, what="a mask reading self.window under dp")


def test_a_mask_reading_an_object_is_the_same_op_on_every_rank(workers2):
    """The op's key names the same call on every rank: an object a mask function reads (the
    module) is named by the order it was first met, not by its address, which differs per process
    (the ranks' captures then disagreed and the plan was refused)."""
    problems = workers2.run(_window_equivalence)
    assert problems == [[], []], problems


def test_masks_made_from_each_batch_train_like_one_process(workers2):
    """Every step's batch has its documents ending elsewhere: a mask kept from capture, or one
    built from another replica's or micro-batch's rows, differs from one process by step 1."""
    problems = workers2.run(_batch_mask_equivalence, PLANS_2, True)
    assert problems == [[], []], problems


# -- a Hugging Face model on FlexAttention --------------------------------------------------------------

def _hf_flex_llama(attention: str = "flex_attention"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
                      attn_implementation=attention)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _hf_batch(seed: int, padded: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padded:  # left padding (keys every later query would see) of other lengths every batch
        for row, n in enumerate(torch.randint(0, 40, (BATCH,), generator=g).tolist()):
            mask[row, :n] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _hf_forward(rank, world):
    problems = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for strategy in ("tp", "cp"):
            model = _hf_flex_llama("sdpa")  # the same weights and masks, another kernel (no compile of flex)
            pm = nns.parallelize(_hf_flex_llama(), _hf_batch(0), plan=strategy, cache_dir="/tmp/nns_test_cache")
            with torch.no_grad():
                for seed, padded in ((1, True), (2, False), (3, True)):
                    batch = _hf_batch(seed, padded)
                    got, want = float(pm(**batch).loss), float(model(**batch).loss)
                    if abs(got - want) > 1e-5 * abs(want):
                        problems.append(f"{strategy} batch {seed}: loss {got:.7g} vs {want:.7g}")
    return problems


def test_a_hugging_face_model_on_flex_attention_computes_each_batch_with_its_padding(workers2):
    """transformers' FlexAttention path reads the attention mask's values to decide whether to add
    the padding function, and compiles flex_attention: both are made capturable while capturing
    (adapters/hf_flex_attention.py), the padding mask reaches the op as its input, and every batch,
    padded or not, gets its own loss under tp and cp (forward: no FlexAttention backward on a CPU)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = nns.capture(_hf_flex_llama(), _hf_batch(0))
    assert not [str(w.message) for w in caught if "no dimension rule" in str(w.message)]
    flex = [op for op in graph.ops if "FlexAttentionCall" in str(op.target)]
    assert len(flex) == 2 and all(len(op.inputs) == 4 for op in flex), [op.inputs for op in flex]
    problems = workers2.run(_hf_forward)
    assert problems == [[], []], problems
