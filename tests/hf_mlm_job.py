"""run_mlm.py's training in small: a tiny BERT masked LM, DataCollatorForLanguageModeling(mlm=True)
masking random tokens per batch, the plain Trainer or NNScalerTrainer with a plan:

    torchrun --nproc_per_node 2 tests/hf_mlm_job.py OUT PLAN      # PLAN: plain, dp, tp, ...

Rank 0 writes the logged losses to OUT as JSON. The collator draws from torch's generator: anything
that draws before training (reading an example batch through it) would mask other tokens."""
from __future__ import annotations

import json
import os
import sys

import torch

VOCAB, SEQ, ROWS = 64, 12, 16


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[MASK]": 1} | {f"t{i}": i for i in range(2, VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t2")), pad_token="[PAD]",
                                   mask_token="[MASK]")


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(4)
        self.ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def main(out: str, plan: str) -> None:
    from transformers import (BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer,
                              TrainingArguments)

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0))
    common = dict(output_dir=os.path.join(os.path.dirname(out), "run_" + plan), per_device_train_batch_size=4,
                  max_steps=3, learning_rate=0.1, optim="sgd", use_cpu=True, ddp_backend="gloo", report_to=[],
                  logging_steps=1, save_strategy="no", lr_scheduler_type="constant", seed=0)
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm=True, mlm_probability=0.3)
    if plan == "plain":
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=Rows(),
                          data_collator=collator)
    else:
        from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

        trainer = NNScalerTrainer(model=model, args=NNScalerTrainingArguments(plan=plan, **common),
                                  train_dataset=Rows(), data_collator=collator)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    import torch.distributed

    if torch.distributed.is_initialized():  # the Trainer leaves its group open; gloo's threads then abort at exit
        torch.distributed.destroy_process_group()
