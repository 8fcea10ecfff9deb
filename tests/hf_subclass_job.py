"""A Trainer subclass with its own `compute_loss` (as TRL's SFTTrainer has: it logs a metric read off
the model's outputs) on a tiny GPT-2 LM, under the plain subclass or the subclass with
`NNScalerTrainerMixin` and a plan:

    torchrun --nproc_per_node 1 tests/hf_subclass_job.py OUT plain
    torchrun --nproc_per_node 2 tests/hf_subclass_job.py OUT dp            # or tp
    torchrun --nproc_per_node 2 tests/hf_subclass_job.py OUT dp-changed    # its compute_loss returns loss * 1.0

Rows of 4 to 12 tokens padded per batch, a global batch of 4 rows, 2 batches accumulated, 3 SGD steps.
Rank 0 writes the logged losses, the metric the override recorded at each call (token accuracy,
counted over every process), the count it was given, and the weights' checksum to OUT as JSON; for
`-changed`, the refusal's message."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

VOCAB, PAD, GLOBAL_BATCH = 32, 0, 4


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": PAD} | {f"t{i}": i for i in range(1, VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="[PAD]")


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(5)
        self.rows = [torch.randint(1, VOCAB, (int(torch.randint(4, 13, (), generator=g)),), generator=g).tolist()
                     for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def recording_trainer(changed: bool):
    from transformers import Trainer

    class Recording(Trainer):
        """Records the token accuracy of each training batch (summed over processes) and its count."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            if self.model.training:
                labels = inputs["labels"][:, 1:]
                mask = labels != -100
                hits = (outputs.logits[:, :-1].argmax(-1) == labels) & mask
                t = torch.stack([hits.sum(), mask.sum()]).double()
                if dist.is_initialized():
                    dist.all_reduce(t)
                self.recorded.append({"accuracy": float(t[0] / t[1]),
                                      "count": None if num_items_in_batch is None else float(num_items_in_batch)})
            if changed:
                loss = loss * 1.0
            return (loss, outputs) if return_outputs else loss

    return Recording


def main(out: str, plan: str) -> None:
    from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, TrainingArguments

    changed = plan.endswith("-changed")
    plan = plan.removesuffix("-changed")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD))
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(out), "run_" + plan),
                             per_device_train_batch_size=GLOBAL_BATCH // world if plan in ("plain", "dp") else
                             GLOBAL_BATCH, gradient_accumulation_steps=2, max_steps=3, learning_rate=0.5, optim="sgd",
                             use_cpu=True, ddp_backend="gloo", report_to=[], logging_steps=1, save_strategy="no",
                             lr_scheduler_type="constant", seed=0)
    cls = recording_trainer(changed)
    kwargs = dict(model=model, args=args, train_dataset=Rows(24),
                  data_collator=DataCollatorForLanguageModeling(tokenizer(), mlm=False))
    if plan == "plain":
        trainer = cls(**kwargs)
    else:
        from nnscaler_plugins.adapters.hf import NNScalerTrainerMixin

        class Planned(NNScalerTrainerMixin, cls):  # the documented one line
            pass

        trainer = Planned(plan=plan, **kwargs)
    trainer.recorded = []
    result: dict = {}
    try:
        trainer.train()
    except NotImplementedError as e:
        result["refused"] = str(e)
    else:
        trainer.save_model(os.path.join(os.path.dirname(out), "final_" + plan))  # the trained weights, whole
        result.update(losses=[h["loss"] for h in trainer.state.log_history if "loss" in h], recorded=trainer.recorded,
                      weights=float(sum(p.detach().double().sum() for p in model.parameters())))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    import torch.distributed

    if torch.distributed.is_initialized():  # the Trainer leaves its group open; gloo's threads then abort at exit
        torch.distributed.destroy_process_group()
