"""Hugging Face Trainer with a plan: `NNScalerTrainer` and `NNScalerTrainingArguments(plan=...)`.

    from nnscaler_plugins.adapters.hf import NNScalerTrainer, NNScalerTrainingArguments
    args = NNScalerTrainingArguments(output_dir="out", plan="tp", use_cpu=True, ddp_backend="gloo", ...)
    NNScalerTrainer(model=model, args=args, train_dataset=data).train()      # under torchrun

    class MyTrainer(NNScalerTrainerMixin, SomeTrainerSubclass): ...           # any other Trainer
    MyTrainer(..., args=SomeArguments(...), plan="1f1b", plan_options={"micro_batches": 2})

`NNScalerSeq2SeqTrainer` and `NNScalerSeq2SeqTrainingArguments` are the same for `Seq2SeqTrainer`.

A script that reads its arguments with `HfArgumentParser` (every transformers example) needs only its
`Trainer` and `TrainingArguments` swapped for these classes: `--plan tp --plan_options '{"tp": 2}'`
then come from its command line (or its JSON / YAML argument file).

What changes against a plain Trainer, and why:
- The model is captured and parallelized on the first training batch, when the training dataloader
  is first asked for (later batches may have any size and length); accelerate never wraps it
  (`_wrap_model`).
- Batches are sharded by data-parallel replica, not by process: ranks of one replica (its tensor-
  parallel and pipeline devices) read the same batch. The order is accelerate's seedable sampler, so
  the global batch of every step is the one a single process would read. Everything the Trainer
  counts over processes counts replicas instead: its sampler's and dataloader workers' ranks, the
  total train batch size it logs (per replica x replicas x accumulation), the sample and step counts
  derived from it, and the input tokens seen.
- A training step runs the plan's `train_step` (forward and backward, micro-batches and pipeline
  schedules included), which weighs replicas by the loss's targets; each batch of an accumulation
  window is then weighed as transformers weighs it: its targets over the Trainer's
  `num_items_in_batch` for a model whose loss divides by that count, whole for one whose loss
  ignores it (found by running the model once, adapters/hf_loss_count.py, with a warning), 1/k
  when the Trainer passes no count. Losses and gradients are then a plain single-process Trainer's
  on the same global batches, its arithmetic included.
- Norm clipping uses the norm of the whole model, not of this rank's shards.
- A subclass's own `compute_loss` (TRL's, or one logging metrics) runs in every training step, calling
  the planned model's forward; the loss it returns must be that model's own loss output, which is then
  weighed as above (adapters/hf_custom_loss.py); another loss is refused by name.
- `evaluate` and `predict` read batches by replica too and keep each replica's outputs once; the loss
  is each batch's mean, as one process reports it. With `predict_with_generate` (Seq2SeqTrainer)
  generation runs on the original model, given the trained weights first (gathered from the shards). A plan that runs whole training steps (a pipeline,
  micro-batches) has no forward pass to evaluate with and refuses them by name.
- `save_model` gathers whole tensors (every rank calls it, as the Trainer does) and writes an ordinary
  `save_pretrained` directory; the original model object is kept up to date with the trained weights.
- A model too large for one process is built on the meta device (`model=` built under
  `torch.device("meta")`, or a `model_init` that builds it there): each rank makes only its shards,
  by the model's own initialization, then reads its pieces of `weights=` (a `save_pretrained`
  directory or an `nns.checkpoint` directory) when given; it stays on meta (not moved to a device),
  and `save_model` writes the trained weights from the shards.
- Checkpoints keep the Trainer's layout; the optimizer state is one file of whole tensors under
  parameter names (`optimizer.nnscaler.pt`), so `resume_from_checkpoint` works under any plan and
  process count (the state is cut again for the resuming plan, as `nns.checkpoint.load` does).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME

from nnscaler_plugins.plan.plan import Plan
from nnscaler_plugins.plan.source import resolve

from .plan_choice import PlanLike, check_plan, check_plan_options, check_training_state, session_for

OPTIMIZER_FILE = "optimizer.nnscaler.pt"  # the whole optimizer state (see adapters.resume), next to the weights


def _refuse_other_engines(plan: Any, deepspeed: Any, fsdp: Any, parallelism: Any = None) -> None:
    if plan is None:
        return
    if deepspeed:
        raise ValueError("NNScaler Trainer: plan= and deepspeed= cannot be combined: the plan already decides how "
                         "the model is split and its gradients reduced. Drop deepspeed= (our DeepSpeed drop-in, "
                         "nnscaler_plugins.adapters.deepspeed, reads DeepSpeed configs), or drop plan=")
    if fsdp:
        raise ValueError(f"NNScaler Trainer: plan= and fsdp={fsdp!r} cannot be combined: the plan already decides "
                         "how parameters are sharded. Drop fsdp= (ZeRO stages are plans: plan='zero3'), or drop plan=")
    if parallelism is not None:
        raise ValueError("NNScaler Trainer: plan= and parallelism_config= cannot be combined: the plan already decides "
                         "the tensor, context and data parallelism. Drop parallelism_config= (give the degrees as "
                         "plan_options, e.g. plan='tp', plan_options={'tp': 2}), or drop plan=")


def plan_options_from(value: Any, where: str) -> dict:
    """`plan_options` as a dict: a dict as given, None as {}, a JSON object string (how a command line
    gives it, as for TrainingArguments' own dict-valued fields: --plan_options '{"pp": 2}') parsed."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {value!r} is not valid JSON ({e}); give the strategy's options as a JSON "
                             """object, e.g. --plan_options '{"pp": 2, "micro_batches": 4}'""") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: {value!r} is not a JSON object; give the strategy's options by name, "
                             """e.g. --plan_options '{"tp": 2}'""")
        return parsed
    raise TypeError(f"{where}: expected a dict of the strategy's options (or its JSON text), got "
                    f"{type(value).__name__}")


