"""What users give as a plan, understood in one place.

`nns.plan(strategy=...)`, `nns.parallelize(plan=...)`, Lightning's `NNScalerStrategy(plan=...)`,
the HF Trainer's `plan=` and a DeepSpeed config's "nnscaler" section all take the same values: a
registered strategy name, a function `fn(builder, **options)`, a ready `Plan`, or a plan file.
`resolve` turns any of them into a `PlanSource` that knows its options, the degrees it asks for on
a world size, and how to name itself in messages, so every entry point checks and sizes a plan
the same way before anything is captured or launched.
"""
from __future__ import annotations

import difflib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.plan.knobs import KNOB_OPTIONS, Knobs
from nnscaler_plugins.plan.mesh import AXIS_WORDS, Mesh, MeshLayout, resolve_mesh, unit_mesh
from nnscaler_plugins.plan.plan import OFFLOADS, PRECISIONS, Plan
from nnscaler_plugins.plugins import get_strategy, strategies

PlanLike = Union[str, os.PathLike, Callable, Plan]

#: Options every strategy takes, whatever it declares: `nns.plan` consumes them itself (the training
#: fields of the plan, the micro-batch count, what planning for a cluster needs, and the typed knobs
#: of `knobs.KNOB_OPTIONS`: the overlap switches, compile, and the fault settings).
COMMON_OPTIONS = frozenset({"zero", "precision", "offload", "micro_batches", "micro_batch_size", "cluster",
                            "constraints"}) | KNOB_OPTIONS

#: The layout of a strategy that says nothing of its degrees: `tp=` devices per replica (default:
#: the whole world), `dp=` replicas.
_BARE = MeshLayout(("dp", "unit"), fill=("unit", "dp"))


@dataclass(frozen=True)
class PlanSource:
    """A resolved plan-like value: exactly one of `fn` (a strategy) or `plan` (a ready Plan) is set."""

    label: str  # for messages: "strategy 'tp'", "the plan file 'p.json'", ...
    name: str  # the strategy name a new plan records
    fn: Optional[Callable] = None
    plan: Optional[Plan] = None

    @property
    def is_plan(self) -> bool:
        return self.plan is not None

    def options(self) -> Optional[frozenset]:
        """Option names it takes besides COMMON_OPTIONS; None when they cannot be known."""
        return frozenset() if self.plan is not None else strategy_options(self.fn)

    def check_options(self, options: Mapping[str, Any], where: str = "") -> None:
        """Refuse option names it does not take, each with the closest valid name, and values of the
        options every strategy takes that no plan could have (`check_option_values`)."""
        own = self.options()
        if own is not None:
            unknown = [k for k in options if k not in own and k not in COMMON_OPTIONS]
            if unknown:
                raise PlanError(unknown_options_message(self.label, unknown, own, where))
        check_option_values(options, where)

    def mesh(self, world_size: int, options: Mapping[str, Any]) -> Mesh:
        """The plan's mesh on `world_size` devices from the degree options (`mesh.resolve_mesh`, the one
        place options become degrees): a strategy's `mesh` layout; for a third-party strategy with only
        `degrees(world_size, **options) -> (unit_size, dp)`, the bare {"dp", "unit"}. A ready plan says
        its own and must have been made for this world size."""
        if self.plan is not None:
            if self.plan.world_size != world_size:
                raise PlanError(f"{self.label} is for world size {self.plan.world_size} ({self.plan.mesh.describe()}) "
                                f"but the job has {world_size} processes; make a plan for {world_size} or launch "
                                f"{self.plan.world_size}")
            return self.plan.mesh
        own = {k: v for k, v in options.items() if k not in COMMON_OPTIONS}
        layout = getattr(self.fn, "mesh", None)
        if isinstance(layout, MeshLayout):
            return resolve_mesh(layout, world_size, own, self.name)
        deg = getattr(self.fn, "degrees", None)
        if deg is not None:
            unit, dp = deg(world_size, **own)
            if unit * dp != world_size:
                raise PlanError(f"{self.label} with {dict(own)} gives {dp} x {unit} devices, but world size is "
                                f"{world_size}; choose degrees whose product is {world_size}")
            return unit_mesh(unit, dp)
        return resolve_mesh(_BARE, world_size, {"unit": own.get("tp"), "dp": own.get("dp")}, self.name)

    def mesh_before_capture(self, world_size: int, options: Mapping[str, Any]) -> Optional[Mesh]:
        """The mesh when it is fixed before any graph exists: a ready plan's, a strategy's with a `mesh`
        layout or `degrees`; None for one that chooses its degrees from the captured graph (its
        `mesh_after_capture`, as auto's search) or says nothing of them (a bare function)."""
        if self.plan is not None:
            return self.plan.mesh
        if getattr(self.fn, "mesh_after_capture", False):
            return None
        if isinstance(getattr(self.fn, "mesh", None), MeshLayout) or getattr(self.fn, "degrees", None) is not None:
            return self.mesh(world_size, options)
        return None

    def degrees(self, world_size: int, options: Mapping[str, Any]) -> tuple[int, int]:
        """(devices per model replica, data-parallel replicas): `mesh(...)`'s unit and replicas."""
        mesh = self.mesh(world_size, options)
        return mesh.unit_size, mesh.replicas

    def call(self, builder: Any, options: Mapping[str, Any]) -> None:
        """Run the strategy on a builder with the options it takes (all of them when it takes **)."""
        assert self.fn is not None
        params = inspect.signature(self.fn).parameters
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
        self.fn(builder, **(dict(options) if takes_any else {k: v for k, v in options.items() if k in params}))


