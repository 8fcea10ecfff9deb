#!/usr/bin/env python
"""Fine-tune a causal language model with the Hugging Face Trainer, written the way transformers'
examples/pytorch/language-modeling/run_clm.py is written (argument dataclasses, `HfArgumentParser`,
`group_texts`, `Trainer` + `TrainingArguments`), but offline: the model is built from a small config
made in code (no hub download) and the corpus is synthetic token ids held in memory.

    python tests/run_clm_offline.py --output_dir out --do_train --per_device_train_batch_size 8 --use_cpu
    torchrun --nproc-per-node 2 tests/run_clm_offline.py --output_dir out --do_train ...
    python tests/run_clm_offline.py args.json       # every argument from one JSON file

It is a user's script, so it imports the plain `Trainer` and `TrainingArguments`; tests/test_hf_example.py
runs a copy in which only those two imported names are swapped for the adapter's classes.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)

# Small configs of a few model families, so that nothing is downloaded; --config_overrides changes them.
TINY_CONFIGS = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
}


@dataclass
class ModelArguments:
    """Arguments pertaining to which model/config we are going to train from scratch."""

    model_type: str = field(default="llama", metadata={"help": "one of: " + ", ".join(TINY_CONFIGS)})
    config_overrides: Optional[str] = field(
        default=None,
        metadata={"help": "Override some existing default config settings when a model is trained from scratch. "
                          "Example: n_embd=10,resid_pdrop=0.2,scale_attn_weights=false,summary_type=cls_index"},
    )
    vocab_size: int = field(default=128, metadata={"help": "Size of the synthetic vocabulary."})


@dataclass
class DataTrainingArguments:
    """Arguments pertaining to what data we are going to input our model for training and eval."""

    num_documents: int = field(default=96, metadata={"help": "Synthetic documents in the corpus."})
    corpus_seed: int = field(default=1234, metadata={"help": "Seed of the synthetic corpus."})
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "For debugging purposes or quicker training, truncate the number of "
                                        "training examples to this value if set."})
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "For debugging purposes or quicker training, truncate the number of "
                                        "evaluation examples to this value if set."})
    block_size: int = field(default=16, metadata={"help": "Training inputs are cut into blocks of this size."})
    validation_split_percentage: int = field(
        default=10, metadata={"help": "The percentage of the blocks used as validation set."})


class ListDataset(torch.utils.data.Dataset):
    """Rows as dicts, what `datasets.Dataset.map(group_texts)` hands the Trainer."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def select(self, indices) -> "ListDataset":
        return ListDataset([self.rows[i] for i in indices])


def synthetic_corpus(num_documents: int, vocab_size: int, seed: int) -> list[dict]:
    """Tokenized documents of varied lengths (what `tokenize_function` returns for a text corpus)."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(num_documents):
        n = int(torch.randint(4, 40, (1,), generator=g))
        ids = torch.randint(1, vocab_size, (n,), generator=g).tolist()
        docs.append({"input_ids": ids, "attention_mask": [1] * n})
    return docs


def group_texts(examples: list[dict], block_size: int) -> list[dict]:
    """Concatenate all texts and cut them in chunks of block_size, dropping the small remainder."""
    concatenated = {k: list(chain(*[e[k] for e in examples])) for k in examples[0]}
    total_length = len(concatenated["input_ids"])
    total_length = (total_length // block_size) * block_size
    rows = []
    for i in range(0, total_length, block_size):
        row = {k: torch.tensor(t[i: i + block_size]) for k, t in concatenated.items()}
        row["labels"] = row["input_ids"].clone()
        rows.append(row)
    return rows


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        # If we pass only one argument to the script and it's the path to a json file, let's parse it.
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    elif len(sys.argv) == 2 and sys.argv[1].endswith((".yaml", ".yml")):
        model_args, data_args, training_args = parser.parse_yaml_file(os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    # Setup logging
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        # The default of training_args.log_level is passive, so we set log level at info here to have that default.
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()

    logger.warning(
        f"Process rank: {training_args.process_index}, device: {training_args.device}, n_gpu: {training_args.n_gpu}, "
        f"distributed training: {training_args.parallel_mode.value == 'distributed'}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    # Detecting last checkpoint.
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    # Set seed before initializing model.
    set_seed(training_args.seed)

    # The corpus, "tokenized", grouped into blocks and split like run_clm's validation_split_percentage.
    tokenized = synthetic_corpus(data_args.num_documents, model_args.vocab_size, data_args.corpus_seed)
    with training_args.main_process_first(desc="grouping texts together"):
        blocks = group_texts(tokenized, data_args.block_size)
    n_eval = len(blocks) * data_args.validation_split_percentage // 100
    train_dataset, eval_dataset = ListDataset(blocks[n_eval:]), ListDataset(blocks[:n_eval])
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    config = CONFIG_MAPPING[model_args.model_type](**TINY_CONFIGS[model_args.model_type],
                                                   vocab_size=model_args.vocab_size)
    if model_args.config_overrides is not None:
        logger.info(f"Overriding config: {model_args.config_overrides}")
        config.update_from_string(model_args.config_overrides)
        logger.info(f"New config: {config}")
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    # Initialize our Trainer
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        data_collator=default_data_collator,
    )

    # Training
    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # Saves the model too for easy upload

        metrics = train_result.metrics
        max_train_samples = (
            data_args.max_train_samples if data_args.max_train_samples is not None else len(train_dataset)
        )
        metrics["train_samples"] = min(max_train_samples, len(train_dataset))

        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    # Evaluation
    if training_args.do_eval:
        logger.info("*** Evaluate ***")

        metrics = trainer.evaluate()

        max_eval_samples = data_args.max_eval_samples if data_args.max_eval_samples is not None else len(eval_dataset)
        metrics["eval_samples"] = min(max_eval_samples, len(eval_dataset))
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity

        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
