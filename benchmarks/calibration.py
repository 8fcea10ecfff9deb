"""The published calibration points of docs/cost-model.md, as models and Megatron/Alpa plans.

Each case builds an HF GPT-2 model on the meta device with the paper's shape (exact GeLU and
attention written out, as Megatron-LM and Alpa ran it; dropout 0.1 as GPT), captures one
micro-batch, and writes the published parallel configuration with the `megatron` strategy's
options. Shared by simulator_fidelity.py (does the simulator reproduce the published numbers?) and
plan_quality.py (does the search beat the published plans?).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

GiB = 1024 ** 3


@dataclass(frozen=True)
class Model:
    h: int
    l: int
    a: int
    s: int = 2048
    V: int = 51200

    @property
    def params(self) -> float:
        h, l, V, s = self.h, self.l, self.V, self.s
        return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


@dataclass(frozen=True)
class Case:
    source: str  # "C1", "C2 full", "C2 selective", "C3"
    name: str
    model: Model
    cluster: str
    world: int
    batch: int  # global batch
    micro_batch: int
    options: dict = field(default_factory=dict, hash=False)  # megatron strategy options
    time_s: Optional[float] = None
    memory: dict = field(default_factory=dict, hash=False)  # published memory, GiB: "states", "activations", "peak"

    @property
    def dp(self) -> int:
        return self.world // (self.options.get("tp", 1) * self.options.get("pp", 1))

    @property
    def micro_batches(self) -> int:
        return self.batch // (self.micro_batch * self.dp)


def _c1() -> list[Case]:
    # (name, h, l, a, tp, pp, gpus, batch, derived t_iter, interleave chunks)
    rows = [("1.7B", 2304, 24, 24, 1, 1, 32, 512, 3.53), ("3.6B", 3072, 30, 32, 2, 1, 64, 512, 3.70),
            ("7.5B", 4096, 36, 32, 4, 1, 128, 512, 3.70), ("18B", 6144, 40, 48, 8, 1, 256, 1024, 9.40),
            ("39B", 8192, 48, 64, 8, 2, 512, 1536, 14.45), ("76B", 10240, 60, 80, 8, 4, 1024, 1792, 16.06),
            ("145B", 12288, 80, 96, 8, 8, 1536, 2304, 24.82), ("310B", 16384, 96, 128, 8, 16, 1920, 2160, 37.61),
            ("530B", 20480, 105, 128, 8, 35, 2520, 2520, 54.08), ("1T", 25600, 128, 160, 8, 64, 3072, 3072, 102.6)]
    out = []
    for name, h, l, a, tp, pp, gpus, batch, t in rows:
        opts = {"tp": tp, "pp": pp, "recompute": "full"}
        if pp > 1:
            per_rank = l // pp
            v = next((v for v in (2, 3, 4, 5) if per_rank % v == 0), 1)
            opts.update(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
        out.append(Case("C1", name, Model(h, l, a), "a100-dgx", gpus, batch, 1, opts, t))
    return out


def _c2() -> list[Case]:
    # (name, h, l, a, tp, pp, batch, micro-batch, v, full s, selective s, states GiB, act none, act sel)
    rows = [("22B", 6144, 48, 64, 8, 1, 4, 4, 1, 1.42, 1.10, 45.56, 59.25, 9.56),
            ("175B", 12288, 96, 96, 8, 8, 64, 1, 3, 18.13, 13.75, 45.56, 66.84, 12.35),
            ("530B", 20480, 105, 128, 8, 35, 280, 1, 3, 49.05, 37.83, 31.64, 114.02, 23.08),
            ("1T", 25600, 128, 160, 8, 64, 512, 1, 1, 94.42, 71.49, 32.96, 131.25, 26.56)]
    out = []
    for name, h, l, a, tp, pp, batch, b, v, full, sel, states, act_none, act_sel in rows:
        base = {"tp": tp, "pp": pp}
        if pp > 1:
            base.update(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
        world = tp * pp
        model = Model(h, l, a)
        out.append(Case("C2 full", name, model, "a100-dgx", world, batch, b, dict(base, recompute="full"), full,
                        {"states": states}))
        out.append(Case("C2 selective", name, model, "a100-dgx", world, batch, b,
                        dict(base, recompute="selective", sequence_parallel=True), sel, {"activations": act_sel}))
        out.append(Case("C2 no recompute", name, model, "a100-dgx", world, batch, b, dict(base, recompute="none"),
                        None, {"activations": act_none}))
    return out


def _c3() -> list[Case]:
    # Alpa's manual plan: UniformParallelArgs(prefer_reduce_scatter=True, use_remat=True, dp=2, op=2, pp=2):
    # gradients and optimizer states reduce-scattered over data parallelism (ZeRO-2 style), fp16.
    return [Case("C3", "GPT-2.6B", Model(2560, 32, 32, s=1024), "v100-p3", 8, 32, 4,
                 {"tp": 2, "pp": 2, "recompute": "full", "schedule": "1f1b", "zero": 2}, 2.464, {"peak": 8.745})]


def cases() -> list[Case]:
    return _c1() + _c2() + _c3()


_GRAPHS: dict = {}


def graph(model: Model, micro_batch: int, vocab: Optional[int] = None):
    """The captured graph of one micro-batch (cached per shape for the life of the process)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import nnscaler_plugins as nns

    key = (model, micro_batch, vocab)
    if key not in _GRAPHS:
        cfg = GPT2Config(n_layer=model.l, n_embd=model.h, n_head=model.a, vocab_size=vocab or model.V,
                         n_positions=model.s, activation_function="gelu", use_cache=False)
        cfg._attn_implementation = "eager"
        warnings.filterwarnings("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        with torch.device("meta"):
            m = GPT2LMHeadModel(cfg)
        ids = torch.zeros(micro_batch, model.s, dtype=torch.long, device="meta")
        _GRAPHS.clear()  # one big graph at a time keeps memory flat
        _GRAPHS[key] = nns.capture(m, kwargs={"input_ids": ids, "labels": ids})
    return _GRAPHS[key]


def published_plan(case: Case, g=None):
    """The case's configuration written with the megatron strategy (no lowering: a plan only)."""
    from nnscaler_plugins.plan.primitives import PlanBuilder
    from nnscaler_plugins.plugins import get_strategy

    g = g if g is not None else graph(case.model, case.micro_batch)
    strategy = get_strategy("megatron")
    opts = dict(case.options)
    unit, dp = strategy.degrees(case.world, **opts)
    builder = PlanBuilder(g, unit, dp, strategy="megatron",
                          options={k: v for k, v in opts.items() if isinstance(v, (int, float, str, bool))},
                          micro_batches=case.micro_batches)
    strategy(builder, **{k: v for k, v in opts.items() if k != "zero"})
    plan = builder.finish()
    if "zero" in opts:
        plan.zero = opts["zero"]
    return plan


def nodes_for(case: Case) -> int:
    return -(-case.world // 8)
