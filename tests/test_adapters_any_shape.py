"""The framework adapters on batches of any shape: per-batch padding, a last smaller batch, replicas
holding different numbers of label tokens; each against its own single-process run.

- Hugging Face Trainer (`NNScalerTrainer`), with `DataCollatorWithPadding` (a sequence classifier)
  and `DataCollatorForLanguageModeling(mlm=False)` (a causal LM, with gradient accumulation), under
  dp, tp, 1f1b and zero3 on 2 processes (the classifier under dp and tp unless NNS_TEST_ALL_PLANS=1), against a plain single-process `Trainer` on the same
  global batch: the logged losses agree to relative 1e-5 (SGD), `num_items_in_batch` weighting
  included.
- Lightning (`NNScalerStrategy`) with a collate function that pads per batch, and the DeepSpeed
  drop-in with a variable-length loader whose last batch is smaller: both call forward and backward
  themselves; losses and weights against one process training the same global batches eagerly.

The frameworks run inside this module's own 2 worker processes (the environment variables a
launcher would set are set around each run; the process group is the workers'): accelerate and
Lightning keep process-wide state, which the session's shared workers must not inherit.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import models

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PAD = 0
CLASSES = 3


@pytest.fixture(scope="module")
def workers():
    from harness import Workers

    with Workers(2) as w:
        yield w


# -- data ----------------------------------------------------------------------------------------------
class Texts(torch.utils.data.Dataset):
    """Token lists of 5 to 16 tokens (never the pad id), with a class label when `classes`."""

    def __init__(self, n: int, classes: int = 0, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(1, models.VOCAB, (int(torch.randint(5, 17, (), generator=g)),), generator=g).tolist()
                     for _ in range(n)]
        self.labels = torch.randint(0, max(classes, 1), (n,), generator=g).tolist() if classes else None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.rows[i]}
        if self.labels is not None:
            item["labels"] = self.labels[i]
        return item


def tokenizer():
    """A word-level tokenizer over the test vocabulary (no download): what the collators pad with."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": PAD} | {f"t{i}": i for i in range(1, models.VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="[PAD]")


def collator(kind: str):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    if kind == "padding":
        return DataCollatorWithPadding(tokenizer())
    return DataCollatorForLanguageModeling(tokenizer(), mlm=False)


def hf_model(kind: str) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = models.gpt2_small()[0].config  # without dropout: pieces of a batch would draw other masks
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    torch.manual_seed(0)
    if kind == "padding":
        cfg.num_labels, cfg.pad_token_id = CLASSES, PAD
        return transformers.GPT2ForSequenceClassification(cfg)
    return transformers.GPT2LMHeadModel(cfg)


@contextlib.contextmanager
def launched(rank: int, world: int):
    """The environment torchrun gives each process, around one framework run in a worker; the
    frameworks find the workers' process group already made and use it."""
    keys = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(ImportError):
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(True)


# -- Hugging Face Trainer ------------------------------------------------------------------------------
HF_PLANS = {"lm": [("dp", {}), ("tp", {}), ("1f1b", {"pp": 2, "micro_batches": 2}), ("zero3", {})],
            # For the suite's time, the classifier under one data-parallel and one tensor-parallel
            # plan; NNS_TEST_ALL_PLANS=1 runs it under all four.
            "padding": [("dp", {}), ("tp", {})]}
HF_BATCH, HF_STEPS = 4, 2  # per device and replica; optimizer steps


def hf_args(out: str, batch: int, kind: str, plan=None, options=None):
    common = dict(output_dir=out, per_device_train_batch_size=batch, max_steps=HF_STEPS, logging_steps=1,
                  learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1.0, use_cpu=True,
                  report_to=[], seed=0, dataloader_drop_last=True, disable_tqdm=True, save_strategy="no",
                  gradient_accumulation_steps=2 if kind == "lm" else 1)
    if plan is None:
        from transformers import TrainingArguments

        return TrainingArguments(**common)
    from nnscaler_plugins.adapters.hf import NNScalerTrainingArguments

    return NNScalerTrainingArguments(**common, ddp_backend="gloo", plan=plan, plan_options=options or {})


def hf_samples(kind: str, dp: int) -> int:
    return HF_BATCH * dp * HF_STEPS * (2 if kind == "lm" else 1)


def hf_under_plans(rank: int, world: int, kind: str, out: str) -> dict:
    from nnscaler_plugins.adapters.hf import NNScalerTrainer

    found = {}
    plans = HF_PLANS["lm"] if os.environ.get("NNS_TEST_ALL_PLANS") else HF_PLANS[kind]
    for plan, options in plans:
        with launched(rank, world):
            dp = 1 if plan in ("tp", "1f1b") else world
            trainer = NNScalerTrainer(model=hf_model(kind), args=hf_args(os.path.join(out, plan), HF_BATCH, kind,
                                                                          plan, options),
                                      train_dataset=Texts(hf_samples(kind, dp), CLASSES if kind == "padding" else 0),
                                      data_collator=collator(kind))
            trainer.train()
            pm = trainer.nns_module
            found[plan] = {"dp": pm.dp_size, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                           "programs_per_shape": len(pm.shape_programs.per_shape), "fit": pm.shape_programs.fit_failure}
    return found


def hf_reference(kind: str, dp: int, out: str) -> list[float]:
    from transformers import Trainer

    trainer = Trainer(model=hf_model(kind), args=hf_args(out, HF_BATCH * dp, kind),
                      train_dataset=Texts(hf_samples(kind, dp), CLASSES if kind == "padding" else 0),
                      data_collator=collator(kind))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(y), 1e-8) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["padding", "lm"])
