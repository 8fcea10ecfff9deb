"""`nns.build_optimizer(module, torch.optim.AdamW, **kwargs)`: the optimizer of a ParallelModule.

It is a `torch.optim.Optimizer` (learning-rate schedulers take it as one: its `param_groups` are
the inner optimizer's own list) that steps *master* tensors, one per trainable parameter this rank
holds:

- ZeRO 0 in fp32: the parameter itself (nothing is copied);
- ZeRO 1/2 (data-parallel size > 1): an fp32 copy of this replica's chunk of the parameter
  (runtime/zero.py); after the step every replica's updated chunks are all-gathered into the
  parameters, in buckets that run beside the next forward and are waited for right before its
  first use of them (the plan's overlap_param_gather; False: finished in the step);
- ZeRO 3: the parameter is the chunk already (its fp32 copy in bf16/fp16);
- bf16/fp16: fp32 copies, written back rounded to the compute dtype after each step.

Offload (the plan's `offload`): "optimizer" keeps every master as an fp32 copy in host memory
(pinned when a GPU computes), so the optimizer state lives there and the step runs there (with
torch's fused CPU kernel, see below); gradients are copied to
the host in `_prepare` and the updated masters back to the device after the step. "params"
(ZeRO-3) also keeps the parameter chunks there (runtime/zero_setup.py), so an fp32 chunk is its
own master and is fetched to the device only when the forward or backward gathers it.

Implementation: torch's Adam, AdamW, SGD and Adagrad are built with `fused=True` where torch has the
fused kernel for every master's device, unless the caller chose `fused=` or `foreach=` itself
(runtime/fused_optimizer.py says why and what it changes).

The inner optimizer must be elementwise (SGD, Adam, AdamW, Adagrad, RMSprop, ...) once state is
sharded: a chunk's update may not depend on the other chunks.

Non-finite values (bf16 and fp32): before any weight changes, `step()` (or `clip_grad_norm_`,
whichever comes first) checks the step's loss and gradients on every rank and, per the plan's
`on_nonfinite`, raises `nns.NonFiniteError` on every rank or skips the step (`last_step_skipped`);
see runtime/nonfinite.py.

Loss scaling (fp16): `module.train_step(batch)` multiplies the loss by `optimizer.loss_scale`
before backward; code that calls backward itself uses `optimizer.backward(loss)`, which does the
same. `step()` unscales, skips the step when a gradient overflowed (`last_step_skipped`) and moves
the scale (DeepSpeed's defaults: 2**16 initially, halved on overflow, doubled after 1000 clean
steps, at least 1). Clipping: `clip_grad_norm_(max_norm)` between backward and `step()`.

State: `state_dict()`/`load_state_dict()` are this rank's pieces (the inner optimizer's state
dict plus the loss scaler and, in bf16/fp16, the master copies); `full_state_dict()` is the
whole state under parameter names, `{"state": {fqn: {key: tensor}}, "param_groups": [{...,
"params": [fqn, ...]}]}` (collective), and `load_full_state_dict(sd)` takes each rank's pieces
of one. In bf16/fp16 the whole state has the fp32 master weights under "master_param"; load the
module's state before the optimizer's, since the optimizer re-reads masters from parameters
changed after it last wrote them.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Optional

import torch
import torch.distributed as dist

from nnscaler_plugins.runtime.fused_optimizer import fused_by_default
from nnscaler_plugins.runtime.grad_clip import clip_, counts, global_norm
from nnscaler_plugins.runtime.precision import LossScaler
from nnscaler_plugins.runtime.zero import FlatShard, all_gather_chunks
from nnscaler_plugins.runtime.zero_setup import host_copy

_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam")


class _Entry:
    """One trainable parameter: the module's tensor, its ZeRO chunk and the master it steps."""

    def __init__(self, fqn: str, param: torch.nn.Parameter, shard: FlatShard, master: torch.Tensor, mode: str):
        self.fqn = fqn
        self.param = param
        self.shard = shard
        self.master = master
        self.mode = mode  # "self" | "whole" | "chunk" | "zero3"
        self.version = param._version


