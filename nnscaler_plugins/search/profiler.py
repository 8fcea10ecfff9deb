"""Profiling mode: op times measured on the device at hand instead of computed from FLOPs and bytes.

    cm = CostModel(graph, nns.cluster("local-cpu"), profiler=OpProfiler())
    est = simulate(plan, spec, graph, cost_model=cm)

Each distinct op (by shape, arguments and split) is run with random inputs of the shapes one piece
sees, forward and backward, a few times; the median is kept. Ops whose arguments carry shapes (views,
reshapes, factories) are measured whole and divided among the pieces, since their arguments would
have to be rewritten per piece. Ops larger than `max_elements` are not run (their roofline time is
used), so a profile of a large model's shapes on a small machine stays affordable. The device is
whatever torch gives (CPU here, the current CUDA device when there is one); nothing is
communicated, so profiling never touches torch.distributed.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch

from nnscaler_plugins.capture.graph import Ref
from nnscaler_plugins.search.costmodel import OpTime
from nnscaler_plugins.search.layouts import Placement

SHAPE_FREE = frozenset({"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "scaled_dot_product_attention", "gelu",
                        "relu", "silu", "tanh", "sigmoid", "softmax", "_softmax", "log_softmax", "layer_norm",
                        "native_layer_norm", "add", "sub", "mul", "div", "neg", "exp", "rsqrt", "pow", "dropout",
                        "where", "embedding", "cross_entropy_loss"})
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


class OpProfiler:
    def __init__(self, device: Optional[str] = None, repeat: int = 5, max_elements: int = 64 * 1024 * 1024):
        self.device = torch.device(device) if device else (torch.device("cuda") if torch.cuda.is_available()
                                                            else torch.device("cpu"))
        self.repeat = repeat
        self.max_elements = max_elements
        self._cache: dict = {}
        self.measured = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time(self, cm: Any, name: str, p: Placement, training: Any, shard: int = 1) -> Optional[OpTime]:
        graph = cm.graph
        op = graph.op(name)
        c = cm.costs.ops[name]
        if c.kind == "view" or not isinstance(op.target, torch._ops.OpOverload):
            return None
        counts = p.label_counts()
        local_ok = op.short_name in SHAPE_FREE and shard == 1
        shapes = []
        sig = cm.costs.signatures[name]
        for i, v in enumerate(op.inputs):
            meta = graph.values[v].meta
            shape = list(meta.shape)
            labels = sig.inputs[i] if i < len(sig.inputs) else None
            if local_ok and labels:
                for d, l in enumerate(labels):
                    shape[d] //= counts.get(l, 1)
            shapes.append(tuple(shape))
        if sum(int(torch.Size(s).numel()) for s in shapes) > self.max_elements:
            return None
        dtype = DTYPES.get(training.dtype, torch.float32)
        key = (c.key, tuple(shapes), str(dtype), local_ok)
        hit = self._cache.get(key)
        if hit is None:
            try:
                hit = self._measure(graph, op, shapes, dtype, c.needs_grad)
            except Exception:  # noqa: BLE001 - an op that cannot run standalone falls back to the formula
                hit = None
            self._cache[key] = hit
        if hit is None:
            return None
        fwd, bwd = hit
        div = 1 if local_ok else p.pieces * shard
        fwd, bwd = fwd / div, bwd / div
        total_grad = c.flops_input_grad + c.flops_weight_grad
        share_w = c.flops_weight_grad / total_grad if total_grad else 0.0
        return OpTime(fwd, bwd * (1 - share_w), bwd * share_w, c.flops / max(1, p.pieces * shard))

    def _measure(self, graph, op, shapes, dtype, needs_grad: bool) -> tuple[float, float]:
        tensors = {}
        leaves = []
        for v, shape in zip(op.inputs, shapes):
            meta = graph.values[v].meta
            if meta.dtype.is_floating_point:
                t = torch.randn(shape, dtype=dtype, device=self.device)
                if meta.requires_grad and needs_grad:
                    t.requires_grad_(True)
                    leaves.append(t)
            elif meta.dtype == torch.bool:
                t = torch.ones(shape, dtype=torch.bool, device=self.device)
            else:
                t = torch.zeros(shape, dtype=meta.dtype, device=self.device)
            tensors[v] = t

        def sub(x):
            if isinstance(x, Ref):
                return tensors[x.name]
            if isinstance(x, (list, tuple)):
                return type(x)(sub(y) for y in x)
            if isinstance(x, torch.device):
                return self.device
            return x

        args = sub(op.args)
        kwargs = {k: sub(v) for k, v in op.kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = self.device

        def run():
            return op.target(*args, **kwargs)

        out = run()  # warm-up
        fwd_times, bwd_times = [], []
        for _ in range(self.repeat):
            self._sync()
            t0 = time.perf_counter()
            out = run()
            self._sync()
            fwd_times.append(time.perf_counter() - t0)
            if leaves:
                outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(o, torch.Tensor) and o.requires_grad]
                if outs:
                    grads = [torch.ones_like(o) for o in outs]
                    self._sync()
                    t0 = time.perf_counter()
                    torch.autograd.backward(outs, grads)
                    self._sync()
                    bwd_times.append(time.perf_counter() - t0)
                    for leaf in leaves:
                        leaf.grad = None
        self.measured += 1
        return statistics.median(fwd_times), statistics.median(bwd_times) if bwd_times else 0.0
