"""A DeepSpeed training script for a small GPT-2; only its import line is this project's.

    python recipes/deepspeed_swap/train.py --deepspeed_config recipes/deepspeed_swap/ds_config.json
    torchrun --nproc_per_node 2 recipes/deepspeed_swap/train.py --deepspeed_config recipes/deepspeed_swap/ds_config.json
    deepspeed --num_accelerators 2 recipes/deepspeed_swap/train.py --deepspeed_config ...

Swap the import for `import deepspeed` and the same file runs under DeepSpeed with the same losses
(tests/test_deepspeed_side_by_side.py does exactly that). Add `"nnscaler": {"plan": "tp"}` to the
config to train it tensor-parallel instead of data-parallel.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from nnscaler_plugins.adapters import deepspeed


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences: the same data on every rank and under every engine."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(vocab: int, seed: int = 0) -> torch.nn.Module:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=32, use_cache=False,
                     bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)

    model = build_model(args.vocab)
    data = RandomTokens(256, args.seq, args.vocab)
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters(),
                                                                training_data=data)
    engine.train()
    losses = []
    batches = iter(loader)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        batch = next(batches)
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    result = {"losses": losses, "lr": engine.get_lr(), "global_steps": engine.global_steps,
              "grad_norm": engine.get_global_grad_norm()}
    if engine.global_rank == 0 and argv is None:
        print(json.dumps(result))
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"losses": losses})
    return result


if __name__ == "__main__":
    main()