def test_hf_trainer_with_padding_collators_equals_a_plain_trainer(workers, tmp_path, kind):
    """`padding`: DataCollatorWithPadding and a GPT-2 sequence classifier; `lm`:
    DataCollatorForLanguageModeling(mlm=False), padded label tokens ignored, 2 batches accumulated
    (the plain Trainer normalizes by the window's tokens, `num_items_in_batch`)."""
    runs = workers.run(hf_under_plans, kind, str(tmp_path))[0]
    refs = {dp: hf_reference(kind, dp, str(tmp_path / f"ref{dp}")) for dp in {r["dp"] for r in runs.values()}}
    for plan, r in runs.items():
        assert r["programs_per_shape"] == 0 and not r["fit"], (plan, r)
        assert _close(r["losses"], refs[r["dp"]]), (plan, r["losses"], refs[r["dp"]])


# -- Lightning and DeepSpeed: forward + backward by the framework ---------------------------------------
PIPELINE = {"pp": 2, "micro_batches": 2}
LOOP_BATCH, LOOP_STEPS = 4, 3  # per replica; the last step's batch is one sample short on each replica
LOOP_SAMPLES = 2 * LOOP_BATCH * LOOP_STEPS - 2


def pad_batch(items: list[dict]) -> dict:
    """A collate function that pads to the batch's longest row (labels -100 there)."""
    longest = max(len(i["input_ids"]) for i in items)
    ids = torch.full((len(items), longest), PAD)
    mask = torch.zeros((len(items), longest), dtype=torch.long)
    for r, i in enumerate(items):
        ids[r, :len(i["input_ids"])] = torch.tensor(i["input_ids"])
        mask[r, :len(i["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def eager_reference(order: list[int], rows: int) -> tuple[list[float], dict]:
    """One process on the global batches: `rows` samples of `order` per step, padded together."""
    data = Texts(LOOP_SAMPLES)
    model = hf_model("lm")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for start in range(0, len(order), rows):
        loss = model(**pad_batch([data[i] for i in order[start:start + rows]])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _compare(losses: list[float], full: dict, reference: tuple[list[float], dict]) -> list[str]:
    ref_losses, ref_state = reference
    problems = [] if _close(losses, ref_losses) else [f"losses {losses} vs {ref_losses}"]
    problems += [f"{k} max abs diff {(full[k] - t).abs().max():.3g}" for k, t in ref_state.items()
                 if k in full and not torch.allclose(full[k], t, rtol=1e-5, atol=1e-6)]
    return problems


def lightning_run(rank: int, world: int, plan: str, options: dict) -> list[str]:
    import lightning.pytorch as pl

    from nnscaler_plugins.adapters.lightning import NNScalerStrategy

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = hf_model("lm")
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = LM()
    loader = torch.utils.data.DataLoader(Texts(LOOP_SAMPLES), batch_size=LOOP_BATCH, collate_fn=pad_batch)
    with launched(rank, world):
        trainer = pl.Trainer(strategy=NNScalerStrategy(plan=plan, cache_dir="/tmp/nns_test_cache", **options),
                             accelerator="cpu", devices=world, max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, loader)
    pm = trainer.strategy.pmodule
    losses = torch.stack(module.losses)
    torch.distributed.all_reduce(losses)  # what self.log(..., sync_dist=True) reports: the mean over ranks
    dp = pm.dp_size
    # Lightning's sampler shuffles with seed 0 (even an unshuffled loader's) and deals round-robin to replicas.
    order = torch.randperm(LOOP_SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    problems = _compare((losses / world).tolist(), pm.full_state_dict(), eager_reference(order, LOOP_BATCH * dp))
    return [f"lightning {plan}: {p}" for p in problems] + [f"lightning {plan}: a program per shape"] * bool(
        pm.shape_programs.per_shape)


def test_lightning_with_per_batch_padding_trains_like_one_process(workers):
    """dp: replicas hold different label tokens and the last batch is smaller (the strategy weighs the
    loss training_step back-propagates); 1f1b: the same through whole steps."""
    problems = workers.run(lightning_run, "dp", {})[0] + workers.run(lightning_run, "1f1b", PIPELINE)[0]
    assert not problems, problems


def deepspeed_run(rank: int, world: int) -> list[str]:
    from nnscaler_plugins.adapters import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": LOOP_BATCH, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    data = Texts(LOOP_SAMPLES)
    engine, _, loader, _ = deepspeed.initialize(model=hf_model("lm"), config=cfg, training_data=data,
                                                collate_fn=pad_batch)
    losses = []
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    losses = torch.stack(losses)
    torch.distributed.all_reduce(losses)
    # DeepSpeed's sampler: one seeded permutation dealt round-robin to the replicas.
    order = torch.randperm(LOOP_SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    problems = _compare((losses / world).tolist(), engine.module_state_dict(), eager_reference(order, 2 * LOOP_BATCH))
    return [f"deepspeed: {p}" for p in problems]


def test_deepspeed_engine_with_a_variable_length_loader_trains_like_one_process(workers):
    problems = workers.run(deepspeed_run)[0]
    assert not problems, problems
