"""A Hugging Face Trainer job on a model capture cannot take (tests/eager_models.py's masked-LM head
selecting tokens with nonzero), under the plain Trainer or NNScalerTrainer with a plan:

    torchrun --nproc_per_node 2 tests/hf_eager_job.py OUT PLAN      # PLAN: plain, dp, zero3, ...

Rank 0 writes the logged losses to OUT as JSON."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eager_models  # noqa: E402


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        torch.manual_seed(0)
        self.batch = eager_models.build_masked_lm()[1]

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.batch.items()}


class WithLoss(torch.nn.Module):
    """The head as the Trainer takes models: a dict with the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = eager_models.MaskedLMHead()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": self.head(input_ids, labels)}


def main(out: str, plan: str) -> None:
    from transformers import Trainer, TrainingArguments

    common = dict(output_dir=os.path.join(os.path.dirname(out), "run_" + plan), per_device_train_batch_size=2,
                  max_steps=3, learning_rate=0.05, optim="sgd", use_cpu=True, ddp_backend="gloo", report_to=[],
                  logging_steps=1, save_strategy="no", lr_scheduler_type="constant", seed=0)
    if plan == "plain":
        trainer = Trainer(model=WithLoss(), args=TrainingArguments(**common), train_dataset=Rows())
    else:
        from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

        trainer = NNScalerTrainer(model=WithLoss(), args=NNScalerTrainingArguments(plan=plan, **common),
                                  train_dataset=Rows())
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        executor = trainer.nns_module.plan.knobs.executor if plan != "plain" else ""
        with open(out, "w") as f:
            json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                       "executor": executor}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    import torch.distributed

    if torch.distributed.is_initialized():  # the Trainer leaves its group open; gloo's threads then abort at exit
        torch.distributed.destroy_process_group()
