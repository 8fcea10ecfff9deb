"""Packed sequences: several documents in one row, `position_ids` restarting at each, as Hugging
Face's `DataCollatorWithFlattening` makes them (labels -100 at each document's first token).

The attention mask of such a row depends on `position_ids` (an input), so capture must keep it: a
fold into plain causal attention would let documents see each other. Each step brings rows of
another total length (and, where the plan allows, another number of rows); the reference is one
process on every replica's rows together, padded at the end with ignored labels and positions that
continue the last document (causal attention: padding after a token changes nothing for it).
"""
from __future__ import annotations

import os

import torch

import models
from sgd_check import step_and_compare

# Per step, each replica's documents: a list of rows, each row a list of document lengths.
ONE_ROW = [[[[5, 7, 4]], [[9, 3, 2, 6]]],
           [[[4, 4, 4, 4, 6]], [[11, 5]]],
           [[[3, 9]], [[6, 6, 6]]]]
TWO_ROWS = [[[[5, 7, 4], [8, 8]], [[9, 3, 6], [2, 16]]],
            [[[4, 4, 4, 4, 6], [10, 12]], [[11, 5], [7, 9]]],
            [[[3, 9], [6, 6]], [[5, 5, 4], [14]]]]
# Rows per replica varying too (2 or 3; the example has 2, so one program serves them).
ROWS = [TWO_ROWS[0], TWO_ROWS[1], [[[3, 9], [6, 6], [2, 2, 8]], [[5, 5, 4], [14]]]]


def packed(seed: int, rows: list[list[int]]) -> dict:
    """One batch as DataCollatorWithFlattening builds it (rows of equal total length)."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, labels = [], [], []
    for lens in rows:
        i = torch.randint(1, models.VOCAB, (sum(lens),), generator=g)
        p = torch.cat([torch.arange(n) for n in lens])
        lab = i.clone()
        lab[p == 0] = -100
        ids.append(i)
        pos.append(p)
        labels.append(lab)
    assert len({len(i) for i in ids}) == 1, "rows of one batch have one length"
    return {"input_ids": torch.stack(ids), "position_ids": torch.stack(pos), "labels": torch.stack(labels)}


def _pad(batch: dict, length: int) -> dict:
    n = length - batch["input_ids"].shape[1]
    last = batch["position_ids"][:, -1:]
    return {"input_ids": torch.nn.functional.pad(batch["input_ids"], (0, n), value=0),
            "position_ids": torch.cat([batch["position_ids"], last + torch.arange(1, n + 1)], dim=1),
            "labels": torch.nn.functional.pad(batch["labels"], (0, n), value=-100)}


def run_packed(rank: int, world: int, builder: str, strategy: str, options: dict, steps: list) -> list[str]:
    import nnscaler_plugins as nns
    from nnscaler_plugins.outputs import extract_loss

    torch.manual_seed(0)
    ref, _ = getattr(models, builder)()
    torch.manual_seed(0)
    model, _ = getattr(models, builder)()
    ref.eval()
    model.eval()
    example = packed(0, steps[0][0])
    pm = nns.parallelize(model, example, plan=strategy, cache_dir="/tmp/nns_test_cache", **options)
    sdpa = [op for op in pm.graph.ops if "scaled_dot_product" in op.op_name]
    problems = [f"{strategy}: attention {op.name} lost its mask" for op in sdpa
                if len(op.args) < 4 and op.kwargs.get("attn_mask") is None]
    problems += [f"{strategy}: attention {op.name} folded into is_causal" for op in sdpa
                 if (op.args[5] if len(op.args) > 5 else op.kwargs.get("is_causal"))]
    dp, replica = pm.plan.dp, rank // pm.plan.unit_size
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, per_replica in enumerate(steps):
        per_replica = per_replica[:dp]
        parts = [packed(100 * step + r, rows) for r, rows in enumerate(per_replica)]
        longest = max(p["input_ids"].shape[1] for p in parts)
        whole = {k: torch.cat([_pad(p, longest)[k] for p in parts]) for k in parts[0]}
        ref_loss = extract_loss(ref(**whole))
        ref_loss.backward()
        loss = pm.train_step(parts[replica]).detach().clone()
        if dp > 1:
            torch.distributed.all_reduce(loss)
            loss /= world
        problems += step_and_compare(pm, ref, (opt, ref_opt), loss, ref_loss, f"{builder} {strategy} step {step}")
    if pm.shape_programs.per_shape or pm.shape_programs.fit_failure:
        problems.append(f"{builder} {strategy}: a program per shape ({pm.shape_programs.fit_failure})")
    return problems


def run_cases(rank: int, world: int, cases: list) -> list[str]:
    """Several (model, plan, steps) cases in one task: one round trip to the workers."""
    problems = []
    for builder, strategy, options, steps in cases:
        problems += run_packed(rank, world, builder, strategy, options, steps)
    return problems


PIPELINE = {"pp": 2, "micro_batches": 2}


def test_packed_rows_train_like_one_process_under_dp_tp_and_1f1b(workers2):
    """dp: one row per replica, (1, total) as DataCollatorWithFlattening gives it; tp: 2 or 3 rows;
    1f1b: 2 rows, one per micro-batch. Every later shape runs the one fitted program. Llama (rotary
    positions from `position_ids`) under all three, GPT-2 (learned positions) under tp."""
    cases = [("llama_small", "tp", {}, ROWS), ("llama_small", "1f1b", PIPELINE, TWO_ROWS)]
    if os.environ.get("NNS_TEST_ALL_PLANS") == "1":  # the one-row and learned-position cases
        cases += [("llama_small", "dp", {}, ONE_ROW), ("gpt2_small", "tp", {}, TWO_ROWS)]
    problems = workers2.run(run_cases, cases)
    assert not [p for ps in problems for p in ps], problems