class ParallelOptimizer(torch.optim.Optimizer):
    """See the module docstring. Build it with `nns.build_optimizer`."""

    def __init__(self, module: Any, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 param_groups: Optional[list[dict[str, Any]]] = None, **kwargs: Any):
        plan = module.plan
        if getattr(optimizer_cls, "__name__", "") in _NOT_ELEMENTWISE and plan.zero and plan.dp > 1:
            raise ValueError(f"{optimizer_cls.__name__} is not elementwise, so its state cannot be sharded by ZeRO; "
                             "use zero=0 or an elementwise optimizer (SGD, Adam, AdamW, ...)")
        self.module = module
        module.sharded_optimizer = True  # ZeRO-2 may keep gradients as chunks now: this optimizer reads them
        self.precision = plan.precision
        self.zero = plan.zero if plan.dp > 1 else 0
        # offload: the masters, their state and the step live in host memory (see module docstring)
        self.offload = getattr(plan, "offload", None)
        if self.offload == "params" and module.zero3 is not None:
            module.zero3.keep_on_host(host_copy)
        self.entries: list[_Entry] = []
        for fqn, fs in module.zero_shards.items():
            p = module.parameter(fqn)
            if module.zero3 is not None:
                mode = "zero3"
            elif fs.size > 1:
                mode = "chunk"
            else:
                mode = "whole"
            on_host = p.device.type == "cpu" and self.offload == "params"  # ZeRO-3 chunks kept there already
            if mode != "chunk" and p.dtype == torch.float32 and (self.offload is None or on_host):
                master, mode = p, ("self" if mode == "whole" else mode)
            elif mode == "chunk":
                master = fs.owned(p.detach().reshape(-1)).float()
                master = host_copy(master) if self.offload else master.clone()
            else:
                master = host_copy(p.detach().float()) if self.offload else p.detach().float().clone()
            self.entries.append(_Entry(fqn, p, fs, master, mode))
        groups = _grouped(self.entries, param_groups)
        if fused_by_default(optimizer_cls, [e.master for e in self.entries], kwargs, param_groups or ()):
            kwargs = {**kwargs, "fused": True}  # torch's one-kernel update: see runtime/fused_optimizer.py
        self.inner = optimizer_cls(groups, **kwargs)
        super().__init__(groups, self.inner.defaults)
        # One list and one state: schedulers that change an lr change what the inner step reads.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.scaler = LossScaler() if self.precision == "fp16" else None
        module.loss_scale = self.loss_scale
        self.last_step_skipped = False
        self._prepared = False
        self._overflow = False

    # -- loss scale ---------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward() with the loss scale applied (needed in fp16, harmless otherwise)."""
        (loss * self.loss_scale if self.scaler is not None else loss).backward(**kwargs)

    # -- gradients ----------------------------------------------------------------------------------
    def _grad_of(self, e: _Entry) -> Optional[torch.Tensor]:
        """This rank's gradient for the entry's master (same shape), still scaled."""
        reducer = self.module.grad_reducer
        if e.mode == "chunk":
            if reducer is not None and id(e.param) in reducer.shard_grads:
                return reducer.shard_grads[id(e.param)]
            g = e.param.grad
            return None if g is None else e.shard.owned(g.reshape(-1))
        return e.param.grad

    def _prepare(self) -> None:
        """Master gradients in fp32, unscaled; overflow found (once per step)."""
        if self._prepared:
            return
        self._prepared = True
        self.module.param_gather.wait_all()  # parameters read below (and compared with the masters) are settled
        convert_src: list[torch.Tensor] = []
        convert_dst: list[_Entry] = []
        for e in self.entries:
            if e.param._version != e.version and e.mode != "self":  # parameters changed under us: re-read
                with torch.no_grad():
                    src = e.param.detach().reshape(-1)
                    e.master.copy_(e.shard.owned(src) if e.mode == "chunk" else src.view_as(e.master))
                e.version = e.param._version
            if e.mode == "self":
                continue
            g = self._grad_of(e)
            if g is not None and (g.dtype != torch.float32 or g.device != e.master.device):
                convert_src.append(g.detach().reshape(e.master.shape))  # converted (or copied to host) below
                convert_dst.append(e)
                continue
            e.master.grad = None if g is None else g.detach().reshape(e.master.shape)
            if e.master.grad is not None and self.scaler is not None:  # unscaled in place below: not the reducer's
                e.master.grad = e.master.grad.clone()
        if convert_src:
            bufs = [torch.empty(src.shape, dtype=torch.float32, device=e.master.device,
                                pin_memory=e.master.is_pinned()) for src, e in zip(convert_src, convert_dst)]
            copy_all(bufs, convert_src)
            for e, buf in zip(convert_dst, bufs):
                e.master.grad = buf
        self._overflow = False
        if self.scaler is None:  # a non-finite loss or gradient: raise or skip, agreed by every rank (nonfinite.py)
            guard = getattr(self.module, "nonfinite", None)
            if guard is not None:
                self._overflow = guard.check([(e.fqn, e.master.grad) for e in self.entries],
                                             "the optimizer step (nns.build_optimizer)")
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            bad = torch.zeros((), dtype=torch.float32)
            for e in self.entries:
                g = e.master.grad
                if g is not None:
                    g.mul_(inv)
                    if g.numel():
                        bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self._overflow = bool(bad.item())

    def _counted(self) -> list[torch.Tensor]:
        """The gradients this rank counts in the global norm."""
        out = []
        for e in self.entries:
            g = e.master.grad
            # a ZeRO chunk counts where it is owned; a whole gradient every replica holds, on the first
            if g is not None and counts(e.shard.count_in_norm, e.shard.size == 1 and e.mode != "zero3",
                                        self.module.dp_rank):
                out.append(g)
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the global norm (each parameter counted once); returns the norm
        before clipping, as torch.nn.utils.clip_grad_norm_ does. Collective: call on every rank."""
        self._prepare()
        if self._overflow:
            return torch.tensor(float("inf"))
        total = global_norm(self._counted(), norm_type, torch.device("cpu"))
        clip_([e.master.grad for e in self.entries if e.master.grad is not None], total, float(max_norm))
        return total

    # -- step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = closure() if closure is not None else None
        rec = getattr(self.module, "flight_recorder", None)
        if rec is not None:
            rec.at("optimizer step")
        self._prepare()
        self._prepared = False
        self.last_step_skipped = self._overflow
        if self.scaler is not None:
            self.scaler.update(self._overflow)
            self.module.loss_scale = self.scaler.scale
        if self._overflow:
            return loss
        self.inner.step()
        chunked = [e for e in self.entries if e.mode == "chunk"]
        if chunked:  # offloaded masters travel to the device first: the gather runs there
            self._gather_updated(chunked)
        copies = [e for e in self.entries if e.mode in ("whole", "zero3") and e.master is not e.param]
        if copies:  # rounded back to the compute dtype, one foreach copy rather than a kernel per tensor
            copy_all([e.param for e in copies], [e.master.view_as(e.param) for e in copies])
        for e in self.entries:
            if e.mode != "chunk":  # chunks' parameters are written when their gather lands (`_gather_updated`)
                e.version = e.param._version
        if rec is not None:
            rec.end_step()
        return loss

    def _gather_updated(self, chunked: list[_Entry]) -> None:
        """Every replica's updated chunks into the parameters. With the plan's overlap_param_gather
        (on unless set False) the all-gathers only start here, one per bucket, and each bucket is
        waited for right before the next forward first uses one of its parameters
        (`zero.PendingGather`), so the gathers run beside that forward; else they finish here."""
        gather = self.module.param_gather
        chunks = [e.master.to(e.param.device, non_blocking=True) for e in chunked]
        outs = [e.param.detach().view(-1) for e in chunked]

        def done(indices: list[int]) -> None:  # a parameter written by the gather is the master's value
            for i in indices:
                chunked[i].version = chunked[i].param._version

        gather.launch([e.shard for e in chunked], chunks, outs, on_done=done)
        if self.module.plan.knobs.overlap_param_gather is False:
            gather.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        reducer = self.module.grad_reducer
        if reducer is not None:
            reducer.shard_grads.clear()
        if self.module.zero3 is not None:
            self.module.zero3.drop_accumulated()
        for e in self.entries:
            for t in (e.param, e.master):
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                else:  # a reduced gradient may be a view of its bucket (grad_reducer.py): no in-place detach
                    if t.grad.grad_fn is not None:
                        t.grad.detach_()
                    t.grad.zero_()
        self._prepared = False

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's pieces: the inner optimizer's state dict, the loss scaler, the masters that
        are copies (bf16/fp16, ZeRO chunks)."""
        sd = self.inner.state_dict()
        sd["nnscaler"] = {"zero": self.zero, "precision": self.precision, "dp_rank": self.module.dp_rank,
                          "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
                          "masters": {e.fqn: e.master.detach().clone() for e in self.entries
                                      if e.master is not e.param}}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module.param_gather.wait_all()  # masters re-read from parameters below: settled first
        sd = dict(state_dict)
        extra = sd.pop("nnscaler", None) or {}
        self.inner.load_state_dict(sd)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        if self.scaler is not None and extra.get("loss_scaler"):
            self.scaler.load_state_dict(extra["loss_scaler"])
            self.module.loss_scale = self.scaler.scale
        masters = extra.get("masters", {})
        with torch.no_grad():
            for e in self.entries:
                if e.fqn in masters and e.master is not e.param:
                    e.master.copy_(masters[e.fqn])
                e.version = e.param._version

    def _elementwise_keys(self) -> tuple[list[str], dict[str, Any]]:
        """State keys shaped like the master (sharded with it) and the per-parameter scalars."""
        for e in self.entries:
            st = self.state.get(e.master)
            if st:
                per = [k for k, v in st.items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape == e.master.shape]
                scalars = {k: v for k, v in st.items() if k not in per}
                return per, scalars
        return [], {}

    def full_state_dict(self, rank0_only: bool = False, only: Optional[Collection[str]] = None) -> dict[str, Any]:
        """Whole optimizer state under parameter names (collective: call on every rank); with
        `rank0_only`, the other ranks keep no tensor of it (their "state" is empty); with `only`,
        just these parameters' state (every rank passes the same names)."""
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        wanted = None if only is None else set(only)
        m = self.module
        per, scalars = self._elementwise_keys()
        keys = per + (["master_param"] if self.precision != "fp32" else [])
        mine = {e.fqn: e for e in self.entries}
        state: dict[str, dict[str, Any]] = {}
        seen: set[str] = set()
        for v, s in m.program.shards.items():
            if s.kind != "param" or not m.graph.meta(s.value).requires_grad or s.fqn in seen:
                continue
            if wanted is not None and s.fqn not in wanted and not wanted.intersection(s.aliases):
                continue
            seen.add(s.fqn)
            e = mine.get(s.fqn) if v in m.held_keys else None
            out: dict[str, Any] = {}
            for k in keys:
                local = None
                if e is not None:
                    src = e.master if k == "master_param" else self.state[e.master][k]
                    local = self._whole_local(e, src)
                whole = m.whole_tensor(v, local, torch.float32)
                if keep:
                    out[k] = whole.detach().cpu().clone()
                del whole
            if e is not None:
                out.update({k: (val.clone() if torch.is_tensor(val) else val)
                            for k, val in self.state.get(e.master, {}).items() if k in scalars})
            else:
                out.update({k: (val.clone() if torch.is_tensor(val) else val) for k, val in scalars.items()})
            if out and keep:
                state[s.fqn] = out
        fqn_of = {id(e.master): e.fqn for e in self.entries}
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [fqn_of[id(t)] for t in g["params"]]
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def _whole_local(self, e: _Entry, t: torch.Tensor) -> torch.Tensor:
        """The device's whole (tensor-parallel) piece of a master-shaped tensor: chunks gathered."""
        if e.mode in ("chunk", "zero3") and e.shard.size > 1:
            device = self.module.device if self.offload else t.device  # gathers run on the device
            out = torch.empty(e.shard.numel, dtype=t.dtype, device=device)
            all_gather_chunks([e.shard], [t.detach().to(device)], [out])
            return out.view(e.shard.shape)
        return t.detach().reshape(e.shard.shape)

    def local_state(self) -> dict[str, tuple[Optional[tuple[int, int]], dict[str, Any]]]:
        """This rank's state per parameter, without communication, for sharded checkpoints: the
        ZeRO chunk [lo, hi) of the device's piece its tensors cover (None: the whole piece) and
        {key: tensor or value}; in bf16/fp16 the fp32 masters under "master_param"."""
        out = {}
        for e in self.entries:
            chunk = (e.shard.lo, e.shard.hi) if e.mode in ("chunk", "zero3") and e.shard.size > 1 else None
            st = dict(self.state.get(e.master, {}))
            if self.precision != "fp32":
                st["master_param"] = e.master
            out[e.fqn] = (chunk, st)
        return out

    def load_local_state(self, fqn: str, state: dict[str, Any]) -> None:
        """Install one parameter's state as `local_state` gives it (tensors of this rank's chunk or
        piece). Without "master_param" a master that is a copy is re-read from the parameter (load
        the module first)."""
        self.module.param_gather.wait_all()  # masters re-read from parameters below: settled first
        e = next((e for e in self.entries if e.fqn == fqn), None)
        if e is None:
            raise KeyError(f"this rank's optimizer holds no parameter {fqn!r}")
        st = {}
        with torch.no_grad():
            for k, val in state.items():
                if k == "master_param":
                    if e.master is not e.param:
                        e.master.copy_(val.reshape(e.master.shape))
                    continue
                if torch.is_tensor(val) and val.dim() >= 1 and val.numel() == e.master.numel():
                    val = val.reshape(e.master.shape).to(e.master.device, e.master.dtype)
                st[k] = val
            if e.master is not e.param and "master_param" not in state:
                src = e.param.detach().reshape(-1)
                e.master.copy_(e.shard.owned(src) if e.mode == "chunk" else src.view_as(e.master))
        self.state[e.master] = st
        e.version = e.param._version

    def group_names(self) -> list[dict[str, Any]]:
        """The parameter groups with parameters by name (this rank's parameters only)."""
        fqn_of = {id(e.master): e.fqn for e in self.entries}
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(t)] for t in g["params"]]}
                for g in self.param_groups]

    def load_full_state_dict(self, sd: dict[str, Any]) -> None:
        """Keep this rank's pieces of a whole optimizer state (as `full_state_dict` writes it)."""
        self.module.param_gather.wait_all()  # masters re-read from parameters below: settled first
        m = self.module
        states = sd.get("state", {})
        missing = [e.fqn for e in self.entries if e.fqn not in states]
        if states and missing:
            raise KeyError(f"optimizer state lacks {len(missing)} parameter(s) this rank holds: {missing[:8]}")
        by_fqn = {}
        for v in m.held_keys:
            by_fqn.setdefault(m.program.shards[v].fqn, v)
        with torch.no_grad():
            for e in self.entries:
                if e.fqn not in states:
                    continue
                s = m.program.shards[by_fqn[e.fqn]]
                st = {}
                for k, val in states[e.fqn].items():
                    if torch.is_tensor(val) and tuple(val.shape) == tuple(s.layout.shape) and val.dim() >= 1:
                        piece = s.layout.slice_full(val, m.unit_device).reshape(-1)
                        if e.mode in ("chunk", "zero3") and e.shard.size > 1:
                            piece = e.shard.owned(piece)
                        piece = piece.reshape(e.master.shape).to(e.master.device, e.master.dtype, copy=True)
                        if k == "master_param":
                            if e.master is not e.param:
                                e.master.copy_(piece)
                            continue
                        st[k] = piece
                    else:
                        st[k] = val.clone() if torch.is_tensor(val) else val
                if e.master is not e.param and "master_param" not in states[e.fqn]:
                    # fp32 state has no masters: the parameter (loaded first) is the master's value
                    src = e.param.detach().reshape(-1)
                    e.master.copy_(e.shard.owned(src) if e.mode == "chunk" else src.view_as(e.master))
                self.state[e.master] = st
                e.version = e.param._version
        for g, saved in zip(self.param_groups, sd.get("param_groups", [])):
            g.update({k: v for k, v in saved.items() if k != "params"})


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i: one foreach copy on one device; between host and device
    (offload) tensor by tensor, asynchronous from pinned memory, then waited for."""
    if all(d.device == s.device for d, s in zip(dst, src)):
        torch._foreach_copy_(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)
    if any(t.device.type == "cuda" for t in dst + src):
        torch.cuda.synchronize()


def _grouped(entries: list[_Entry], spec: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """torch's parameter groups over the masters. Parameters are named by their fully-qualified
    names in the model, since each rank holds pieces, not the model's own tensors: a group's
    "params" is a list of names or a predicate `fn(name) -> bool`. Every parameter falls in exactly
    one group, so that every rank has the same groups in the same order (schedulers rely on it)."""
    if spec is None:
        return [{"params": [e.master for e in entries]}]
    matchers = []
    for i, g in enumerate(spec):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"param_groups[{i}] must be a dict with 'params' (names or a predicate on names)")
        sel = g["params"]
        if callable(sel):
            matchers.append(sel)
            continue
        names = list(sel)
        if any(not isinstance(n, str) for n in names):
            raise TypeError(f"param_groups[{i}]['params'] must name parameters by their fully-qualified names "
                            "(model.named_parameters() gives them) or be a predicate on names; this rank holds "
                            "pieces of the tensors, not the model's own")
        matchers.append(frozenset(names).__contains__)
    out = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in spec]
    unmatched, doubled = [], []
    for e in entries:
        hits = [i for i, m in enumerate(matchers) if m(e.fqn)]
        if not hits:
            unmatched.append(e.fqn)
        elif len(hits) > 1:
            doubled.append(f"{e.fqn} (groups {hits})")
        else:
            out[hits[0]]["params"].append(e.master)
    if unmatched or doubled:
        raise ValueError("param_groups must place every trainable parameter in exactly one group: "
                         + (f"in none: {unmatched[:8]}" if unmatched else "")
                         + ("; " if unmatched and doubled else "") + (f"in several: {doubled[:8]}" if doubled else ""))
    return out


def build_optimizer(module: Any, optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
                    param_groups: Optional[list[dict[str, Any]]] = None, **kwargs: Any) -> ParallelOptimizer:
    """The optimizer for a ParallelModule, sharded per its plan's ZeRO stage, stepping fp32 masters
    in bf16/fp16 (see this module's docstring). Call on every rank.

    `param_groups=[{"params": names or fn(name) -> bool, "weight_decay": 0.0}, ...]` splits the
    parameters into torch parameter groups by their names in the model (e.g. no weight decay on
    biases and norms); `kwargs` are the defaults every group starts from."""
    from nnscaler_plugins.runtime.parallel_module import ParallelModule

    if not isinstance(module, ParallelModule):
        raise TypeError(f"build_optimizer takes the module nns.parallelize returned, got {type(module).__name__}; "
                        "for a plain model use the optimizer class directly")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
                        f"got {optimizer_cls!r}")
    return ParallelOptimizer(module, optimizer_cls, param_groups=param_groups, **kwargs)
