"""What a framework adapter accepts as `plan=`, checked where the user passes it.

Lightning and the Hugging Face Trainer start processes (or torchrun already did); a misspelt strategy
name found after that costs a launch and a traceback per rank, so both adapters check here first.
"""
from __future__ import annotations

from typing import Any

from nnscaler_plugins.plan.source import PlanLike, resolve
from nnscaler_plugins.session import Session


def check_plan(plan: PlanLike, where: str) -> None:
    """Raise with the registered names unless `plan` is a strategy name, a Plan, an existing plan
    file or a callable. `where` names the argument in messages (e.g. "NNScalerStrategy(plan=...)")."""
    resolve(plan, where)


def check_plan_options(plan: PlanLike, options: dict, where: str) -> None:
    """Refuse option names the plan's strategy does not take (closest valid name in the message),
    before a process starts: the same check `nns.plan` and `nns.parallelize` make."""
    resolve(plan, where).check_options(options or {}, where)
    precision = (options or {}).get("precision")
    if precision not in (None, "fp32"):  # what check_training_state refuses after planning, said before launch
        raise NotImplementedError(f"{where}: precision={precision!r} in the plan is not supported by this adapter; "
                                  "use the framework's own mixed precision (Lightning precision=, Trainer bf16=) "
                                  "with an fp32 plan")


def session_for(plan: PlanLike, options: dict, where: str) -> Session:
    """The adapter's one `Session` for the job: the plan resolved and its options checked here, where
    the user wrote them (before any process starts); precision refused as `check_plan_options` does."""
    session = Session(plan, where=where, **(options or {}))
    check_plan_options(plan, options, where)
    return session


def check_training_state(plan: Any, framework: str, zero: bool = False) -> None:
    """Refuse what an adapter does not run: a plan's own precision (the frameworks bring their own
    mixed precision), and ZeRO-sharded state unless the adapter rebuilds the framework's optimizer
    with `nns.build_optimizer` (`zero=True`)."""
    if not zero and getattr(plan, "zero", 0) and plan.dp > 1:
        raise NotImplementedError(f"{framework}: plans with zero={plan.zero} are not supported by this adapter yet; "
                                  "use the plan without zero=, or train with nns.parallelize + nns.build_optimizer")
    if getattr(plan, "precision", "fp32") != "fp32":
        raise NotImplementedError(f"{framework}: a plan with precision={plan.precision!r} is not supported by this "
                                  "adapter; use the framework's own mixed precision (Lightning precision=, "
                                  "Trainer bf16=) with an fp32 plan")
