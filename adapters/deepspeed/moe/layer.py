"""`deepspeed.moe.layer.MoE` under DeepSpeed 0.19's signature. DeepSpeed's layer is its own gate
(TopKGate: capacity, token dropping, random token selection, noisy gating) around copies of one
expert; this engine does not reproduce that gate, so constructing the layer is refused with what
to use instead, at use and never at import (scripts import it whether or not they build one)."""
from __future__ import annotations

from typing import Optional

from torch import nn

from .. import errors


class MoE(nn.Module):
    """DeepSpeed's experts layer: refused at construction (see the module docstring)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        raise errors.DeepSpeedNotImplemented(
            f"deepspeed.moe.layer.MoE (num_experts={num_experts}, k={k}, ep_size={ep_size}): DeepSpeed's TopKGate "
            "(capacity, token dropping, random token selection) is not reproduced, so its outputs and l_aux would "
            "differ; write the experts layer in plain PyTorch (a router and a ModuleList of experts) and pick the "
            "expert-parallel plan with 'nnscaler': {'plan': 'ep', 'ep': N}")
