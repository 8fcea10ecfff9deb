"""Real weights for a model built on the meta device, one module at a time, by the model's own
initialization, without ever holding the whole model.

A model built under `torch.device("meta")` (or HF `from_config` under it, or accelerate's
`init_empty_weights`) has shapes but no values. `materialize` gives them values the way the model
would have on a CPU: per module, in post-order (children before their parent, as `Module.apply`
and HF's `initialize_weights` go), the module's `reset_parameters()` (what its constructor ran),
then, inside a Hugging Face `PreTrainedModel`, the nearest such model's `_init_weights(module)`
(what `post_init` runs). Tied weights are one tensor: its last writer decides its value, as in eager.

Why the values do not depend on the plan or the world size: each module's initialization draws
from the CPU generator seeded with `module_seed(seed, name)`, a hash of the base seed and the
module's qualified name, inside `torch.random.fork_rng` (the caller's generator is untouched).
A rank can therefore initialize only the modules that write tensors it holds, in any order, and
get the same values as one process initializing everything; `init_weights(model, seed)` is that
one process, the reference a test or a user compares with.

Which module writes which tensor is found first by running every initialization on the meta
tensors under a dispatch mode that records each op's accesses (GPT-2's attention re-initializes
its child `c_proj.weight`; an embedding's init writes a tied head). An op that overwrites a whole
tensor without reading it (normal_, uniform_, fill_, zero_, copy_) makes everything before it
irrelevant to that tensor's value, so only the modules from each needed tensor's last such
overwrite on run (a tied weight is made by its last writer alone). While they run, a tensor's
memory exists only from the op that first needs it to its last op, where it is handed to `take`
and freed, or to an op that overwrites it whole: a rank holds its shards plus the tensor the
current op writes (and a tensor a later op reads, which no usual init does). Buffers no initialization writes (a
causal mask, `position_ids`, rotary frequencies computed in `__init__`) are recomputed by
constructing their module again, or its Hugging Face model from its config, with parameters on
the meta device and buffers real. A parameter or buffer nothing can reproduce is refused by name
(`InitError`) before any value is used: never an uninitialized tensor and a nan first loss.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from nnscaler_plugins.errors import PlanError


class InitError(PlanError):
    """A meta-device model whose initial values cannot be reproduced (names the tensors)."""


def has_meta_tensors(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of `model` lives on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def module_seed(seed: int, module_name: str) -> int:
    """The CPU generator's seed for initializing module `module_name` ("" is the root)."""
    digest = hashlib.sha256(f"{int(seed)}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Initialize every parameter and buffer of `model` in place by the scheme `materialize` uses
    (meta tensors become real CPU tensors); returns `model`. The one-process reference: a model
    parallelized from the meta device with `init_seed=seed` starts from exactly these values."""
    plan = plan_init(model, names=None)  # real tensors no initialization writes keep their values
    run_init(model, plan, seed, take=None, keep=True)
    return model


@dataclass
class InitPlan:
    """What initializing a meta model will do: modules in post-order with the tensors (canonical
    names) each writes; per tensor its names (tied copies) and its last writer; buffers to rebuild."""

    order: list[tuple[str, torch.nn.Module, list[str]]]
    names: dict[str, list[str]]  # canonical name -> every name of that tensor
    tensors: dict[str, torch.Tensor]  # canonical name -> the model's tensor object
    last_writer: dict[str, int] = field(default_factory=dict)
    first_writer: dict[str, int] = field(default_factory=dict)
    rebuilt: dict[str, torch.Tensor] = field(default_factory=dict)  # buffers recomputed by construction
    # Per module of `order`, its initialization's ops that touch the tensors, each as
    # (canonical name, "full" | "write" | "read") pairs: "full" overwrites the whole tensor without
    # reading it (normal_, uniform_, fill_, zero_, copy_ of the whole), so nothing before it matters.
    ops: list[list[list[tuple[str, str]]]] = field(default_factory=list)


def plan_init(model: torch.nn.Module, names: Optional[set[str]], check_all: bool = True) -> InitPlan:
    """Dry-run every module's initialization on the meta tensors, recording what it writes.
    `names`: the tensors needed (any of their names); None for all. Refuses (`InitError`) meta
    tensors nothing reproduces: all of them with `check_all`, so every rank refuses alike."""
    canon, names_of, tensors = _canonical_names(model)
    with _meta_only(tensors, canon):
        order, ops = _record_writes(model, canon, {n: t.numel() for n, t in tensors.items()})
    plan = InitPlan(order, names_of, tensors, ops=ops)
    for i, (_, _, wrote) in enumerate(order):
        for n in wrote:
            plan.first_writer.setdefault(n, i)
            plan.last_writer[n] = i
    unwritten = [n for n, t in tensors.items() if t.is_meta and n not in plan.last_writer]
    wanted = unwritten if check_all or names is None else [
        n for n in unwritten if any(a in names for a in names_of[n])]
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    refused = [n for n in wanted if any(a in params for a in names_of[n])]
    buffers = [n for n in wanted if n not in refused]
    plan.rebuilt = _rebuild_buffers(model, buffers)
    refused += [n for n in buffers if n not in plan.rebuilt]
    if refused:
        owners = ", ".join(f"{n} ({type(model.get_submodule(n.rpartition('.')[0])).__name__})" for n in refused[:8])
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        raise InitError(f"the model is on the meta device, and nothing reproduces the initial values of {owners}{more}: "
                        "their modules have no reset_parameters() (nor a Hugging Face _init_weights that writes "
                        "them) and cannot be constructed again. Give those modules a reset_parameters(), or build "
                        "the model on a real device")
    if names is not None:  # drop modules whose writes do not decide a value this rank needs
        need = {n for n, ns in names_of.items() if any(a in names for a in ns)}
        keep = _deciding_modules(plan.ops, need)
        plan.order = [plan.order[i] for i in keep]
        plan.ops = [plan.ops[i] for i in keep]
        plan.first_writer, plan.last_writer = {}, {}
        for i, (_, _, wrote) in enumerate(plan.order):
            for n in wrote:
                plan.first_writer.setdefault(n, i)
                plan.last_writer[n] = i
    return plan


def _deciding_modules(ops: list[list[list[tuple[str, str]]]], need: set[str]) -> list[int]:
    """The modules (indices into `ops`) to run for the values of `need`: those that touch a needed
    tensor at or after its last whole overwrite (earlier writes are overwritten: a tied weight's
    value is its last writer's), and, for what those read, the same again."""
    last_full: dict[str, tuple[int, int]] = {}
    for i, module_ops in enumerate(ops):
        for k, acc in enumerate(module_ops):
            for n, kind in acc:
                if kind == "full":
                    last_full[n] = (i, k)
    need = set(need)
    keep: set[int] = set()
    while True:
        more = set()
        for i, module_ops in enumerate(ops):
            for k, acc in enumerate(module_ops):
                if any(n in need and (i, k) >= last_full.get(n, (-1, -1)) for n, _ in acc):
                    keep.add(i)
                    more.update(n for n, kind in acc if kind == "read")
        if more <= need:
            return sorted(keep)
        need |= more


def _record_writes(model: torch.nn.Module, canon: dict, numel: dict[str, int]
                   ) -> tuple[list[tuple[str, torch.nn.Module, list[str]]], list[list[list[tuple[str, str]]]]]:
    """Each module's initialization run on meta tensors, in post-order: (name, module, the
    canonical names of the tensors it writes) for the modules that write any, and per such module
    its ops' accesses to the tensors (see `InitPlan.ops`)."""
    order, ops = [], []
    recorder = _WriteRecorder(canon, numel)
    for mname, module in _post_order(model):
        fn = _init_fn(model, mname, module)
        if fn is None:
            continue
        recorder.written = []
        recorder.ops = []
        try:
            with recorder, torch.no_grad():
                fn()
        except Exception as e:  # noqa: BLE001 - named with the module, as a refusal
            raise InitError(f"initializing {type(module).__name__} {mname or '(root)'} on the meta device "
                            f"failed ({type(e).__name__}: {e}); build the model on a real device, or "
                            "give the module a reset_parameters() that works on any device") from e
        wrote = list(dict.fromkeys(recorder.written))
        if wrote:
            order.append((mname, module, wrote))
            ops.append(recorder.ops)
    return order, ops


def run_init(model: torch.nn.Module, plan: InitPlan, seed: int,
             take: Optional[Callable[[list[str], torch.Tensor], None]], keep: bool = False) -> int:
    """Run the planned initializations on CPU (its generator, so the values do not depend on the
    device). With `take`, each tensor's final value is given to `take(names, tensor)` right after
    the last op that writes it and its memory freed, and a tensor's memory exists only from the op
    that first needs it (`_OneAtATime`): the whole tensors held at once are the ones the current op
    touches. Rebuilt buffers are given to `take` first. `keep=True` (for `init_weights`): every
    tensor is left real. Returns the peak bytes of whole tensors held at once (what a rank holds
    beyond its shards while materializing)."""
    peak = sum(v.numel() * v.element_size() for v in plan.rebuilt.values())
    if take is not None:
        for n, value in plan.rebuilt.items():
            take(plan.names[n], value.to(plan.tensors[n].dtype))
    touched = {n for module_ops in plan.ops for acc in module_ops for n, _ in acc}
    managed = {n for n in touched if plan.tensors[n].is_meta}
    if keep:
        for n in managed:
            move_tensor(plan.tensors[n], "cpu")
    else:
        for n in managed:  # real tensors with no memory yet: `_OneAtATime` sizes each when it is used
            move_tensor(plan.tensors[n], "cpu")
            plan.tensors[n].untyped_storage().resize_(0)
    canon = {StorageWeakRef(t.untyped_storage()): n for n, t in plan.tensors.items() if not t.is_meta}

    def final(n: str) -> None:
        if take is not None:
            take(plan.names[n], plan.tensors[n].detach())

    mode = _OneAtATime(plan, canon, managed, final)
    for mname, module, _ in plan.order:
        fn = _init_fn(model, mname, module)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), mode if not keep else contextlib.nullcontext():
            torch.manual_seed(module_seed(seed, mname))
            fn()
    if not keep:
        for n in managed:
            move_tensor(plan.tensors[n], "meta")
    for n, value in plan.rebuilt.items():
        if keep:
            move_tensor(plan.tensors[n], "cpu", value.to(plan.tensors[n].dtype))
    return max(peak, mode.peak)


def materialize_in_place(model: torch.nn.Module, seed: int) -> None:
    """The meta tensors of `model` made real on CPU by the same scheme, the real ones left as they
    are (a module whose initialization writes both rewrites both): for the parts of a model that
    stay outside a plan (a Lightning module's other submodules built under its meta context)."""
    meta = {n for n, t in list(model.named_parameters(remove_duplicate=False)) +
            list(model.named_buffers(remove_duplicate=False)) if t.is_meta}
    if meta:
        run_init(model, plan_init(model, meta), seed, take=None, keep=True)


def move_tensor(t: torch.Tensor, device: Any, value: Optional[torch.Tensor] = None) -> None:
    """`t` becomes an (uninitialized) tensor on `device`, or `value`, keeping its identity: a tied
    weight is one object under several names, and modules keep pointing at it."""
    new = torch.empty_like(t, device=device) if value is None else value
    if isinstance(t, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, new)


def materialize(model: torch.nn.Module, seed: int, take: Callable[[list[str], torch.Tensor], None],
                names: Optional[set[str]] = None) -> int:
    """Initialize `model`'s meta tensors module by module and hand each to `take(names, tensor)`
    (on CPU, the whole tensor) once final; the model stays on the meta device. `names`: only the
    tensors needed (a rank's shards); the modules that write none of them are not run. Returns
    the peak bytes of whole tensors held at once. Works on a copy of the modules, so `model`
    itself is left as it was."""
    work = _working_copy(model)
    plan = plan_init(work, names)
    return run_init(work, plan, seed, take)


def _working_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model's modules copied with new tensor objects (meta ones new meta tensors, real ones
    sharing their storage, ties kept): materializing swaps tensors in place, which the user's own
    objects may refuse (capture leaves weak references on them) and should not see. The model
    itself when it refuses to be copied."""
    memo: dict[int, object] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            alias = torch.empty_like(t, device="meta") if t.is_meta else t.detach()
            memo[id(t)] = torch.nn.Parameter(alias, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else alias
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - an object that refuses deepcopy: work on the model itself
        return model


# -- which init runs per module --------------------------------------------------------------------
def _init_fn(root: torch.nn.Module, mname: str, module: torch.nn.Module) -> Optional[Callable[[], None]]:
    """The module's own initialization: `reset_parameters()` (its constructor's), then the nearest
    enclosing Hugging Face model's `_init_weights(module)` (its `post_init`); None when neither."""
    steps: list[Callable[[], None]] = []
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        steps.append(reset)
    hf = _hf_owner(root, mname)
    if hf is not None:
        steps.append(lambda: hf._init_weights(module))
    if not steps:
        return None

    def run() -> None:
        for s in steps:
            s()
    return run


