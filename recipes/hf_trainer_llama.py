"""Train small Llama and GPT-2 models with the Hugging Face Trainer under nnscaler-plugins plans.

    python recipes/hf_trainer_llama.py                       # llama, plans dp, tp, 1f1b on 2 gloo processes
    python recipes/hf_trainer_llama.py --nproc 4 --model gpt2 --plans "tp;1f1b:pp=2;auto"
    python recipes/hf_trainer_llama.py --resume-check        # save_model + resume_from_checkpoint checks
    python recipes/hf_trainer_llama.py --plans "zero3;zero2" --accumulate 2   # ZeRO plans, accumulation

The only change from an ordinary Trainer script is `NNScalerTrainer` and
`NNScalerTrainingArguments(plan=...)`. Run with plain `python`, the script first trains the same model
with a plain single-process `Trainer` on the global batch (per-device batch x data-parallel degree),
then starts itself under `torchrun --nproc-per-node N` and compares every plan's logged losses with
that run's (relative 1e-4 after AdamW steps of learning rate 1e-2). It prints one JSON line per check
and exits non-zero on a mismatch. Everything is offline: models come from configs, data is random.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from nnscaler_plugins.progress import Progress

SEQ, VOCAB = 16, 128
_MARK = "RESULT "  # the Trainer prints its own dicts; results are the lines with this prefix


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                       use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        # The first position is never predicted (labels shift by one); marking it -100 makes the Trainer's
        # token count (num_items_in_batch) equal the tokens the loss averages over, for every model class.
        labels = self.ids[i].clone()
        labels[0] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def StepProgress(label: str, steps: int):
    """A Trainer callback: one progress line per logged loss on the main process (to stderr; stdout
    carries the recipe's results). Made by a function so transformers is imported only when used."""
    from transformers import TrainerCallback

    class _StepProgress(TrainerCallback):
        bar = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                if self.bar is None:
                    self.bar = Progress(label, steps, stream=sys.stderr, delay_s=2.0)
                self.bar.step(note=f"loss {logs['loss']:.4f}")

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return _StepProgress()


def train(model_name: str, out: str, batch: int, steps: int, samples: int, plan=None, resume: str | None = None,
          save_steps: int = 0, max_grad_norm: float = 1.0, accumulate: int = 1):
    """One Trainer run; returns (trainer, per-step losses)."""
    from transformers import Trainer, TrainingArguments

    common = dict(output_dir=out, per_device_train_batch_size=batch, max_steps=steps, logging_steps=1,
                  learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=max_grad_norm, use_cpu=True,
                  report_to=[], seed=0, dataloader_drop_last=True, disable_tqdm=True,
                  save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                  gradient_accumulation_steps=accumulate)
    model = build_model(model_name)
    progress = [StepProgress(f"training {model_name}" + (f" under {plan}" if plan else ""), steps)]
    if plan is None:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=Tokens(samples),
                          callbacks=progress)
    else:
        from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

        name, options = parse_plan(plan)
        args = NNScalerTrainingArguments(**common, ddp_backend="gloo", plan=name, plan_options=options)
        trainer = NNScalerTrainer(model=model, args=args, train_dataset=Tokens(samples), callbacks=progress)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: every plan, then (rank 0) one JSON line each."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    for plan in args.plans.split(";"):
        trainer, losses = train(args.model, os.path.join(args.out, plan.replace(":", "_").replace("=", "")), args.batch_size, args.steps, args.samples,
                                plan=plan, accumulate=args.accumulate)
        pm = trainer.nns_module
        row = {"plan": plan, "model": args.model, "nproc": dist.get_world_size(), "dp": pm.dp_size, "losses": losses}
        if args.resume_check and plan == args.plans.split(";")[0]:
            ckpt_out = os.path.join(args.out, "resume-ckpt")
            _, full = train(args.model, ckpt_out, args.batch_size, args.steps, args.samples, plan=plan,
                            save_steps=args.steps // 2, accumulate=args.accumulate)
            trainer2, resumed = train(args.model, ckpt_out, args.batch_size, args.steps, args.samples, plan=plan,
                                      resume=os.path.join(ckpt_out, f"checkpoint-{args.steps // 2}"),
                                      accumulate=args.accumulate)
            final = os.path.join(args.out, "resume-final")
            trainer2.save_model(final)
            row.update(full=full, resumed=resumed, saved=final)
            for other in filter(None, args.resume_under.split(";")):  # the same checkpoint, another plan
                row.setdefault("under", {})[other] = train(
                    args.model, os.path.join(args.out, "resume-under-" + other.replace(":", "_")), args.batch_size,
                    args.steps, args.samples, plan=other, resume=os.path.join(ckpt_out, f"checkpoint-{args.steps // 2}"),
                    accumulate=args.accumulate)[1]
            state = trainer2.nns_module.full_state_dict()  # collective: every rank
            if rank == 0:
                torch.save(state, os.path.join(args.out, "resume-state.pt"))
        if rank == 0:
            print(_MARK + json.dumps(row), flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_plan(spec: str) -> tuple[str, dict]:
    """"1f1b:pp=2,micro_batches=2" -> ("1f1b", {"pp": 2, "micro_batches": 2}); plain names have no options."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, options


def _close(a: list, b: list, rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(y), 1e-8) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    ap.add_argument("--plans", default="dp;tp;1f1b",
                    help="';'-separated strategy names, each with options after ':' (e.g. '1f1b:pp=2;tp')")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="per data-parallel replica")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--resume-check", action="store_true", help="checkpoint half way, resume, save_model (first plan)")
    ap.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--resume-under", default="", help="';'-separated plans to resume the --resume-check "
                    "checkpoint under too (same data-parallel size: the optimizer state is resharded)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.samples = args.samples or args.batch_size * args.nproc * args.steps * args.accumulate
    if "RANK" in os.environ:
        worker(args)
        return 0

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--master-port", str(_free_port()), os.path.abspath(__file__), "--model", args.model, "--plans", args.plans,
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--out", out,
               "--samples", str(args.samples), "--accumulate", str(args.accumulate),
               "--resume-under", args.resume_under] + (["--resume-check"] if args.resume_check else [])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        rows = [json.loads(line[len(_MARK):]) for line in proc.stdout.splitlines() if line.startswith(_MARK)]
        if proc.returncode != 0 or not rows:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            return proc.returncode or 1
        references: dict[int, list] = {}
        for row in rows:
            dp = row["dp"]
            if dp not in references:
                references[dp] = train(args.model, os.path.join(out, f"ref{dp}"), args.batch_size * dp, args.steps,
                                       args.samples, accumulate=args.accumulate)[1]
            row["reference"] = references[dp]
            row["match"] = _close(row["losses"], references[dp], 1e-4)
            if "resumed" in row:
                half = args.steps // 2
                # the resumed run's history starts with the checkpoint's logged losses
                row["resume_match"] = _close(row["resumed"][-(args.steps - half):], row["full"][half:], 1e-5)
                from transformers import AutoModelForCausalLM

                loaded = AutoModelForCausalLM.from_pretrained(row["saved"]).state_dict()
                state = torch.load(os.path.join(out, "resume-state.pt"), weights_only=True)
                row["saved_identical"] = all(torch.equal(loaded[k], v) for k, v in state.items() if k in loaded) \
                    and set(loaded) <= set(state)
                ok &= row["resume_match"] and row["saved_identical"]
                for other, resumed in row.get("under", {}).items():  # another plan: the plans' tolerance
                    row.setdefault("under_match", {})[other] = _close(resumed[-(args.steps - half):],
                                                                      row["full"][half:], 1e-4)
                ok &= all(row.get("under_match", {}).values())
            ok &= row["match"]
            print(json.dumps({k: v for k, v in row.items() if k != "saved"}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
