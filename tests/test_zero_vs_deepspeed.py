"""Side by side with real DeepSpeed (a test-only reference; nnscaler_plugins never imports it):
the same GPT-2, data, AdamW and fp32 under DeepSpeed ZeRO 1, 2 and 3 and under our zero1/2/3 plans,
2 gloo processes, give the same loss trajectory over 10 steps (with DeepSpeed's gradient clipping
at 1.0, so our global-norm clipping is compared too)."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import models
from test_zero import slice_batch

pytest.importorskip("deepspeed", reason="DeepSpeed is a test extra (pip install nnscaler-plugins[dev])")


# Importing DeepSpeed in a worker patches torch functions for the rest of that process: these
# workers are this module's own, not the session's shared ones.
@pytest.fixture(scope="module")
def workers2():
    from harness import Workers

    with Workers(2) as w:
        yield w

STEPS = 10
LR, WEIGHT_DECAY = 1e-3, 0.01
CLIP = 1.0  # stated explicitly: DeepSpeed clips by the global norm (1.0) unless told otherwise


def deepspeed_config(stage: int, micro_batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": CLIP, "steps_per_print": 10 ** 9}


def batches(inputs: dict, steps: int) -> list[dict]:
    """A different global batch each step (the same on every rank and for both runs)."""
    return [{k: v.roll(s, 0) for k, v in inputs.items()} if s else inputs for s in range(steps)]


def run_side_by_side(rank: int, world: int, stages=(1, 2, 3)) -> dict:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "DS_ACCELERATOR": "cpu"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    import deepspeed

    import nnscaler_plugins as nns

    torch.manual_seed(0)
    base, inputs = models.gpt2_small()
    base.eval()
    data = [slice_batch(b, rank, world) for b in batches(inputs, STEPS)]
    out = {}
    for stage in stages:
        model = copy.deepcopy(base)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=deepspeed_config(stage, data[0]["input_ids"].shape[0]),
                                          dist_init_required=False)
        engine.eval()  # dropout off, as in our module
        theirs = []
        for batch in data:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            theirs.append(loss.item())
        engine.destroy()

        # captured after DeepSpeed is imported, which patches torch.nn.functional.linear
        pm = nns.parallelize(copy.deepcopy(base), data[0], plan=f"zero{stage}", cache_dir="/tmp/nns_test_cache")
        opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        ours = []
        for batch in data:
            ours.append(pm.train_step(batch).item())
            opt.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        out[stage] = (theirs, ours)
    return out


def test_loss_trajectory_matches_deepspeed(workers2):
    results = workers2.run(run_side_by_side)
    for rank, per_stage in enumerate(results):
        for stage, (theirs, ours) in per_stage.items():
            # fp32 tolerance: both sum the same gradients in another order (DeepSpeed's flat
            # buffers vs our buckets), which AdamW amplifies slightly over 10 steps
            assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-5), (rank, stage, theirs, ours)
