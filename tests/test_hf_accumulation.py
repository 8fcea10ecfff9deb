"""Gradient accumulation under `NNScalerTrainer` gives the plain Trainer's update whatever the plan.

Two kinds of model, 2 batches accumulated, 3 SGD steps (no clipping), on 2 gloo processes, each
against a plain single-process `transformers.Trainer` on the same global batches:

- `count`: a GPT-2 LM whose loss divides its summed token losses by the Trainer's
  `num_items_in_batch`: the update is the window's mean, so it also equals one step on the window's
  rows without accumulation.
- `mean`: a BERT sequence classifier, whose head takes `**kwargs` but returns the batch's plain
  mean: the plain Trainer then steps with the sum of the window's means (transformers counts the
  loss as already scaled for accumulation), and so must the planned one, with one warning naming
  the model class.

Weights after the steps, the logged losses and gradient norms are compared. By default dp and tp,
the LM at per-device batch 2 and the classifier at 1; NNS_TEST_ALL_PLANS=1 runs both kinds at both
sizes and adds hybrid, zero1-3 and a pipeline.

In one process: the mean of the means when the Trainer subclass (`loss_is_scaled_for_ga = False`)
or the model (`accepts_loss_kwargs = False`) says so; how the count is read off a model (without
moving a random stream, the model's mode or its weights' requires_grad); the refusal of losses the
Trainer would compute itself.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import models

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_adapters_any_shape import collator as any_shape_collator, launched  # noqa: E402  (the launcher's environment)

CLASSES = 3
STEPS, ACCUMULATE = 3, 2
DEFAULT_PLANS = [("dp", {}), ("tp", {})]


def long_plans(batch: int) -> list:
    """The plans NNS_TEST_ALL_PLANS=1 adds (a pipeline's micro-batches are at most the batch's rows)."""
    return [("hybrid", {"tp": 1, "dp": 2}), ("zero1", {}), ("zero2", {}), ("zero3", {}),
            ("1f1b", {"pp": 2, "micro_batches": min(batch, 2)})]


IGNORES_COUNT = "ignores num_items_in_batch"


@pytest.fixture(scope="module")
def workers():
    """The module's own: accelerate keeps process-wide state the session's shared workers must not inherit."""
    from harness import Workers

    with Workers(2) as w:
        yield w


class Rows(torch.utils.data.Dataset):
    """Token lists of 4 to 12 tokens (never the pad id), each with a class label for `mean`."""

    def __init__(self, n: int, kind: str):
        g = torch.Generator().manual_seed(3)
        self.kind = kind
        self.rows = [torch.randint(1, models.VOCAB, (int(torch.randint(4, 13, (), generator=g)),), generator=g).tolist()
                     for _ in range(n)]
        self.labels = torch.randint(0, CLASSES, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        if self.kind == "mean":
            return {"input_ids": self.rows[i], "labels": self.labels[i]}
        return {"input_ids": self.rows[i]}


def collator(kind: str):
    """The padding collator for the classifier ("mean"), the causal-LM one otherwise."""
    return any_shape_collator("padding" if kind == "mean" else "lm")


def model_of(kind: str) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "mean":
        cfg = transformers.BertConfig(vocab_size=models.VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      num_labels=CLASSES, pad_token_id=0)
        return transformers.BertForSequenceClassification(cfg)
    cfg = models.gpt2_small()[0].config
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def arguments(out: str, batch: int, accumulate: int, plan=None, options=None):
    common = dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
                  max_steps=STEPS, logging_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
                  max_grad_norm=1e9, use_cpu=True, report_to=[], seed=0, dataloader_drop_last=True,
                  disable_tqdm=True, save_strategy="no")
    if plan is None:
        from transformers import TrainingArguments

        return TrainingArguments(**common)
    from nnscaler_plugins.adapters.hf import NNScalerTrainingArguments

    return NNScalerTrainingArguments(**common, ddp_backend="gloo", plan=plan, plan_options=options or {})


def rows_for(batch: int, dp: int) -> int:
    return batch * dp * ACCUMULATE * STEPS


def logged(trainer) -> dict:
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in history], "grad_norm": [float(h["grad_norm"]) for h in history]}


def planned_runs(rank: int, world: int, kind: str, batch: int, plans: list, out: str) -> dict:
    from nnscaler_plugins.adapters.hf import NNScalerTrainer

    found = {}
    for plan, options in plans:
        with launched(rank, world), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dp = 1 if plan in ("tp", "1f1b") or options.get("dp") == 1 else world
            trainer = NNScalerTrainer(model=model_of(kind), args=arguments(os.path.join(out, plan), batch, ACCUMULATE,
                                                                           plan, options),
                                      train_dataset=Rows(rows_for(batch, dp), kind), data_collator=collator(kind))
            trainer.train()
            weights = trainer.nns_module.full_state_dict()
            found[plan] = {"dp": trainer.nns_module.dp_size, **logged(trainer),
                           "weights": weights if rank == 0 else None,
                           "warnings": [str(w.message) for w in caught if IGNORES_COUNT in str(w.message)]}
    return found


def plain_run(kind: str, batch: int, dp: int, accumulate: int, out: str) -> dict:
    from transformers import Trainer

    per_device = batch * dp * ACCUMULATE // accumulate
    trainer = Trainer(model=model_of(kind), args=arguments(out, per_device, accumulate),
                      train_dataset=Rows(rows_for(batch, dp), kind), data_collator=collator(kind))
    trainer.train()
    return {**logged(trainer), "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def differences(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    bad = []
    for key in ("loss", "grad_norm"):
        if len(got[key]) != len(want[key]) or any(abs(a - b) > rtol * abs(b) + atol
                                                   for a, b in zip(got[key], want[key])):
            bad.append(f"{key}: {got[key]} vs {want[key]}")
    shared = set(got["weights"]) & set(want["weights"])
    assert len(shared) >= len(want["weights"]) - 2, sorted(set(want["weights"]) - shared)
    for name in sorted(shared):
        a, b = got["weights"][name].float(), want["weights"][name].float()
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            bad.append(f"{name}: max difference {(a - b).abs().max().item():.3g}")
    return bad


ALL_PLANS = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
_LONG = pytest.mark.skipif(not ALL_PLANS, reason="the other batch size of each kind runs by default; "
                                                  "NNS_TEST_ALL_PLANS=1 runs it")


@pytest.mark.parametrize("kind, batch", [("count", 2), ("mean", 1), pytest.param("count", 1, marks=_LONG),
                                         pytest.param("mean", 2, marks=_LONG)])
def test_accumulation_equals_the_plain_trainer_under_every_plan(workers, tmp_path, kind, batch):
    plans = DEFAULT_PLANS + (long_plans(batch) if ALL_PLANS else [])
    runs = workers.run(planned_runs, kind, batch, plans, str(tmp_path), timeout=900)
    refs = {dp: plain_run(kind, batch, dp, ACCUMULATE, str(tmp_path / f"ref{dp}"))
            for dp in {r["dp"] for r in runs[0].values()}}
    assert list(runs[0]) == [plan for plan, _ in plans]
    problems = {plan: differences(r, refs[r["dp"]])[:6] for plan, r in runs[0].items()}
    failing = [plan for plan, bad in problems.items() if bad]
    assert not failing, f"{failing} differ from the plain Trainer: " + "; ".join(
        f"{plan}: {problems[plan]}" for plan in failing)
    for plan in runs[0]:  # one warning per run and rank for the model that ignores the count, none else
        for rank_runs in runs:
            told = rank_runs[plan]["warnings"]
            if kind == "mean":
                assert len(told) == 1 and "BertForSequenceClassification" in told[0], (plan, told)
            else:
                assert not told, (plan, told)
    if kind == "count":  # the model divides by the window's count: accumulating is one step on the window's rows
        for dp, ref in refs.items():
            whole = plain_run(kind, batch, dp, 1, str(tmp_path / f"whole{dp}"))
            assert not differences(ref, whole, rtol=1e-4, atol=1e-5), (dp, differences(ref, whole, 1e-4, 1e-5))


class _Head(torch.nn.Module):
    """A regression head whose loss uses the count as `use` says; it draws dropout in training mode."""

    def __init__(self, use: str):
        super().__init__()
        self.use, self.proj, self.drop = use, torch.nn.Linear(4, 1), torch.nn.Dropout(0.5)

    def forward(self, x, labels=None, **kwargs):
        err = (self.proj(self.drop(x)).squeeze(-1) - labels) ** 2
        count = kwargs.get("num_items_in_batch")
        if self.use == "divides":
            return {"loss": err.sum() / count}
        if self.use == "squares":
            return {"loss": err.sum() / count ** 2}
        return {"loss": err.mean()}


def test_how_the_loss_uses_the_count_is_read_without_moving_a_random_stream_or_the_model():
    from nnscaler_plugins.adapters.hf_loss_count import CountUse, LossCountError, count_use

    batch = {"x": torch.randn(3, 4), "labels": torch.randn(3)}
    for use, found in (("divides", CountUse.DIVIDES), ("ignores", CountUse.IGNORES)):
        model = _Head(use).train()
        model.proj.bias.requires_grad_(False)
        state = torch.get_rng_state()
        assert count_use(model, batch) is found, use
        assert torch.equal(state, torch.get_rng_state()), f"{use}: the probe moved the global random stream"
        assert model.training and model.proj.weight.requires_grad and not model.proj.bias.requires_grad
        assert model.proj.weight.grad is None
    with pytest.raises(LossCountError, match=r"_Head: its loss depends on num_items_in_batch other than as a sum"):
        count_use(_Head("squares"), batch)
    with torch.device("meta"):  # no values: whether the count reaches the loss, not how
        assert count_use(_Head("ignores"), batch) is CountUse.IGNORES
        assert count_use(_Head("divides"), batch) is CountUse.READS


@pytest.mark.parametrize("extra", ["label_smoothing_factor", "compute_loss_func"])
def test_a_loss_the_trainer_would_compute_itself_is_refused_by_name(tmp_path, extra):
    """The planned step back-propagates the model's own loss: label smoothing or a compute_loss_func
    would be left out of the update, so training is refused before anything runs."""
    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

    def my_loss(outputs, labels, num_items_in_batch=None):
        return outputs.loss

    smoothing = 0.1 if extra == "label_smoothing_factor" else 0.0
    args = NNScalerTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], plan="dp", max_steps=1,
                                     per_device_train_batch_size=2, label_smoothing_factor=smoothing)
    kwargs = {"compute_loss_func": my_loss} if extra == "compute_loss_func" else {}
    trainer = NNScalerTrainer(model=model_of("mean"), args=args, train_dataset=Rows(8, "mean"),
                              data_collator=collator("mean"), **kwargs)
    match = "label_smoothing_factor=0.1" if smoothing else "compute_loss_func='my_loss'"
    with pytest.raises(NotImplementedError, match=match + ".* the planned step does not do"):
        trainer.train()


@pytest.mark.parametrize("how", ["loss_is_scaled_for_ga", "accepts_loss_kwargs"])
def test_the_mean_of_the_means_when_the_trainer_or_the_model_says_so(tmp_path, how):
    """A Trainer subclass with `loss_is_scaled_for_ga = False`, or a model with `accepts_loss_kwargs =
    False` (what the warning advises), makes transformers divide each batch's mean by the window's
    batches: one process, against the plain Trainer with the same setting, weights compared."""
    from transformers import Trainer, TrainingArguments

    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments

    class Plain(Trainer):
        loss_is_scaled_for_ga = False if how == "loss_is_scaled_for_ga" else None

    class Planned(NNScalerTrainer):
        loss_is_scaled_for_ga = Plain.loss_is_scaled_for_ga

    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATE, max_steps=2,
                  logging_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9,
                  use_cpu=True, report_to=[], seed=0, disable_tqdm=True, save_strategy="no")
    runs = {}
    for name, cls, args in (("plain", Plain, TrainingArguments(output_dir=str(tmp_path / "plain"), **common)),
                            ("planned", Planned, NNScalerTrainingArguments(output_dir=str(tmp_path / "planned"),
                                                                           plan="dp", **common))):
        model = model_of("mean")
        if how == "accepts_loss_kwargs":
            model.accepts_loss_kwargs = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = cls(model=model, args=args, train_dataset=Rows(8, "mean"), data_collator=collator("mean"))
            trainer.train()
        weights = trainer.nns_module.full_state_dict() if name == "planned" else trainer.model.state_dict()
        runs[name] = {**logged(trainer), "weights": {k: v.detach().clone() for k, v in weights.items()},
                      "told": [str(w.message) for w in caught if IGNORES_COUNT in str(w.message)]}
    assert not differences(runs["planned"], runs["plain"]), differences(runs["planned"], runs["plain"])
    # the count still reaches the model when only the Trainer's scaling is changed: it is said
    assert len(runs["planned"]["told"]) == (1 if how == "loss_is_scaled_for_ga" else 0), runs["planned"]["told"]