def _hf_owner(root: torch.nn.Module, mname: str) -> Optional[torch.nn.Module]:
    """The innermost Hugging Face PreTrainedModel containing module `mname` (itself included), as
    HF's `initialize_weights` dispatches to sub-models' own init."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is optional
        return None
    owner = root if isinstance(root, PreTrainedModel) else None
    parts = mname.split(".") if mname else []
    m = root
    for p in parts:
        m = getattr(m, p)
        if isinstance(m, PreTrainedModel):
            owner = m
    return owner


def _post_order(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module), children before parents, each module once (as Module.apply)."""
    seen: set[int] = set()

    def walk(prefix: str, m: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        for n, c in m.named_children():
            if id(c) in seen:
                continue
            seen.add(id(c))
            yield from walk(f"{prefix}.{n}" if prefix else n, c)
        yield prefix, m
    seen.add(id(model))
    yield from walk("", model)


# -- recording writes on meta tensors ---------------------------------------------------------------
def _tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _canonical_names(model: torch.nn.Module) -> tuple[dict, dict[str, list[str]], dict[str, torch.Tensor]]:
    """Storage -> canonical name (the first name of a tied tensor), canonical -> all names, and
    canonical -> tensor."""
    canon: dict[Any, str] = {}
    names_of: dict[str, list[str]] = {}
    tensors: dict[str, torch.Tensor] = {}
    by_id: dict[int, str] = {}
    items = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for n, t in items:
        if id(t) in by_id:
            names_of[by_id[id(t)]].append(n)
            continue
        by_id[id(t)] = n
        names_of[n] = [n]
        tensors[n] = t
        canon[StorageWeakRef(t.untyped_storage())] = n
    return canon, names_of, tensors


# In-place ops whose result does not depend on what the tensor held.
_OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "geometric_",
               "cauchy_", "log_normal_", "copy_"}