def resolve(value: PlanLike, where: str = "") -> PlanSource:
    """The PlanSource of a strategy name, a function, a Plan or a plan file; a clear error naming
    the registered strategies (or the missing file) otherwise. `where` prefixes messages."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, Plan):
        return PlanSource(f"a ready Plan (made by strategy {value.strategy!r})", value.strategy, plan=value)
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value.endswith(".json")):
        path = os.fspath(value)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{prefix}{path!r}: no such plan file")
        p = Plan.load(path)
        return PlanSource(f"the plan file {path!r}", p.strategy, plan=p)
    if isinstance(value, str):
        try:
            fn = get_strategy(value)
        except KeyError:
            raise PlanError(f"{prefix}unknown strategy {value!r}; registered: {', '.join(strategies())} "
                            "(or pass a Plan, a plan .json file or a function)") from None
        return PlanSource(f"strategy {value!r}", value, fn=fn)
    if callable(value):
        name = getattr(value, "name", None) or getattr(value, "__name__", None) or type(value).__name__
        return PlanSource(f"strategy {name!r}", str(name), fn=value)
    raise TypeError(f"{prefix}a plan is a strategy name, a function, a Plan or a plan file; "
                    f"got {type(value).__name__}")


def check_option_values(options: Mapping[str, Any], where: str = "") -> None:
    """Refuse, where the user wrote them (before a world size, a model or a process group exists),
    values no plan could take: the knobs (each checked as the plan checks it), the ZeRO stage,
    precision, offload, micro-batch counts, and degrees (dp=, tp=, pp=, ...) that are not positive
    integers. PlanError names the option, the value and what is allowed."""
    at = f"{where}: " if where else ""
    options = {k: v for k, v in options.items() if v is not None}  # None: the default
    knobs = {k: v for k, v in options.items() if k in KNOB_OPTIONS}
    if knobs:
        try:
            Knobs(**knobs)
        except PlanError as e:
            raise PlanError(f"{at}{e}") from None
    if "zero" in options and (isinstance(options["zero"], bool) or options["zero"] not in (0, 1, 2, 3)
                              or not isinstance(options["zero"], int)):
        raise PlanError(f"{at}zero={options['zero']!r}: the ZeRO stage must be 0 (off), 1 (optimizer state sharded), "
                        "2 (+ gradients) or 3 (+ parameters)")
    if "precision" in options and options["precision"] not in PRECISIONS:
        raise PlanError(f"{at}precision={options['precision']!r}: choose one of {', '.join(PRECISIONS)}")
    if "offload" in options and options["offload"] not in OFFLOADS and options["offload"] != "nvme":
        raise PlanError(f"{at}offload={options['offload']!r}: choose None, 'optimizer' or 'params'")
    for name in ("micro_batches", "micro_batch_size", *AXIS_WORDS):
        v = options.get(name)
        if v is None:
            continue
        whole = isinstance(v, int) or (name in AXIS_WORDS and isinstance(v, float) and v.is_integer())
        if isinstance(v, bool) or not whole or v < 1:
            what = f"a degree: {AXIS_WORDS[name]}" if name in AXIS_WORDS else "a count"
            raise PlanError(f"{at}{name}={v!r}: must be a positive integer ({what})")


def check_options(value: PlanLike, options: Mapping[str, Any], where: str = "") -> None:
    """`resolve(value).check_options(options)`: what every entry point calls before it starts."""
    resolve(value, where).check_options(options, where)


def strategy_options(strategy: Any) -> Optional[frozenset]:
    """The option names a strategy takes besides `COMMON_OPTIONS`, or None when they cannot be known.

    A strategy declares them as an `options` attribute (an iterable of names; the built-in `Strategy`
    objects carry one, a plain function may be given one like `degrees`), besides the degree options
    its `mesh` layout names (dp, tp, pp, ...). Without it, a plain
    function takes its keyword parameters (after `builder`), those of its `degrees` function, and,
    when it has no `degrees`, `tp` and `dp` (which `nns.plan` reads to size the unit). A function
    with `**options` and no declaration may take anything: its options are not checked.
    """
    if isinstance(strategy, (Plan, os.PathLike)) or (isinstance(strategy, str) and strategy.endswith(".json")):
        return frozenset()
    declared = getattr(strategy, "options", None)
    layout = getattr(strategy, "mesh", None)
    degree_names = frozenset(layout.degree_options) if isinstance(layout, MeshLayout) else frozenset()
    if declared is not None and not callable(declared):
        return frozenset(declared) | degree_names
    # an object that wraps its function (the built-in `Strategy` without `options`): that function's
    apply = getattr(strategy, "apply", None)
    names = _keyword_parameters(apply if callable(apply) else strategy, skip=1)
    if names is None:
        return None
    layout = getattr(strategy, "mesh", None)
    degrees = getattr(strategy, "degrees", None)
    if isinstance(layout, MeshLayout):
        names |= set(layout.degree_options)
    elif degrees is None:
        names |= {"tp", "dp"}
    else:
        names |= _keyword_parameters(degrees, skip=1) or set()
    return frozenset(names)


def _keyword_parameters(fn: Callable, skip: int) -> Optional[set]:
    """Names `fn` takes by keyword, past its first `skip` parameters; None when it takes **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[skip:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def unknown_options_message(label: str, unknown: Iterable[str], own: Iterable[str], where: str = "") -> str:
    own = sorted(own)
    valid = own + sorted(COMMON_OPTIONS)
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else "no valid option is close to it"
        parts.append(f"{label} has no option {name!r} ({hint})")
    takes = f"its options: {', '.join(own)}" if own else "it takes no options of its own"
    return ((where + ": ") if where else "") + "; ".join(parts) + \
        f". {takes[0].upper() + takes[1:]}; every strategy also takes {', '.join(sorted(COMMON_OPTIONS))}"
