"""Train a small GPT-2 with Lightning under nnscaler-plugins plans, and check it against one device.

    python recipes/lightning_gpt.py                                   # dp, tp, 1f1b, auto on 2 CPU processes
    python recipes/lightning_gpt.py --devices 4 --plans "tp;1f1b:pp=2;hybrid:tp=2,dp=2"
    python recipes/lightning_gpt.py --plans dp --precision bf16-mixed --accumulate 2 --clip 1.0
    python recipes/lightning_gpt.py --plans dp --resume-check         # ModelCheckpoint + fit(ckpt_path=...)
    python recipes/lightning_gpt.py --plans "zero3;zero2" --clip 1.0  # ZeRO: the optimizer is rebuilt sharded
    python recipes/lightning_gpt.py --namespace=pytorch_lightning     # the same under `import pytorch_lightning`

The only change from an ordinary Lightning script is `strategy=NNScalerStrategy(plan=...)` (or the
string "nnscaler" for data parallelism). Lightning's launcher re-runs this script once per extra
process. Before launching, the first process trains the same model on one device with the global
batch (the per-process batch times the data-parallel degree) for every degree a plan may use; each
plan's losses must match that run's (fp32: relative 1e-4 after AdamW steps, whose learning rate of
1e-2 moves the loss by far more than that each step; bf16-mixed: 3e-2). The
script prints one JSON line per plan and exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

import nnscaler_plugins  # noqa: F401  (registers strategy="nnscaler" in Lightning)
from nnscaler_plugins.progress import Progress

if "--namespace=pytorch_lightning" in sys.argv:  # the same Lightning under its older package name
    import pytorch_lightning as pl
else:
    import lightning.pytorch as pl

SEQ, VOCAB = 16, 128


def build_gpt2(seed: int = 0) -> torch.nn.Module:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


class GPT2Module(pl.LightningModule):
    """An ordinary LightningModule: nothing in it knows about plans."""

    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.model = build_gpt2()
        self.lr = lr

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch, labels=batch)
        self.log("train_loss", out.loss, sync_dist=True)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LossLog(pl.Callback):
    """Each step's loss averaged over all processes (tensor-parallel ranks hold equal values)."""

    def __init__(self, steps: int = 0):
        self.losses: list[float] = []
        self.bar = None
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().float()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))
        if trainer.is_global_zero:  # stderr: stdout carries the recipe's JSON lines
            if self.bar is None:
                self.bar = Progress("training", self.steps or None, stream=sys.stderr, delay_s=2.0)
            self.bar.step(note=f"loss {self.losses[-1]:.4f}")

    def on_train_end(self, trainer, pl_module):
        if self.bar is not None:
            self.bar.close()


def fit(strategy, devices: int, batch_size: int, steps: int, *, samples: int, precision: str = "32-true", accumulate: int = 1,
        clip: float = 0.0, epochs: int = 1, ckpt_dir: str | None = None, ckpt_path: str | None = None):
    torch.manual_seed(0)
    module = GPT2Module()
    log = LossLog(steps * epochs)
    callbacks: list = [log]
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
                         precision=precision, accumulate_grad_batches=accumulate, gradient_clip_val=clip or None,
                         logger=False, enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0,
                         limit_train_batches=steps * accumulate)
    data = Tokens(samples)
    # Lightning gives every process of a distributed run a DistributedSampler that shuffles with seed 0;
    # one device reads the same order (the permutation does not depend on the number of replicas), so
    # its batch of B x dp samples is the union of the replicas' batches at every step.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) \
        if devices == 1 else None
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, log.losses