@dataclass
class NNScalerTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the plan: a strategy name ("dp", "tp", "1f1b", "auto", ...), a Plan, a
    plan .json file or a callable `fn(builder, **options)`; `plan_options` go to the strategy.

    Both parse from a command line through `HfArgumentParser` like TrainingArguments' own fields
    (`--plan 1f1b --plan_options '{"pp": 2}'`), and from `parse_dict` / `parse_json_file` /
    `parse_yaml_file` (where `plan_options` is a mapping or its JSON text)."""

    # The types are written for HfArgumentParser as well as for readers: it reads a field typed
    # `X | str | None` as a string option (the way TrainingArguments types its dict-valued fields,
    # `dict | str | None`), so `str` must come second. In code any of the other types may be given.
    plan: Optional[Union[Plan, str, os.PathLike, Callable]] = field(
        default="dp", metadata={"help": "strategy name (dp, tp, 1f1b, zero3, auto, ...) or plan .json file"})
    plan_options: Optional[Union[dict, str]] = field(
        default_factory=dict, metadata={"help": "the strategy's options, as a JSON object on a command line: "
                                                """'{"tp": 2}', '{"pp": 2, "micro_batches": 4}'"""})

    def __post_init__(self) -> None:
        self.plan_options = plan_options_from(self.plan_options, "NNScalerTrainingArguments(plan_options=...)")
        # Before the parent's checks, which would start setting DeepSpeed or FSDP up.
        _refuse_other_engines(self.plan, self.deepspeed, self.fsdp, getattr(self, "parallelism_config", None))
        if self.plan is not None:
            check_plan(self.plan, "NNScalerTrainingArguments(plan=...)")
            check_plan_options(self.plan, self.plan_options, "NNScalerTrainingArguments(plan_options=...)")
        super().__post_init__()

    def to_dict(self) -> dict[str, Any]:
        """TrainingArguments' serialization (what loggers and `to_json_string` write), with a plan given as
        an object (a Plan, a function) written as its description, so the result stays JSON."""
        d = super().to_dict()
        plan = d.get("plan")
        if isinstance(plan, os.PathLike):
            d["plan"] = os.fspath(plan)
        elif plan is not None and not isinstance(plan, str):
            d["plan"] = resolve(plan).label
        return d


class _ReplicaView:
    """Training arguments as the Trainer's data pipeline should see them under a plan: one process per
    data-parallel replica (`world_size`, `process_index`), since the processes of one replica (its
    tensor, pipeline and context-parallel devices) read the same rows. A rank-aware sampler
    (`train_sampling_strategy="batch_rebalance"`) then cuts each step's rows between replicas, and the
    dataloader workers of one replica's devices are seeded alike (the same random augmentations).
    Everything else reads through to the arguments."""

    def __init__(self, args: Any, replicas: int, replica: int):
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_replicas", replicas)
        object.__setattr__(self, "_replica", replica)

    @property
    def world_size(self) -> int:
        return self._replicas

    @property
    def process_index(self) -> int:
        return self._replica

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_args"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


class _WithoutTokenAveraging:
    """Training arguments with `average_tokens_across_devices` off, for a subclass's `compute_loss`
    inside a planned step: transformers (and TRL) multiply the loss by the process count under it,
    which undoes their division by a count summed over processes; the planned step weighs replicas
    itself, so the factor one process would apply (1) is the one kept. Everything else reads through."""

    def __init__(self, args: Any):
        object.__setattr__(self, "_args", args)

    @property
    def average_tokens_across_devices(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_args"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


class _PlannedModel(torch.nn.Module):
    """What the Trainer sees as its wrapped model: the ParallelModule and the original model's
    attributes (config, name_or_path) for the parts of the Trainer that read them."""

    def __init__(self, pmodule: torch.nn.Module, original: torch.nn.Module):
        super().__init__()
        self.pmodule = pmodule
        object.__setattr__(self, "_original", original)  # not a submodule: its weights are stale copies
        self.calls: Any = None  # a training step's forward calls (hf_custom_loss.ForwardCalls), while one runs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The planned forward. The Trainer's `compute_loss` adds its count (`num_items_in_batch`), which
        the program, captured without it, does not take: the adapter weighs the loss instead. Inside a
        training step each call with gradients is weighed and recorded first (collective)."""
        kwargs.pop("num_items_in_batch", None)
        if self.calls is None or not torch.is_grad_enabled():
            if self.training or getattr(self.pmodule, "dp_size", 1) <= 1:
                return self.pmodule(*args, **kwargs)
            # evaluation: each replica's batch mean weighed by its share of the targets, so the Trainer's
            # mean over processes is the global batch's mean, as one process reports it (collective)
            from .loss_weight import weighed_output

            return weighed_output(self.pmodule, args, kwargs, lambda: self.pmodule(*args, **kwargs))
        weight = self.pmodule.loss_weight(kwargs if kwargs else (args[0] if len(args) == 1 else tuple(args)))
        out = self.pmodule(*args, **kwargs)
        self.calls.record(out, weight)
        return out

    def train(self, mode: bool = True) -> "_PlannedModel":
        """The original model follows, as the Trainer's model would: generation (`Seq2SeqTrainer`) runs it,
        and subclasses read `self.model.training` to tell training from evaluation."""
        super().train(mode)
        object.__getattribute__(self, "_original").train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The Trainer zeroes the model, not the optimizer: the ParallelModule's own zero_grad also
        drops gradients kept outside `.grad` (ZeRO-2 chunks)."""
        self.pmodule.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)


class NNScalerTrainerMixin:
    """Put before a `Trainer` subclass in the bases. The plan comes from `args.plan` (with
    `NNScalerTrainingArguments`) or from `plan=`/`plan_options=` here (any other arguments class)."""

    def __init__(self, *args: Any, plan: Optional[PlanLike] = None, plan_options: Optional[dict] = None,
                 weights: Optional[str] = None, **kwargs: Any) -> None:
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if plan is None:
            plan = getattr(targs, "plan", None)
        if plan is None:
            raise TypeError(f"{type(self).__name__} needs a plan: use NNScalerTrainingArguments(plan=...) or pass "
                            "plan=... to the trainer")
        check_plan(plan, f"{type(self).__name__}(plan=...)")
        if targs is not None:
            _refuse_other_engines(plan, getattr(targs, "deepspeed", None), getattr(targs, "fsdp", None),
                                  getattr(targs, "parallelism_config", None))
        self.nns_plan = plan
        self.nns_plan_options = plan_options_from(plan_options if plan_options is not None
                                                  else getattr(targs, "plan_options", None),
                                                  f"{type(self).__name__}(plan_options=...)")
        # the job's one Session: the plan resolved and its options checked once, here
        self.nns_session = session_for(plan, self.nns_plan_options, f"{type(self).__name__}(plan_options=...)")
        # Weights read into the shards once planned (`nns.checkpoint.load`: a save_pretrained directory
        # or the library's checkpoint), each rank reading its pieces: with a model built on the meta
        # device (`model=` or `model_init=`), no process ever holds the whole model.
        self.nns_weights = weights
        self.nns_module: Any = None  # the ParallelModule, once training starts
        self._nns_wrapped: Optional[_PlannedModel] = None
        self._nns_shares: Optional[list[float]] = None  # each accumulated batch's share of the window's loss
        self._nns_count_use: Any = None  # how the model's loss uses num_items_in_batch (hf_loss_count.CountUse)
        self._nns_window_count: Optional[float] = None  # the window's count as one process has it, once read
        self._nns_in_step = False  # a subclass's compute_loss is running inside a training step
        super().__init__(*args, **kwargs)

    # -- planning ---------------------------------------------------------------------------------------
    def _nns_parallelize(self) -> None:
        import nnscaler_plugins as nns

        from .hookspecs import example_inputs, on_parallelized

        self._nns_refuse_trainer_losses()
        model = self.model
        first = self._nns_first_batch()
        self._nns_count_use = self._nns_read_count_use(first)
        example = example_inputs(model, first)
        model.train()
        self.nns_module = self.nns_session.parallelize(
            model, example, device=self.args.device, cache_dir=os.path.join(self.args.output_dir, ".nnscaler_cache"))
        if self.nns_weights is not None:
            nns.checkpoint.load(self.nns_weights, self.nns_module)
        check_training_state(self.nns_module.plan, type(self).__name__, zero=True)
        self._nns_refuse_whole_step_custom_loss()
        if getattr(self.args, "eval_strategy", "no") != "no" or getattr(self.args, "eval_on_start", False):
            self._nns_refuse_whole_step_evaluation()  # before training, not at the first evaluation
        self._nns_wrapped = _PlannedModel(self.nns_module, model)
        on_parallelized(self.nns_module, self.nns_module.plan, "hf")

    def _nns_refuse_trainer_losses(self) -> None:
        """The planned step back-propagates the loss the model returns, as it was captured: a loss the
        Trainer would compute itself instead (label smoothing, `compute_loss_func`) is refused by name
        before training, not left out of the update."""
        found = []
        if getattr(self, "label_smoother", None) is not None:
            found.append(f"label_smoothing_factor={self.args.label_smoothing_factor}")
        if getattr(self, "compute_loss_func", None) is not None:
            found.append(f"compute_loss_func={getattr(self.compute_loss_func, '__name__', self.compute_loss_func)!r}")
        if found:
            raise NotImplementedError(
                f"{type(self).__name__}: {' and '.join(found)} make the Trainer compute the training loss itself, "
                "which the planned step does not do (it back-propagates the loss the model returns, as captured); "
                "train without them (label_smoothing_factor=0, no compute_loss_func), or compute that loss in the "
                "model's forward")

    def _nns_custom_loss(self) -> Optional[type]:
        """The Trainer subclass whose own `compute_loss` each training step runs (adapters/hf_custom_loss.py);
        None for transformers' own, which the plan's `train_step` computes."""
        from .hf_custom_loss import own_compute_loss

        return own_compute_loss(type(self), NNScalerTrainerMixin)

    def _nns_refuse_whole_step_custom_loss(self) -> None:
        """A subclass's compute_loss calls the model's forward, which a plan running whole training steps
        (a pipeline, micro-batches) does not have: refused before training, naming both."""
        owner, plan = self._nns_custom_loss(), self.nns_module.plan
        if owner is None or (plan.pipeline is None and plan.num_micro_batches <= 1):
            return
        from .hf_custom_loss import CustomLossError

        what = "a pipeline" if plan.pipeline is not None else f"{plan.num_micro_batches} micro-batches"
        raise CustomLossError(
            f"{type(self).__name__}: {owner.__name__}.compute_loss calls the model's forward, which plan "
            f"{plan.strategy!r} does not have: it runs whole training steps ({what}). Use a plan without a pipeline "
            "or micro_batches (dp, tp, the ZeRO plans), or leave compute_loss to transformers' Trainer")

    def _nns_passes_count(self, batch: Any) -> bool:
        """Whether the Trainer passes `num_items_in_batch` to the model's forward for such batches
        (`Trainer._get_num_items_in_batch` and `compute_loss`: a forward taking **kwargs, labels)."""
        return bool(self.model_accepts_loss_kwargs and self.compute_loss_func is None
                    and isinstance(batch, Mapping) and "labels" in batch)

    def _nns_read_count_use(self, batch: Any) -> Any:
        """How the model's loss uses the count the Trainer would pass it (adapters/hf_loss_count.py),
        None when it passes none; warns once when the loss ignores it."""
        from .hf_loss_count import CountUse, count_use, warn_ignored, warn_unknown

        if not self._nns_passes_count(batch):
            return None
        found = count_use(self.model, batch)
        if found is CountUse.IGNORES:
            warn_ignored(self.model, self.args.gradient_accumulation_steps)
        elif found is CountUse.UNKNOWN and self.args.gradient_accumulation_steps > 1:
            warn_unknown(self.model, self.args.gradient_accumulation_steps)
        return found

    def _nns_first_batch(self) -> Any:
        """One per-device batch, read in order (no sampler): only its shapes matter. Whatever the
        collator draws (a masking collator's random tokens) is given back, so the training loop's
        first batch is masked as in the plain Trainer."""
        from nnscaler_plugins.capture.tracing import unmoved_random_streams

        with unmoved_random_streams():
            return self._nns_read_first_batch()

    def _nns_read_first_batch(self) -> Any:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
                collator = self.data_collator
        except ImportError:
            pass
        loader = torch.utils.data.DataLoader(dataset, batch_size=self._train_batch_size, collate_fn=collator)
        return self._prepare_inputs(next(iter(loader)))

    # -- Trainer overrides --------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        if self.nns_module is None:
            self._nns_parallelize()
        with self._nns_by_replica():
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        if self.nns_module is None:
            return super().get_eval_dataloader(eval_dataset)
        with self._nns_by_replica():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        if self.nns_module is None:
            return super().get_test_dataloader(test_dataset)
        with self._nns_by_replica():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _nns_by_replica(self) -> Iterator[None]:
        """The Trainer builds its loaders as usual, with accelerate (which shards batches) and its
        sampler and worker seeds (`_ReplicaView`) seeing data-parallel replicas instead of processes."""
        from accelerate.data_loader import prepare_data_loader

        acc = self.accelerator
        num_processes, process_index = acc.state.num_processes, acc.state.process_index
        pm = self.nns_module
        original, args = acc.prepare, self.args

        def by_replica(loader: Any, *rest: Any, **kw: Any) -> Any:
            cfg = acc.dataloader_config
            prepared = prepare_data_loader(loader, acc.device, num_processes=pm.dp_size, process_index=pm.dp_rank,
                                           split_batches=cfg.split_batches, put_on_device=acc.device_placement,
                                           rng_types=acc.rng_types.copy(), dispatch_batches=cfg.dispatch_batches,
                                           even_batches=cfg.even_batches,
                                           use_seedable_sampler=cfg.use_seedable_sampler, data_seed=cfg.data_seed,
                                           non_blocking=cfg.non_blocking,
                                           use_stateful_dataloader=cfg.use_stateful_dataloader)
            acc._dataloaders.append(prepared)
            return prepared

        acc.prepare = by_replica
        self.args = _ReplicaView(args, pm.dp_size, pm.dp_rank)
        try:
            yield
        finally:
            acc.prepare = original
            self.args = args
        assert (num_processes, process_index) == (acc.state.num_processes, acc.state.process_index)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop, gathering predictions and losses once per replica (`_nns_gather_for_metrics`)."""
        self._nns_refuse_whole_step_evaluation()
        if getattr(self.args, "predict_with_generate", False):
            self._nns_prepare_generation()
        if self._nns_devices_per_replica() == 1:
            return super().evaluation_loop(*args, **kwargs)
        self.gather_function = functools.partial(self._nns_gather_for_metrics,
                                                 use_gather_object=getattr(self.args, "eval_use_gather_object", False))
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = self.accelerator.gather_for_metrics  # what the Trainer leaves there

    def _nns_prepare_generation(self) -> None:
        """`Seq2SeqTrainer` generates with `self.model.generate`: the original model, which a planned run
        does not train. It gets the trained weights first (gathered from the shards, collective: every
        rank evaluates), so generation runs on a whole copy of the planned model; a model on the meta
        device has no copy to generate with and is refused."""
        if self.nns_module is None:  # not trained yet: the original holds the weights
            return
        if self._nns_on_meta():
            raise NotImplementedError(
                f"{type(self).__name__}: predict_with_generate generates with the whole model, and this one was built "
                "on the meta device (no process holds it whole); save the model (save_model) and generate from "
                "from_pretrained of that directory, or evaluate without predict_with_generate")
        self._nns_sync_original()

    def _nns_refuse_whole_step_evaluation(self) -> None:
        """A plan that runs whole training steps (a pipeline, or micro-batches) has no forward pass of its
        own to evaluate with: refused on every rank alike, naming the plan and the ways out."""
        plan = self.nns_module.plan if self.nns_module is not None else None
        if plan is None or (plan.pipeline is None and plan.num_micro_batches <= 1):
            return
        what = "a pipeline" if plan.pipeline is not None else f"{plan.num_micro_batches} micro-batches"
        raise NotImplementedError(
            f"{type(self).__name__}: plan {plan.strategy!r} runs whole training steps ({what}), so it has no forward "
            "pass for evaluate() or predict(); evaluate the saved model (save_model) with a plan without a "
            "pipeline or micro_batches, or train without evaluation (no --do_eval, eval_strategy='no')")

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """Evaluation's loss, and a training step's when a subclass has its own `compute_loss` (else
        training runs the plan's `train_step`). The planned program computes the loss as it was
        captured, each batch's mean over its targets: what one process reports for the batch. Outside
        a training step the Trainer's count is not passed on: the Trainer would hand it to a program
        that never takes it and then rescale the mean by the processes (as for a sum over the count).
        Inside one, the subclass sees the window's count as one process has it, and the Trainer's
        rescaling is off (`_nns_custom_step`)."""
        count = num_items_in_batch if self._nns_in_step else None
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=count)

    def _nns_gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's `gather_for_metrics` over replicas: the devices of one replica read the same batch
        and hold the same outputs, so each replica's values are kept once (its first device's), and the
        last batch's padding is dropped as accelerate does (its remainder counts replicas). Collective."""
        from accelerate.utils import gather_object, recursively_apply

        acc = self.accelerator
        unit, world = self._nns_devices_per_replica(), acc.num_processes
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        if use_gather_object or not all_tensors:
            kept = [x for each in gather_object([data])[::unit] for x in each]
        else:
            def first_devices(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(world // unit, unit, -1, *t.shape[1:])[:, 0].reshape(-1, *t.shape[1:])

            kept = recursively_apply(first_devices, acc.gather(data))
        state = acc.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if isinstance(kept, list):
                return kept[:state.remainder]
            return recursively_apply(lambda t: t[:state.remainder], kept)
        return kept

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer choice and weight-decay grouping (read off the original model's
        names), over this rank's shards."""
        if self.nns_module is None:
            self._nns_parallelize()
        if self.optimizer is not None:
            return self.optimizer
        pm = self.nns_module
        decay = set(self.get_decay_parameter_names(self.model))
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        if pm.plan.zero and pm.dp_size > 1:  # the plan's sharded optimizer, groups named by FQN
            import nnscaler_plugins as nns

            names = list(pm.zero_shards)
            self.optimizer = nns.build_optimizer(pm, cls, param_groups=[
                {"params": [n for n in names if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [n for n in names if n not in decay], "weight_decay": 0.0}], **kwargs)
            return self.optimizer
        groups: dict[bool, list] = {True: [], False: []}
        for key in pm.held_keys:
            s = pm.program.shards[key]
            if s.kind == "param":
                p = pm.local_tensor(key)
                if p.requires_grad:
                    groups[s.fqn in decay].append(p)
        params = [{"params": groups[True], "weight_decay": self.args.weight_decay},
                  {"params": groups[False], "weight_decay": 0.0}]
        self.optimizer = cls([g for g in params if g["params"]], **kwargs)
        return self.optimizer

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if self._nns_wrapped is None:
            self._nns_parallelize()
        return self._nns_wrapped

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """The Trainer's window of accumulated batches; each batch's share of the window's loss is
        decided here, where the whole window is known (see `_nns_window_shares`)."""
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.nns_module is not None and batches:
            self._nns_shares = self._nns_window_shares(batches, num_items_in_batch)
        return batches, num_items_in_batch

    def _nns_window_shares(self, batches: list, num_items_in_batch: Any) -> list[float]:
        """Each batch's share of the window's update, as transformers' `compute_loss` and
        `training_step` weigh it. `train_step` gives each batch's mean over the targets of every
        replica. A model that divides its summed loss by the Trainer's count (`num_items_in_batch`)
        gives (the batch's targets / that count) times it, whatever the count includes (a model
        without a `loss_type` counts each row's first label too); one that ignores the count gives
        its mean, counted whole. The Trainer then divides by the window's batches unless it counts
        the loss as already scaled (`loss_is_scaled_for_ga`, by default: a count was passed).
        Collective when the count weighs the batches: one all-reduce over every rank."""
        from .hf_loss_count import CountUse
        from .hookspecs import example_inputs

        k = len(batches)
        self._nns_window_count = None
        accepts = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        per = 1.0 if scaled else 1.0 / k
        custom = self._nns_custom_loss() is not None  # its compute_loss sees the count one process has
        if not (accepts and num_items_in_batch is not None) or (self._nns_count_use is CountUse.IGNORES
                                                               and not custom):
            return [per] * k
        pm = self.nns_module
        # The Trainer's count is already summed over processes when it averages tokens across them.
        summed = bool(self.args.average_tokens_across_devices and self.args.world_size > 1)
        counts = torch.tensor([float(pm.loss_items(example_inputs(self.model, self._prepare_inputs(b))))
                               for b in batches] + [0.0 if summed else float(num_items_in_batch)], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        counts /= pm.plan.unit_size  # every device of a replica read the same batches
        trainer_count = float(num_items_in_batch) / pm.plan.unit_size if summed else float(counts[-1])
        self._nns_window_count = trainer_count
        if self._nns_count_use is CountUse.IGNORES:
            return [per] * k
        if trainer_count <= 0:
            return [per] * k
        return [float(c) / trainer_count * per for c in counts[:-1]]

    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """The plan's whole step; returns the loss times this batch's share of the accumulation
        window (as `_nns_window_shares` weighs it, transformers' way), which is what the Trainer adds
        up for its logs."""
        from .hookspecs import example_inputs

        self._nns_wrapped.train()
        inputs = self._prepare_inputs(inputs)
        k = max(1, int(getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)))
        shares = getattr(self, "_nns_shares", None)
        share = shares.pop(0) if shares else 1.0 / k
        pm = self.nns_module
        params = [p for p in pm.parameters() if p.requires_grad]
        # Copies: a data-parallel reduction leaves `.grad` as views of its bucket, which the next
        # reduction overwrites (runtime/grad_reducer.py), so the window's sum is kept apart from it.
        before = [None if p.grad is None else p.grad.clone() for p in params] if k > 1 else None
        if k > 1:
            for p in params:
                p.grad = None
        if self._nns_custom_loss() is not None:
            loss = self._nns_custom_step(inputs, num_items_in_batch, share)
        else:
            scale = pm.loss_scale
            pm.loss_scale = scale * share  # this step's share of the accumulated update, wherever its gradients land
            try:
                with self.compute_loss_context_manager():
                    loss = pm.train_step(example_inputs(self.model, inputs))
            finally:
                pm.loss_scale = scale
        if k > 1:  # the earlier steps' gradients, already reduced, are added back after this step's reduction
            with torch.no_grad():
                for p, old in zip(params, before):
                    if p.grad is not None:
                        if old is not None:
                            p.grad.add_(old)
                    else:
                        p.grad = old
        return loss.detach() * share

    def _nns_custom_step(self, inputs: dict, num_items_in_batch: Any, share: float) -> torch.Tensor:
        """One batch through the subclass's own `compute_loss` (adapters/hf_custom_loss.py): it calls the
        planned model's forward, and the loss it returns, which must be that model's loss output, is
        back-propagated weighed by the replica's share of the targets (the call's `loss_weight`) and the
        batch's share of the window. The subclass sees the window's count as one process has it, and
        the Trainer's rescaling of the loss by the process count (`average_tokens_across_devices`, which
        a process count of one makes 1) is off. Returns the loss weighed so that the Trainer's mean
        over processes of what it logs is the global batch's."""
        from .hf_custom_loss import ForwardCalls

        count = num_items_in_batch
        if count is not None and self._nns_window_count is not None:
            count = torch.tensor(self._nns_window_count, dtype=count.dtype if isinstance(count, torch.Tensor)
                                 else torch.float32, device=self.args.device)
        pm, wrapped, args = self.nns_module, self._nns_wrapped, self.args
        calls = wrapped.calls = ForwardCalls()
        self.args = _WithoutTokenAveraging(args)
        self._nns_in_step = True
        try:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(wrapped, inputs, num_items_in_batch=count)
        finally:
            self._nns_in_step, self.args, wrapped.calls = False, args, None
        weight = calls.weight_of(loss, self._nns_custom_loss().__name__)
        (loss * (pm.loss_scale * share * weight)).backward()
        return loss.detach() * weight

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        from nnscaler_plugins.runtime.grad_clip import clip_grad_norm_
        from nnscaler_plugins.runtime.optimizer import ParallelOptimizer

        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        if isinstance(inner, ParallelOptimizer):  # ZeRO: the gradients are its shards
            return inner.clip_grad_norm_(self.args.max_grad_norm)
        return clip_grad_norm_(self.nns_module, self.args.max_grad_norm)

    # -- batch-size accounting: replicas, not processes ------------------------------------------------------
    # The devices of one replica (its tensor, pipeline, context or expert-parallel devices) read the same
    # rows, so every count the Trainer takes over processes is counted here over replicas instead.
    def _nns_devices_per_replica(self) -> int:
        return self.nns_module.plan.unit_size if self.nns_module is not None else 1

    def get_tp_size(self) -> int:
        """1: the Trainer divides what it sums over processes (the window's token count) by this, and
        transformers versions differ in where they do; the adapter counts replicas itself instead
        (`_nns_window_shares`, `get_total_train_batch_size`, `_track_num_input_tokens`, evaluation)."""
        return 1

    def get_cp_size(self) -> int:
        return 1  # as for get_tp_size: the plan's context parallelism is inside its replica

    def get_sp_size(self) -> int:
        return 1  # as for get_cp_size; an sp size would also multiply the dataloader's length

    def get_total_train_batch_size(self, args: Any) -> int:
        """Rows per optimizer step: per replica x data-parallel replicas x accumulation (the Trainer's
        "Total train batch size" and its sample counts); the processes of a replica read the same rows."""
        if self.nns_module is None:
            self._nns_parallelize()
        return self._train_batch_size * args.gradient_accumulation_steps * self.nns_module.dp_size

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """The Trainer sums the tokens every process read; the devices of one replica read the same ones."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        unit = self._nns_devices_per_replica()
        if unit > 1:
            self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // unit

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """A model on the meta device stays there: its shards are made on each rank when planned."""
        from nnscaler_plugins.runtime.materialize import has_meta_tensors

        if not has_meta_tensors(model):
            super()._move_model_to_device(model, device)

    # -- saving and resuming --------------------------------------------------------------------------------
    def _nns_on_meta(self) -> bool:
        from nnscaler_plugins.runtime.materialize import has_meta_tensors

        return has_meta_tensors(self.model)

    def _nns_sync_original(self) -> None:
        """Copy the trained weights into the original model (collective)."""
        full = self.nns_module.full_state_dict()
        with torch.no_grad():
            self.model.load_state_dict(full, strict=False)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._nns_check_optimizer_files(resume_from_checkpoint)  # before the weights are restored
        if self._nns_on_meta():  # the shards read their pieces of the checkpoint's weights themselves
            if self.nns_module is None:
                self.nns_weights = resume_from_checkpoint
            else:
                import nnscaler_plugins as nns

                nns.checkpoint.load(resume_from_checkpoint, self.nns_module)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.nns_module is not None:  # already planned (a second train()): the shards take the weights
            self.nns_module.load_full_state_dict(self.model.state_dict())

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if self.nns_module is not None and self._nns_on_meta():
            # the model object has no weights to keep in sync: the whole tensors go to the writer
            # only the writing process keeps whole tensors (rank 0, or each node's first with save_on_each_node)
            full = self.nns_module.full_state_dict(rank0_only=not self.args.save_on_each_node)
            if self.args.should_save:
                self._save(output_dir or self.args.output_dir, state_dict=full)
            return
        if self.nns_module is not None:
            self._nns_sync_original()
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer state as whole tensors under parameter names (`optimizer.nnscaler.pt`, written
        by rank 0), so `resume_from_checkpoint` reshards it to any plan and process count. Collective."""
        from .resume import save_state

        world, rank = self._nns_world()
        os.makedirs(output_dir, exist_ok=True)
        saved = save_state(self.nns_module, self.optimizer)
        if rank == 0:
            path = os.path.join(output_dir, OPTIMIZER_FILE)
            torch.save(saved, path + ".tmp")
            os.replace(path + ".tmp", path)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _nns_check_optimizer_files(self, checkpoint: str) -> None:
        """A checkpoint of an earlier version holds one optimizer file per rank, which only the process
        count that wrote it can read: refused here, before anything is restored."""
        if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_FILE)) or self.args.save_only_model:
            return
        world, rank = self._nns_world()
        found = sorted(f for f in os.listdir(checkpoint) if f.startswith("optimizer"))
        if f"optimizer.rank{rank}-of-{world}.pt" not in found:
            from .resume import ResumeError

            raise ResumeError(f"{type(self).__name__}: cannot resume {checkpoint}: it has no optimizer state this "
                              f"adapter can read for {world} process(es) (found {found or 'none'}; per-rank files "
                              "fit only the plan and process count that wrote them); nothing was restored")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """The optimizer state cut for this plan (any plan and process count for `optimizer.nnscaler.pt`;
        the writing plan only for an older version's per-rank files), checked on every rank first."""
        if checkpoint is None:
            return
        from . import resume

        world, rank = self._nns_world()
        path = os.path.join(checkpoint, OPTIMIZER_FILE)
        if os.path.isfile(path):
            saved = torch.load(path, weights_only=True, map_location="cpu")
        else:
            self._nns_check_optimizer_files(checkpoint)
            per_rank: list[Any] = [None] * world
            per_rank[rank] = torch.load(os.path.join(checkpoint, f"optimizer.rank{rank}-of-{world}.pt"),
                                        weights_only=True, map_location="cpu")
            saved = {resume.PER_RANK: per_rank, "world_size": world}
        found = resume.agree(resume.problems(self.nns_module, self.optimizer, saved))
        resume.refuse(type(self).__name__, found, saved.get(resume.PLAN), self.nns_module)
        resume.note_resharding(saved.get(resume.PLAN), self.nns_module, type(self).__name__)
        resume.load_state(self.nns_module, self.optimizer, saved)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _nns_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0


class NNScalerTrainer(NNScalerTrainerMixin, Trainer):
    """`transformers.Trainer` that trains under a plan (see the module docstring)."""


@dataclass
class NNScalerSeq2SeqTrainingArguments(NNScalerTrainingArguments, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` (`predict_with_generate`, `generation_max_length`, ...) plus the plan;
    any other arguments class takes the plan fields the same way, in one line:
    `@dataclass class MyArguments(NNScalerTrainingArguments, SFTConfig): pass`."""


class NNScalerSeq2SeqTrainer(NNScalerTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` that trains under a plan. With `predict_with_generate`, `evaluate`
    and `predict` generate with the whole model, given the trained weights from the shards first; the
    loss is the planned model's."""


__all__ = ["NNScalerSeq2SeqTrainer", "NNScalerSeq2SeqTrainingArguments", "NNScalerTrainer", "NNScalerTrainerMixin",
           "NNScalerTrainingArguments"]
