"""The adapters take models too large for one process: the HF Trainer a meta-device model plus the
weights' path (read per shard by `nns.checkpoint.load`) or a `model_init` that builds on meta, the
Lightning strategy a module whose `configure_model` builds it (on meta, materialized per shard).
Two real gloo processes, one pool shared by the tests."""
from __future__ import annotations

import os
import socket

import pytest
import torch

import models
from harness import Workers

pytest.importorskip("transformers")
pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def workers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = Workers(2)
    yield w, port
    w.close()


def _launcher_env(rank: int, world: int, port: int) -> None:
    """What torchrun would have set: the frameworks then join the process group the pool made."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, models.VOCAB, (n, models.SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2(meta: bool):
    with torch.device("meta") if meta else torch.device("cpu"):
        model, _ = models.gpt2_small()
    return model.eval()


def _hf_run(rank: int, world: int, port: int, out: str, mode: str) -> dict:
    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

    _launcher_env(rank, world, port)
    args = NNScalerTrainingArguments(output_dir=os.path.join(out, mode), use_cpu=True, report_to=[], plan="tp",
                                     ddp_backend="gloo", max_steps=1, per_device_train_batch_size=2,
                                     save_strategy="no", logging_steps=1, learning_rate=1e-3, seed=5)
    if mode == "weights":
        trainer = NNScalerTrainer(model=_gpt2(meta=True), args=args, train_dataset=_Tokens(),
                                  weights=os.path.join(out, "pretrained"))
    else:
        trainer = NNScalerTrainer(model_init=lambda: _gpt2(meta=True), args=args, train_dataset=_Tokens())
    trainer.create_optimizer()  # plans and materializes (and reads the weights)
    start = trainer.nns_module.full_state_dict()
    seed = trainer.nns_module.init_seed
    if mode != "weights":  # training and saving are the same as with weights
        return {"start": start if rank == 0 else None, "seed": seed}
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(os.path.join(out, mode, "saved"))
    return {"start": start if rank == 0 else None, "seed": seed, "loss": loss,
            "meta": all(p.is_meta for p in trainer.model.parameters())}


def test_hf_trainer_meta_model_with_weights_or_model_init(workers, tmp_path):
    import nnscaler_plugins as nns
    from transformers import GPT2LMHeadModel

    pool, port = workers
    pretrained = _gpt2(meta=False)
    torch.nn.init.normal_(pretrained.transformer.h[0].mlp.c_fc.weight, std=0.5)  # not what any init gives
    pretrained.save_pretrained(tmp_path / "pretrained")
    expected = pretrained.state_dict()

    r = pool.run(_hf_run, port, str(tmp_path), "weights")
    assert all(x["meta"] for x in r), "the model object stays on the meta device"
    start = r[0]["start"]
    assert [k for k, v in expected.items() if not torch.equal(start[k], v)] == []
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "weights" / "saved")
    assert all(torch.isfinite(p).all() for p in saved.parameters()) and torch.isfinite(torch.tensor(r[0]["loss"])).all()
    assert not torch.equal(saved.transformer.h[0].mlp.c_fc.weight, expected["transformer.h.0.mlp.c_fc.weight"])

    r = pool.run(_hf_run, port, str(tmp_path), "init")
    ref = nns.init_weights(_gpt2(meta=False), r[0]["seed"]).state_dict()
    assert [k for k, v in ref.items() if not torch.equal(r[0]["start"][k], v)] == []


def _lightning_run(rank: int, world: int, port: int, out: str) -> dict:
    import lightning.pytorch as pl

    from nnscaler_plugins.adapters.lightning import NNScalerStrategy

    _launcher_env(rank, world, port)
    seen = {}

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None
            self.built_on = None

        def configure_model(self):
            if self.model is None:
                self.model = models.gpt2_small()[0]  # the strategy's context puts it on meta
                self.head_scale = torch.nn.Linear(1, 1)  # outside the plan: made whole on every rank
                self.built_on = self.model.transformer.wte.weight.device.type

        def training_step(self, batch, i):
            return self.model(**batch).loss + 0 * self.head_scale.weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_before_optimizer_step(self, optimizer):  # planned at the first call: the weights before any update
            if "start" in seen:
                return
            seen["start"] = self.trainer.strategy.pmodule.full_state_dict()
            seen["seed"] = self.trainer.strategy.pmodule.init_seed

    lm = LM()
    trainer = pl.Trainer(strategy=NNScalerStrategy(plan="tp", module_attr="model"), accelerator="cpu", devices=world, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2)
    trainer.fit(lm, loader)
    return {"start": seen["start"] if rank == 0 else None, "seed": seen["seed"], "built_on": lm.built_on,
            "head": lm.head_scale.weight.device.type, "loss": float(trainer.callback_metrics.get("train_loss", 0.0))}


def test_lightning_configure_model_builds_on_meta_and_materializes_per_shard(workers, tmp_path):
    import nnscaler_plugins as nns

    pool, port = workers
    r = pool.run(_lightning_run, port + 1, str(tmp_path))
    assert {x["built_on"] for x in r} == {"meta"} and {x["head"] for x in r} == {"cpu"}
    assert r[0]["seed"] == r[1]["seed"]
    ref = nns.init_weights(_gpt2(meta=False), r[0]["seed"]).state_dict()
    assert [k for k, v in ref.items() if not torch.equal(r[0]["start"][k], v)] == []