def parse_plan(spec: str) -> tuple[str, dict]:
    """"1f1b:pp=2,micro_batches=2" -> ("1f1b", {"pp": 2, "micro_batches": 2}); plain names have no options."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, options


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(y), 1e-8) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--plans", default="dp;tp;1f1b;auto",
                    help="';'-separated strategy names, each with options after ':' (e.g. '1f1b:pp=2;tp')")
    ap.add_argument("--batch-size", type=int, default=4, help="per data-parallel replica")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--namespace", choices=["lightning.pytorch", "pytorch_lightning"], default="lightning.pytorch",
                    help="which Lightning package to use (pass as --namespace=NAME)")
    ap.add_argument("--resume-check", action="store_true",
                    help="also save a checkpoint per epoch and resume from the first (first plan only)")
    ap.add_argument("--resume-under", default="",
                    help="';'-separated plans to resume the first plan's checkpoint under too (same data-parallel "
                         "size: the optimizer state is resharded)")
    ap.add_argument("--state-dict-type", choices=["full", "sharded"], default="full",
                    help="the resume check's checkpoints: one .ckpt of whole tensors (rank 0 writes) or a directory "
                         "each rank writes its own pieces to")
    args = ap.parse_args(argv)
    launcher = "LOCAL_RANK" not in os.environ  # Lightning's re-run children have it set
    rtol = 1e-4 if args.precision == "32-true" else 3e-2
    kw = dict(precision=args.precision, accumulate=args.accumulate, clip=args.clip)
    # the same data for every run: enough samples for the largest global batch
    kw["samples"] = args.batch_size * args.devices * args.steps * args.accumulate

    reference = {}
    if launcher:  # one device, global batch, for each data-parallel degree a plan may choose
        for dp in [d for d in range(1, args.devices + 1) if args.devices % d == 0]:
            reference[dp] = fit("auto", 1, args.batch_size * dp, args.steps, **kw)[1]

    ok = True
    from nnscaler_plugins.adapters.lightning import strategy_class

    NNScalerStrategy = strategy_class(pl.__name__)  # the class made for this Lightning package

    for name in args.plans.split(";"):
        # "nnscaler" alone is data parallelism; any other plan is given to the strategy object
        plan, options = parse_plan(name)
        chosen = "nnscaler" if name == "dp" else NNScalerStrategy(plan=plan, **options)
        trainer, losses = fit(chosen, args.devices, args.batch_size, args.steps, **kw)
        strategy = trainer.strategy
        sampler = trainer.train_dataloader.sampler
        row = {"plan": name, "devices": args.devices, "namespace": pl.__name__, "strategy": type(strategy).__qualname__, "dp": strategy.pmodule.dp_size,
               "sampler": [sampler.num_replicas, sampler.rank], "dp_rank": strategy.pmodule.dp_rank,
               "zero": strategy.pmodule.plan.zero, "optimizer": type(trainer.optimizers[0]).__name__,
               "losses": losses, **{k: v for k, v in kw.items() if k != "samples"}}
        if launcher:
            ref = reference[strategy.pmodule.dp_size]
            row["reference"] = ref
            row["match"] = _close(losses, ref, rtol)
            row["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) if len(losses) == len(ref) \
                else None
            ok &= row["match"]
            print(json.dumps(row), flush=True)

    if args.resume_check:
        plan, options = parse_plan(args.plans.split(";")[0])
        with tempfile.TemporaryDirectory() as tmp:
            tmp = strategy.broadcast(tmp)  # one directory for all processes
            _, full = fit(NNScalerStrategy(plan=plan, state_dict_type=args.state_dict_type, **options), args.devices,
                          args.batch_size, args.steps, epochs=2, ckpt_dir=tmp, **kw)
            first = os.path.join(tmp, sorted(f for f in os.listdir(tmp) if f.startswith("epoch=0"))[0])
            _, resumed = fit(NNScalerStrategy(plan=plan, **options), args.devices, args.batch_size, args.steps, epochs=2,
                             ckpt_path=first, **kw)
            if launcher and args.state_dict_type == "full":
                plain = GPT2Module()  # the checkpoint is an ordinary one: a plain module loads it strictly
                plain.load_state_dict(torch.load(first, weights_only=True)["state_dict"])
            if launcher:
                row = {"resume": plan, "state_dict_type": args.state_dict_type, "directory": os.path.isdir(first),
                       "full": full, "resumed": resumed,
                       "match": _close(resumed, full[args.steps * args.accumulate:], 1e-5)}
                ok &= row["match"]
                print(json.dumps(row), flush=True)
            for other in filter(None, args.resume_under.split(";")):
                plan2, options2 = parse_plan(other)
                _, resumed = fit(NNScalerStrategy(plan=plan2, **options2), args.devices, args.batch_size, args.steps,
                                 epochs=2, ckpt_path=first, **kw)
                if launcher:
                    row = {"resume": plan, "under": other, "full": full, "resumed": resumed,
                           "match": _close(resumed, full[args.steps * args.accumulate:], rtol)}
                    ok &= row["match"]
                    print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