def _accesses(func: Any, args: tuple, kwargs: dict, canon: dict, numel: dict[str, int]) -> list[tuple[str, str]]:
    """The tensors of `canon` an op touches: (canonical name, "full" | "write" | "read"); views
    (which touch no values) and tensors not in `canon` are left out."""
    schema = func._schema
    writes: dict[str, str] = {}
    reads: set[str] = set()
    is_view = any(r.alias_info is not None for r in schema.returns) and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if is_view:
        return []
    overwrite = schema.name.split("::")[-1] in _OVERWRITES
    for i, a in enumerate(schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name)
        written = a.alias_info is not None and a.alias_info.is_write
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if not isinstance(t, torch.Tensor):
                continue
            name = canon.get(StorageWeakRef(t.untyped_storage()))
            if name is None:
                continue
            if not written:
                reads.add(name)
            elif overwrite and i == 0 and t.numel() == numel[name] and t.storage_offset() == 0 and t.is_contiguous():
                writes.setdefault(name, "full")
            else:
                writes[name] = "write"
    out = [(n, "read" if n in reads and k == "full" else k) for n, k in writes.items()]
    return out + [(n, "read") for n in reads if n not in writes]


class _WriteRecorder(TorchDispatchMode):
    """Records the canonical names of the tensors any op writes in place, and each op's accesses."""

    def __init__(self, canon: dict, numel: dict[str, int]):
        super().__init__()
        self.canon = canon
        self.numel = numel
        self.written: list[str] = []
        self.ops: list[list[tuple[str, str]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        acc = _accesses(func, args, kwargs, self.canon, self.numel)
        if acc:
            self.ops.append(acc)
            self.written += [n for n, kind in acc if kind != "read"]
        return func(*args, **kwargs)


class _OneAtATime(TorchDispatchMode):
    """Runs the planned initializations with each tensor's memory present only while its value is
    still to be used: allocated at the op that first touches it, handed to `final` and freed after
    the last op the plan has for it, and freed early when its next op overwrites it whole. Tensors
    are created with empty storages and resized (their identity, views and ties stay)."""

    def __init__(self, plan: InitPlan, canon: dict, managed: set[str], final: Callable[[str], None]):
        super().__init__()
        self.plan, self.canon, self.managed, self.final = plan, canon, managed, final
        self.numel = {n: t.numel() for n, t in plan.tensors.items()}
        self.todo: dict[str, list[str]] = {}  # name -> kinds of its remaining ops, in order
        for module_ops in plan.ops:
            for acc in module_ops:
                for n, kind in acc:
                    self.todo.setdefault(n, []).append(kind)
        for v in self.todo.values():
            v.reverse()
        self.live = 0
        self.peak = 0

    def allocate(self, n: str) -> None:
        if n not in self.managed:  # a real tensor of a partly meta model: always there
            return
        st = self.plan.tensors[n].untyped_storage()
        want = self.numel[n] * self.plan.tensors[n].element_size()
        if st.nbytes() < want:
            st.resize_(want)
            self.live += want
            self.peak = max(self.peak, self.live)

    def free(self, n: str) -> None:
        if n not in self.managed:
            return
        st = self.plan.tensors[n].untyped_storage()
        if st.nbytes():
            self.live -= st.nbytes()
            st.resize_(0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        acc = _accesses(func, args, kwargs, self.canon, self.numel)
        for n, _ in acc:
            todo = self.todo.get(n)
            if not todo:
                raise InitError(f"initializing {n} on CPU ran an op ({func}) its dry run on the meta device did "
                                "not: its initialization depends on the device; build the model on a real device")
            if n in self.managed and self.plan.tensors[n].untyped_storage().nbytes() == 0 and todo[-1] != "full":
                raise InitError(f"initializing {n} on CPU read a value its dry run on the meta device did not "
                                f"(op {func}); build the model on a real device")
            self.allocate(n)
        out = func(*args, **kwargs)
        for n, _ in acc:
            todo = self.todo[n]
            todo.pop()
            if not todo:
                self.final(n)
                self.free(n)
            elif todo[-1] == "full":
                self.free(n)
        return out


@contextlib.contextmanager
def _meta_only(tensors: dict[str, torch.Tensor], canon: dict) -> Iterator[None]:
    """The dry run writes nothing real: tensors already real (buffers under `init_empty_weights`,
    a partly meta model) are swapped for meta stand-ins of the same storage identity for its span."""
    real = [(n, t) for n, t in tensors.items() if not t.is_meta]
    saved = {}
    try:
        for n, t in real:
            ref = StorageWeakRef(t.untyped_storage())
            saved[n] = t.detach()
            move_tensor(t, "meta")
            canon[StorageWeakRef(t.untyped_storage())] = canon.pop(ref, n)
        yield
    finally:
        for n, t in real:
            if n in saved:
                ref = StorageWeakRef(t.untyped_storage())
                move_tensor(t, "cpu", saved[n])
                canon[StorageWeakRef(t.untyped_storage())] = canon.pop(ref, n)


# -- buffers computed in constructors ---------------------------------------------------------------
def _rebuild_buffers(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Real values of meta buffers `names` (canonical) that no initialization writes, by
    constructing their module again (arguments from its attributes) or its Hugging Face model
    from its config, with parameters on meta; only values whose shape and dtype match are kept."""
    out: dict[str, torch.Tensor] = {}
    by_module: dict[str, list[str]] = {}
    for n in names:
        by_module.setdefault(n.rpartition(".")[0], []).append(n)
    for mname, bufs in by_module.items():
        module = model.get_submodule(mname)
        fresh = _construct_again(module)
        for n in bufs:
            local = n.rpartition(".")[2]
            got = None if fresh is None else fresh._buffers.get(local)
            if got is None:
                got = _from_hf_owner(model, n)
            want = model.get_buffer(n)
            if got is not None and not got.is_meta and tuple(got.shape) == tuple(want.shape):
                out[n] = got.to(want.dtype)
    return out


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Constructors run with every parameter put on the meta device as it is registered, buffers
    left where the constructor computes them (accelerate's `init_empty_weights(include_buffers=False)`)."""
    original = torch.nn.Module.register_parameter

    def register(self: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)
    torch.nn.Module.register_parameter = register
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.nn.Module.register_parameter = original


def _construct_again(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """`type(module)(...)` with each constructor argument read from the module's attribute of the
    same name (required ones must exist); None when that is not possible."""
    cls = type(module)
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None
    kwargs = {}
    for p in list(sig.parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if hasattr(module, p.name) and not isinstance(getattr(module, p.name), (torch.Tensor, torch.nn.Module)):
            kwargs[p.name] = getattr(module, p.name)
        elif p.default is p.empty:
            return None
    try:
        with _parameters_on_meta():
            return cls(**kwargs)
    except Exception:  # noqa: BLE001 - any failure: this way cannot rebuild it
        return None


def _from_hf_owner(model: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    """Buffer `name` of the enclosing Hugging Face model built again from its config."""
    owner = _hf_owner(model, name.rpartition(".")[0])
    if owner is None:
        return None
    prefix = next((n for n, m in model.named_modules() if m is owner), None)
    if prefix is None:
        return None
    rel = name[len(prefix) + 1:] if prefix else name
    try:
        with _parameters_on_meta():
            fresh = type(owner)(owner.config)
        return fresh.get_buffer(rel)
    except Exception:  # noqa: BLE001 - cannot be rebuilt this way
        return None
