"""A rank killed under each adapter, and the job resumed the adapter's own way, for tests/test_faults.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 3 tests/fault_adapters_job.py \
        --work DIR --adapters lightning:tp,hf:zero3,deepspeed:tp

For each `ADAPTER:PLAN`, in order: an uninterrupted run (once), then the same run checkpointing every
`--save-every` steps in which a seeded rank SIGKILLs itself after a seeded step (once: a marker file
remembers it). torchrun restarts the job and the run resumes as users of that framework resume:

- Lightning: `ModelCheckpoint(save_last=True, every_n_train_steps=--save-every)` and
  `trainer.fit(..., ckpt_path="last")`, with a loader Lightning can resume mid-epoch (it has
  `state_dict` / `load_state_dict`, as torchdata's StatefulDataLoader does);
- the Hugging Face Trainer: `save_steps=--save-every` and `train(resume_from_checkpoint=True)` once a
  checkpoint exists (the Trainer skips the batches already seen and restores its RNG states);
- the DeepSpeed engine: `save_checkpoint(dir)` and `load_checkpoint(dir)` (tag None: the `latest`
  file), the step in the client state, the data loader advanced past the batches already seen.

Final whole weights go to DIR/ADAPTER-PLAN-{ref,kill}.pt. Lines starting "[fault] " are JSON events.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, os.path.join(ROOT, "recipes")) if p not in sys.path]

BATCH = 2  # samples per replica per step


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(**what: Any) -> None:
    print("[fault] " + json.dumps(what), flush=True)


class Fault:
    """Kill rank `who` after step `step` once (a marker file remembers), and time the way back."""

    def __init__(self, work: str, name: str, seed: int, steps: int, save_every: int, kill: bool):
        rng = random.Random(f"{seed}/{name}")
        self.step = rng.randrange(save_every + 1, steps)  # after the first checkpoint
        self.who = rng.randrange(int(os.environ.get("WORLD_SIZE", "1")))
        self.marker = os.path.join(work, f"fault-{name}.json")
        self.name, self.kill = name, kill
        self.back = None
        if kill and os.path.exists(self.marker):
            with open(self.marker) as f:
                self.back = json.load(f)["time"]

    def after_step(self, step: int) -> None:
        if self.back is not None and rank() == 0:
            say(event="training again", scenario=self.name, step=step, seconds=time.time() - self.back)
            self.back = None
        if self.kill and step == self.step and rank() == self.who and not os.path.exists(self.marker):
            with open(self.marker + ".tmp", "w") as f:
                json.dump({"time": time.time(), "step": step}, f)
            os.replace(self.marker + ".tmp", self.marker)
            say(event="kill", scenario=self.name, step=step, rank=self.who)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


# -- Lightning --------------------------------------------------------------------------------------------------
class StepBatches:
    """This replica's batches in step order, resumable the way Lightning resumes a loader mid-epoch:
    its `state_dict` (saved in the checkpoint) is the number of batches trained on, counted when
    each step ends (`Trained`), not when fetched (Lightning fetches one batch ahead)."""

    def __init__(self, data: Any, batch: int, dp: int, dp_rank: int, steps: int):
        self.data, self.batch, self.dp, self.dp_rank, self.steps = data, batch, dp, dp_rank, steps
        self.start = 0
        self.trained = 0

    def __len__(self) -> int:  # the epoch's length (a resumed epoch goes on at batch `start`)
        return self.steps

    def __iter__(self):
        for k in range(self.start, self.steps):
            first = (k * self.dp + self.dp_rank) * self.batch
            yield torch.stack([self.data[i] for i in range(first, first + self.batch)])
        self.start = 0

    def state_dict(self) -> dict:
        return {"trained": self.trained}

    def load_state_dict(self, state: dict) -> None:
        self.start = self.trained = state["trained"]


def lightning(root: str, plan: str, steps: int, save_every: int, fault: Fault) -> dict:
    import lightning.pytorch as pl

    import lightning_gpt as recipe
    import resilient_train
    from nnscaler_plugins.adapters.lightning import NNScalerStrategy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = resilient_train.replicas(plan, world, {})
    batches = StepBatches(recipe.Tokens(BATCH * steps * dp), BATCH, dp, rank() // (world // dp), steps)

    class Trained(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            batches.trained += 1
            fault.after_step(trainer.global_step)

        def on_train_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step and rank() == 0:
                say(event="resumed", scenario=fault.name, step=trainer.global_step)

    torch.manual_seed(0)
    module = recipe.GPT2Module()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1, every_n_train_steps=save_every)
    trainer = pl.Trainer(strategy=NNScalerStrategy(plan=plan), accelerator="cpu", devices=world, max_steps=steps,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Trained(), ckpt], use_distributed_sampler=False)
    trainer.fit(module, batches, ckpt_path="last")
    return trainer.strategy.pmodule.full_state_dict(rank0_only=True)


# -- Hugging Face ------------------------------------------------------------------------------------------------
def hf(root: str, plan: str, steps: int, save_every: int, fault: Fault) -> dict:
    from transformers import TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint

    import hf_trainer_llama as recipe
    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

    class Kill(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            fault.after_step(state.global_step)

    args = NNScalerTrainingArguments(output_dir=root, per_device_train_batch_size=BATCH, max_steps=steps,
                                     learning_rate=1e-2, lr_scheduler_type="constant", use_cpu=True, report_to=[],
                                     seed=0, dataloader_drop_last=True, disable_tqdm=True, save_strategy="steps",
                                     save_steps=save_every, logging_steps=1, ddp_backend="gloo", plan=plan)
    trainer = NNScalerTrainer(model=recipe.build_model("gpt2"), args=args, train_dataset=recipe.Tokens(64),
                              callbacks=[Kill()])
    last = get_last_checkpoint(root) if os.path.isdir(root) else None
    if last is not None and rank() == 0:
        say(event="resumed", scenario=fault.name, step=int(last.rsplit("-", 1)[1]))
    trainer.train(resume_from_checkpoint=True if last is not None else None)
    return trainer.nns_module.full_state_dict(rank0_only=True)


# -- DeepSpeed ---------------------------------------------------------------------------------------------------
def deepspeed_engine(root: str, plan: str, steps: int, save_every: int, fault: Fault) -> dict:
    from deepspeed_swap.train import RandomTokens, build_model

    from nnscaler_plugins.adapters import deepspeed

    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.0, "torch_adam": True}},
              "gradient_clipping": 1.0, "steps_per_print": 1000, "nnscaler": {"plan": plan}}
    model = build_model(128)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=RandomTokens(256, 16, 128))
    start = 0
    if os.path.exists(os.path.join(root, "latest")):
        _, client = engine.load_checkpoint(root)
        start = client["step"]
        if rank() == 0:
            say(event="resumed", scenario=fault.name, step=start)
    engine.train()
    batches = iter(loader)
    for _ in range(start):  # the batches the checkpointed steps saw
        next(batches)
    for step in range(start, steps):
        out = engine(**next(batches))
        engine.backward(out.loss)
        engine.step()
        fault.after_step(step + 1)
        if (step + 1) % save_every == 0:
            engine.save_checkpoint(root, tag=f"step{step + 1}", client_state={"step": step + 1})
    state = engine.module_state_dict()  # collective: the whole weights, on rank 0 for the file
    return state if rank() == 0 else {}


RUN = {"lightning": lightning, "hf": hf, "deepspeed": deepspeed_engine}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--adapters", required=True, help="ADAPTER:PLAN,... (lightning, hf, deepspeed)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch.distributed as dist

    for item in args.adapters.split(","):
        adapter, plan = item.split(":")
        for kind in ("ref", "kill"):
            name = f"{adapter}-{plan}-{kind}"
            out = os.path.join(args.work, f"{name}.pt")
            if os.path.exists(out):
                continue
            fault = Fault(args.work, name, args.seed, args.steps, args.save_every, kill=kind == "kill")
            state = RUN[adapter](os.path.join(args.work, name), plan, args.steps, args.save_every, fault)
            if rank() == 0:
                torch.save(state, out)
                say(event="finished", scenario=name)
            if dist.is_initialized():
                dist.barrier()


if __name__ == "__main__":
    main()
