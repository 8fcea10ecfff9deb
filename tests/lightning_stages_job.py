"""Job for tests/test_lightning_stages.py: on one 2-process Lightning launch, each strategy named on
the command line (DDP, and "single": one device, run by the launching process before Lightning starts
the others, as the references) runs fit, validate, test, predict, validate again and
a resumed fit (`ckpt_path="last"`) on one Trainer, and each rank writes what every stage gave, what
was left behind (threads, files in the current directory, the process group), and whether the
planned LightningModule pickles to a plain one with whole weights, to `<out>/<strategy>.<rank>.json`.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import sys
import threading

import lightning.pytorch as pl
import torch

import nnscaler_plugins  # noqa: F401 - registers the strategy
from nnscaler_plugins.adapters.lightning import NNScalerStrategy


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.register_buffer("shift", torch.linspace(0, 1, 4), persistent=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) + self.shift


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()
        self.seen: list = []

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, i):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        self.seen.append(["fit", i, float(loss), self.net.training])
        return loss

    def validation_step(self, batch, i):
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.seen.append(["validate", i, float(loss), self.net.training])

    def test_step(self, batch, i):
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        self.seen.append(["test", i, float(loss), self.net.training])

    def predict_step(self, batch, i):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(n: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def make_strategy(name: str):
    if name in ("ddp", "single"):
        return "ddp" if name == "ddp" else "auto"
    return NNScalerStrategy(plan=name.split(":")[0], **dict(kv.split("=") for kv in name.split(":")[1:]))


def run(name: str, out: str, root: str) -> None:
    strategy = make_strategy(name)
    torch.manual_seed(0)
    module = Module()
    cwd_before = sorted(os.listdir("."))
    threads_before = {t.ident for t in threading.enumerate()}
    kw = dict(accelerator="cpu", devices=1 if name == "single" else 2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=os.path.join(root, name.replace(":", "_")), num_sanity_val_steps=0,
              # against one device (plans with one replica): every rank reads the loaders as they are
              use_distributed_sampler=os.environ.get("NNS_STAGES_SAMPLER", "1") == "1")
    trainer = pl.Trainer(strategy=strategy, max_steps=3, **kw)
    train, val, test, pred = loader(24, 4, 1), loader(12, 3, 2), loader(10, 5, 3), loader(6, 3, 4)
    metrics = {}
    # stages before any fit plan the model on their own batches; then fit, and every stage again
    metrics["validate0"] = trainer.validate(module, val, verbose=False)
    metrics["fit"] = {k: float(v) for k, v in trainer.fit(module, train, val) or {}}
    metrics["after_fit"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    left = {"threads": sorted(t.name for t in threading.enumerate() if t.ident not in threads_before),
            "dist": torch.distributed.is_initialized(), "cwd": sorted(set(os.listdir(".")) - set(cwd_before))}
    metrics["validate"] = trainer.validate(module, val, verbose=False)
    metrics["test"] = trainer.test(module, test, verbose=False)
    preds = [p.tolist() for p in trainer.predict(module, pred)]
    metrics["validate2"] = trainer.validate(module, val, verbose=False)
    trainer.save_checkpoint(os.path.join(kw["default_root_dir"], "last.ckpt"))
    # pickling the planned module (every rank: whole weights may need gathering)
    blob = pickle.dumps(module)
    buf = io.BytesIO()
    torch.save(module, buf)
    plain = pickle.loads(blob)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(9))
    pickled = {"type": type(plain.net).__name__, "out": plain.net(x).tolist(), "same": torch.equal(
        plain.net(x), loaded.net(x)), "state": {k: v.tolist() for k, v in plain.net.state_dict().items()}}
    # a second Trainer resumes the first's checkpoint and trains on
    torch.manual_seed(0)
    resumed = Module()
    strategy2 = make_strategy(name)
    kw2 = dict(kw, default_root_dir=os.path.join(root, name.replace(":", "_") + "_resumed"))
    trainer2 = pl.Trainer(strategy=strategy2, max_steps=5, **kw2)
    trainer2.fit(resumed, train, ckpt_path=os.path.join(kw["default_root_dir"], "last.ckpt"))
    # ... and the first Trainer fits again from its own last checkpoint
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(module, train, ckpt_path="last")
    metrics["test2"] = trainer.test(module, test, verbose=False)
    rank = trainer.global_rank if name != "single" else 0
    caches = [d for d, _, files in os.walk(root) if d.endswith(".nnscaler_cache")]
    with open(os.path.join(out, f"{name}.{rank}.json"), "w") as f:
        json.dump({"seen": module.seen, "resumed_seen": resumed.seen, "metrics": metrics, "preds": preds,
                   "left": left, "pickled": pickled, "caches": caches}, f)


if __name__ == "__main__":
    out, root = sys.argv[1], sys.argv[2]
    names = sys.argv[3:]
    if "single" in names and "LOCAL_RANK" not in os.environ:  # one device, before Lightning starts the others
        run("single", out, root)
    for name in names:
        if name != "single":
            run(name, out, root)
