"""Plans: the primitives (op-trans, op-assign, op-order) that make them, the JSON `Plan` they make,
its validation, the layer groups pipelines cut at, schedules and the timeline that dry-runs them,
and `source.py`, the one place a plan-like value (name, function, Plan, file) is understood.
"""
from nnscaler_plugins.plan.plan import OpPlacement, PipelineSpec, Plan

__all__ = ["OpPlacement", "PipelineSpec", "Plan"]
