"""Pretrained weights from a Hugging Face `save_pretrained` directory, read per shard.

A 1-layer GPT-2 saved with small safetensors shards (and its index) is loaded under tp 2 and
ZeRO-3 on 2 gloo processes into a model initialized from another seed: every whole weight and the
loss equal the saved eager model's, and each rank asks the files for exactly the elements its own
pieces hold. Mismatched names and shapes are refused before anything changes.
"""
from __future__ import annotations

import os

import pytest
import torch

import models


def _saved(root: str) -> str:
    torch.manual_seed(0)
    model, _ = models.gpt2_small(1)
    path = os.path.join(root, "gpt2_hf")
    model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
    return path


def _batch() -> dict:
    ids = torch.randint(0, models.VOCAB, (models.BATCH, models.SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def load_under_plans(rank: int, world: int, path: str) -> dict:
    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint.hf_weights import hf_source, matched_to
    from nnscaler_plugins.checkpoint.load import load_model_pieces
    from nnscaler_plugins.checkpoint.model_state import expected_model_tensors

    out = {}
    for plan in ("tp", "zero3"):
        torch.manual_seed(123)  # other initial weights than the saved ones
        model, _ = models.gpt2_small(1)
        model.eval()
        batch = _batch()
        pm = nns.parallelize(model, batch, plan=plan, world_size=world, cache_dir="/tmp/nns_test_cache")
        nns.checkpoint.load(path, pm)
        state = pm.full_state_dict()
        loss = pm(**batch).loss.detach()
        # What a load asks the files for: exactly the elements this rank's pieces hold.
        source = matched_to(hf_source(path), set(expected_model_tensors(pm)))
        asked = {"n": 0}
        read = source.read

        def counting(name, box, read=read):
            t = read(name, box)
            asked["n"] += t.numel()
            return t
        source.read = counting
        load_model_pieces(pm, source)
        held = sum(pm.local_tensor(v).numel() for v in pm.held_keys if pm.program.shards[v].in_state_dict)
        out[plan] = (state, loss, asked["n"], held) if rank == 0 else (None, None, asked["n"], held)
    return out


def test_sharded_safetensors_load_per_shard_under_tp2_and_zero3(workers2, tmp_path):
    path = _saved(str(tmp_path))
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    torch.manual_seed(0)
    eager, _ = models.gpt2_small(1)
    eager.eval()
    want_loss = eager(**_batch()).loss.detach()
    want = eager.state_dict()
    results = workers2.run(load_under_plans, path)
    for plan in ("tp", "zero3"):
        state, loss, _, _ = results[0][plan]
        assert set(state) == set(want), plan
        bad = [k for k, v in want.items() if not torch.equal(state[k], v)]
        assert not bad, (plan, bad[:5])
        assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6), (plan, loss, want_loss)
        for rank, r in enumerate(results):
            _, _, asked, held = r[plan]
            assert asked == held, (plan, rank, asked, held)  # no element beyond the rank's own pieces


def test_mismatched_weights_are_refused_by_name_and_dtype_conversion_is_said(tmp_path):
    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint import CheckpointError
    from transformers import GPT2Config, GPT2LMHeadModel

    path = _saved(str(tmp_path))
    wider = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=models.VOCAB + 2, n_positions=32))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        nns.checkpoint.load(path, wider)
    msg = str(e.value)
    assert "nothing was loaded" in msg and "missing from the pretrained checkpoint" in msg and "transformer.h.1" in msg
    assert "transformer.wte.weight: the pretrained checkpoint has shape [128, 64], the module [130, 64]" in msg, msg
    assert all(torch.equal(v, wider.state_dict()[k]) for k, v in before.items())

    half = str(tmp_path / "bf16")
    torch.manual_seed(0)
    model, _ = models.gpt2_small(1)
    model.to(torch.bfloat16).save_pretrained(half)  # one model.safetensors
    target, _ = models.gpt2_small(1)
    with pytest.warns(UserWarning, match="converted .* from bfloat16 to float32"):
        nns.checkpoint.load(half, target)
    assert all(torch.equal(target.state_dict()[k], v.float()) for k, v in model.state_dict().items())
    pickled = str(tmp_path / "bin")  # pytorch_model.bin, memory-mapped
    model.float().config.save_pretrained(pickled)  # the layout older save_pretrained wrote (tied head saved once)
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
               os.path.join(pickled, "pytorch_model.bin"))
    target, _ = models.gpt2_small(1)
    nns.checkpoint.load(pickled, target)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in model.state_dict().items())
    base = str(tmp_path / "base")  # a base model's checkpoint (no "transformer." prefix) into the model with a head
    model.float().transformer.save_pretrained(base)
    target, _ = models.gpt2_small(1)
    nns.checkpoint.load(base, target, strict=False)
    assert torch.equal(target.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight)
