"""A Seq2SeqTrainer job on a tiny T5 (built from a `T5Config`, a word-level tokenizer made here: no hub),
under the plain `Seq2SeqTrainer` or `NNScalerSeq2SeqTrainer` with a plan:

    torchrun --nproc_per_node 1 tests/hf_seq2seq_job.py OUT plain
    torchrun --nproc_per_node 2 tests/hf_seq2seq_job.py OUT dp      # or tp

The global batch is 4 rows whatever the plan (2 per process under dp). It trains 3 SGD steps on
sources and targets of varying lengths (`DataCollatorForSeq2Seq` pads each batch), then evaluates and
predicts with `predict_with_generate`; rank 0 writes the logged losses, the eval loss, a checksum of
the ids `evaluate` generated and the ids `predict` generated to OUT as JSON."""
from __future__ import annotations

import json
import os
import sys

import torch

VOCAB, PAD, EOS, GLOBAL_BATCH = 24, 0, 1, 4


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "</s>": EOS} | {f"w{i}": i for i in range(2, VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w2")), pad_token="<pad>",
                                   eos_token="</s>")


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=PAD, tie_word_embeddings=False))


class Pairs(torch.utils.data.Dataset):
    """Source rows of 3 to 8 tokens, targets of 2 to 5 (their tokens reversed, cut), each ending in EOS."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            src = torch.randint(2, VOCAB, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
            tgt = list(reversed(src))[:int(torch.randint(2, 6, (), generator=g))]
            self.rows.append({"input_ids": src + [EOS], "labels": tgt + [EOS]})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return dict(self.rows[i])


def checksum(ids) -> float:
    """The generated ids in one number that any change of one id moves."""
    t = torch.as_tensor(ids, dtype=torch.float64)
    return float((t * torch.arange(1, t.numel() + 1, dtype=torch.float64).reshape(t.shape)).sum())


def main(out: str, plan: str) -> None:
    from transformers import DataCollatorForSeq2Seq

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = GLOBAL_BATCH // world if plan in ("plain", "dp") else GLOBAL_BATCH
    model = tiny_t5()
    found: dict = {}

    def compute_metrics(p) -> dict:
        found["evaluate_ids"] = checksum(p.predictions)
        return {"generated": found["evaluate_ids"]}

    common = dict(output_dir=os.path.join(os.path.dirname(out), "run_" + plan), per_device_train_batch_size=per_device,
                  per_device_eval_batch_size=per_device, max_steps=3, learning_rate=0.5, optim="sgd", use_cpu=True,
                  ddp_backend="gloo", report_to=[], logging_steps=1, save_strategy="no", lr_scheduler_type="constant",
                  seed=0, predict_with_generate=True, generation_max_length=7)
    kwargs = dict(model=model, train_dataset=Pairs(12, 1), eval_dataset=Pairs(8, 2), processing_class=tokenizer(),
                  data_collator=DataCollatorForSeq2Seq(tokenizer(), model=model), compute_metrics=compute_metrics)
    if plan == "plain":
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

        trainer = Seq2SeqTrainer(args=Seq2SeqTrainingArguments(**common), **kwargs)
    else:
        from nnscaler_plugins.adapters.hf import NNScalerSeq2SeqTrainer, NNScalerSeq2SeqTrainingArguments

        trainer = NNScalerSeq2SeqTrainer(args=NNScalerSeq2SeqTrainingArguments(plan=plan, **common), **kwargs)
    trainer.train()
    metrics = trainer.evaluate()
    predicted = trainer.predict(Pairs(8, 3))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                       "eval_loss": metrics["eval_loss"], "evaluate_ids": found["evaluate_ids"],
                       "predict_ids": predicted.predictions.tolist(), "predict_loss": predicted.metrics["test_loss"]},
                      f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    import torch.distributed

    if torch.distributed.is_initialized():  # the Trainer leaves its group open; gloo's threads then abort at exit
        torch.distributed.destroy_process_group()
