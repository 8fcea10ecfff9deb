"""The typed mesh: a plan's devices as named axes, the one source of its degrees.

    plan.mesh.axes        {"dp": 2, "pp": 2, "tp": 2}      ordered outer to inner, product = world size
    plan.mesh["tp"]       2   (1 for an axis the plan does not have)
    plan.mesh.coordinate(5)   {"dp": 1, "pp": 0, "tp": 1}

Axis order is rank order: global rank r sits at the coordinates of r in a row-major grid of the
axes, so the innermost axis (tensor or context parallelism) holds consecutive ranks, which a
launcher places on one node, and the outermost (data parallelism) spans nodes.

The first `replica_axes` axes copy the plan's *unit* (the devices one model replica runs on); the
runtime averages gradients and shards ZeRO state across those copies. A data-parallel split inside
the unit (the search may split the batch there) is the axis "batch": the lowering adds up its
partial sums instead of the runtime averaging gradients. Expert parallelism folds the dense layers
onto the experts' devices (Megatron's "parallel folding"): an ep plan's axes are {"dp", "pp", "ep",
"etp"} and `folded` says what the dense layers use inside the ep x etp devices ({"tp": 2}:
tensor-parallel in pairs, data-parallel across them). A searched plan that splits its experts over
the dense layers' devices folds {"ep": n} the other way.

Named axes: "dp", "batch", "pp", "cp", "tp", "ep", "etp", and "unit" for a third-party strategy that
only says how many devices a replica takes. Everything that needs degrees reads this object: labels and
pictures, the search's configurations, the runtime's process groups (a torch `DeviceMesh` where one
can be made). `resolve_mesh` is the one place user options become a mesh.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from nnscaler_plugins.errors import PlanError

AXIS_NAMES = ("dp", "batch", "pp", "tp", "cp", "ep", "etp", "unit")
#: What each axis does, for messages and pictures.
AXIS_WORDS = {"dp": "data parallel", "batch": "batch split inside a replica", "pp": "pipeline stages",
              "tp": "tensor parallel", "cp": "context parallel", "ep": "experts split",
              "etp": "each expert's width split", "unit": "devices per replica"}


@dataclass(frozen=True)
class Mesh:
    """Named axes over a plan's devices (see the module doc). Immutable and JSON-serializable."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    replica_axes: int = 1  # leading axes that copy the unit (the runtime's data-parallel replicas)
    folded: tuple[tuple[str, int], ...] = ()  # degrees laid over the unit's devices without multiplying them
    devices_per_node: Optional[int] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        names, sizes = tuple(self.names), tuple(int(s) for s in self.sizes)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "folded", tuple((str(n), int(s)) for n, s in self.folded))
        if len(names) != len(sizes) or not names:
            raise PlanError(f"a mesh needs one size per axis; got axes {names} and sizes {sizes}")
        for n in names:
            if n not in AXIS_NAMES:
                close = difflib.get_close_matches(n, AXIS_NAMES, n=1)
                raise PlanError(f"mesh axis {n!r} is not a known axis" + (f" (did you mean {close[0]!r}?)" if close
                                                                          else "") + f"; axes: {', '.join(AXIS_NAMES)}")
        if len(set(names)) != len(names):
            raise PlanError(f"mesh axes {names} name an axis twice")
        bad = [f"{n}={s}" for n, s in zip(names, sizes) if s < 1]
        if bad:
            raise PlanError(f"mesh axis sizes must be >= 1 (got {', '.join(bad)})")
        if not 0 <= self.replica_axes <= len(names):
            raise PlanError(f"replica_axes={self.replica_axes} but the mesh has {len(names)} axes")
        for n, s in self.folded:
            if n not in AXIS_NAMES or s < 1:
                raise PlanError(f"folded degree {n}={s} is not a degree of a known axis")
        if self.folded and self.unit_size % math.prod(s for _, s in self.folded):
            raise PlanError(f"folded degrees {dict(self.folded)} do not divide the unit of {self.unit_size} devices")

    # -- reading ------------------------------------------------------------------------------------------
    @property
    def axes(self) -> dict[str, int]:
        """Axis name -> size, outer to inner (a fresh dict: the mesh itself is immutable)."""
        return dict(zip(self.names, self.sizes))

    def __getitem__(self, name: str) -> int:
        """The size of axis `name`; 1 for a known axis the mesh does not have."""
        if name not in AXIS_NAMES:
            close = difflib.get_close_matches(name, AXIS_NAMES, n=1)
            raise KeyError(f"no mesh axis {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return self.axes.get(name, 1)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def replicas(self) -> int:
        """Copies of the unit: the runtime's data-parallel replicas (`plan.dp`)."""
        return math.prod(self.sizes[:self.replica_axes])

    @property
    def unit_names(self) -> tuple[str, ...]:
        return self.names[self.replica_axes:]

    @property
    def unit_sizes(self) -> tuple[int, ...]:
        return self.sizes[self.replica_axes:]

    @property
    def unit_size(self) -> int:
        """Devices per model replica (`plan.unit_size`)."""
        return math.prod(self.unit_sizes)

    def dense_degrees(self) -> dict[str, int]:
        """The degrees the dense (non-expert) layers run with: data (replicas times any batch split
        inside them), pipeline, context and tensor parallelism. On an ep plan the expert axes count as
        data parallelism, less what `folded` gives tensor parallelism."""
        out = {"dp": self["dp"] * self["batch"], "pp": self["pp"], "cp": self["cp"], "tp": self["tp"]}
        if "ep" in self.names or "etp" in self.names:
            tp = dict(self.folded).get("tp", 1)
            out["tp"] = tp
            out["dp"] = self["dp"] * self["batch"] * self["ep"] * self["etp"] // tp
        elif "unit" in self.names:
            out["tp"] = self["unit"]  # nothing more is known of a bare unit: its devices work on one replica
        return out

    def expert_degrees(self) -> dict[str, int]:
        """How the experts are split: ep (shares of experts) and etp (each expert's width); 1 and 1
        for a plan without expert parallelism."""
        folded = dict(self.folded)
        return {"ep": self["ep"] if "ep" in self.names else folded.get("ep", 1), "etp": self["etp"]}

    def describe(self) -> str:
        """'dp 2 x pp 2 x tp 2' (axes of size 1 left out; '1 device' when all are)."""
        words = [f"{n} {s}" for n, s in zip(self.names, self.sizes) if s > 1]
        words += [f"dense {n} {s}" for n, s in self.folded if s > 1]
        return " x ".join(words) or "1 device"

    # -- coordinates ---------------------------------------------------------------------------------------
    def coordinate(self, rank: int) -> dict[str, int]:
        """Global rank -> its index on every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} devices")
        out: dict[str, int] = {}
        for n, s in reversed(list(zip(self.names, self.sizes))):
            rank, out[n] = divmod(rank, s)
        return {n: out[n] for n in self.names}

    def rank_of(self, coordinate: Mapping[str, int]) -> int:
        """Coordinates (every axis; missing ones are 0) -> global rank."""
        rank = 0
        for n, s in zip(self.names, self.sizes):
            i = int(coordinate.get(n, 0))
            if not 0 <= i < s:
                raise ValueError(f"coordinate {n}={i} is outside the axis of size {s}")
            rank = rank * s + i
        return rank

    def unit_device(self, coordinate: Mapping[str, int]) -> int:
        """Unit axes' coordinates -> the device's index in the unit (`rank % unit_size`)."""
        return self.rank_of({n: coordinate.get(n, 0) for n in self.unit_names})

    def unit_coordinate(self, device: int) -> dict[str, int]:
        """A unit device's index -> its coordinates on the unit axes."""
        if not 0 <= device < self.unit_size:
            raise ValueError(f"device {device} is outside the unit of {self.unit_size} devices")
        out: dict[str, int] = {}
        for n, s in reversed(list(zip(self.unit_names, self.unit_sizes))):
            device, out[n] = divmod(device, s)
        return {n: out[n] for n in self.unit_names}

    def unit_devices(self, **fixed: int) -> list[int]:
        """The unit devices whose coordinates equal `fixed` (e.g. `unit_devices(pp=1)`: pipeline rank
        1's devices), in device order."""
        return [d for d in range(self.unit_size)
                if all(self.unit_coordinate(d).get(n, 0) == i for n, i in fixed.items())]

    def group(self, rank: int, along: Iterable[str]) -> tuple[int, ...]:
        """The global ranks that differ from `rank` only along the axes `along`, in mesh order."""
        along = tuple(along)
        for n in along:
            if n not in self.names:
                raise KeyError(f"mesh {self.describe()} has no axis {n!r}")
        here = self.coordinate(rank)
        out = []
        for r in range(self.world_size):
            c = self.coordinate(r)
            if all(c[n] == here[n] for n in self.names if n not in along):
                out.append(r)
        return tuple(out)

    def groups(self, along: Iterable[str]) -> list[tuple[int, ...]]:
        """Every group along `along` (each rank in exactly one), ordered by their first rank."""
        along = tuple(along)
        seen: set[int] = set()
        out = []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group(r, along)
                seen.update(g)
                out.append(g)
        return out

    def node_of(self, rank: int) -> Optional[int]:
        """The node a rank runs on, when the mesh knows the devices per node (launchers fill nodes in
        rank order)."""
        return None if not self.devices_per_node else rank // self.devices_per_node

    def within_node(self, along: Iterable[str]) -> Optional[bool]:
        """Whether every group along these axes stays inside one node (None: devices per node unknown)."""
        if not self.devices_per_node:
            return None
        return all(len({self.node_of(r) for r in g}) == 1 for g in self.groups(along))

    def with_nodes(self, devices_per_node: Optional[int]) -> "Mesh":
        return Mesh(self.names, self.sizes, self.replica_axes, self.folded, devices_per_node)

    def device_mesh(self, device_type: str) -> Any:
        """A torch `DeviceMesh` with these axis names and sizes over the default process group (one
        process group per axis, made collectively: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.sizes, mesh_dim_names=self.names)

    # -- persistence ---------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out: dict[str, Any] = {"axes": self.axes, "replica_axes": self.replica_axes}
        if self.folded:
            out["folded"] = dict(self.folded)
        if self.devices_per_node:
            out["devices_per_node"] = self.devices_per_node
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Mesh":
        if not isinstance(d, Mapping) or not isinstance(d.get("axes"), Mapping):
            raise PlanError("the plan's mesh must be an object with 'axes' (axis name -> size)")
        unknown = set(d) - {"axes", "replica_axes", "folded", "devices_per_node"}
        if unknown:
            raise PlanError(f"the plan's mesh has unknown key(s) {sorted(unknown)}; valid: axes, replica_axes, "
                            "folded, devices_per_node")
        from nnscaler_plugins.plan import fields

        axes = d["axes"]
        folded = fields.mapping(d.get("folded"), "mesh.folded", optional=True)
        return cls(tuple(fields.text(k, "mesh.axes (an axis name)") for k in axes),
                   tuple(fields.integer(v, f"mesh.axes[{k!r}]", 1) for k, v in axes.items()),
                   fields.integer(d.get("replica_axes", 1), "mesh.replica_axes", 0),
                   tuple((k, fields.integer(v, f"mesh.folded[{k!r}]", 1)) for k, v in folded.items()),
                   fields.optional_integer(d.get("devices_per_node"), "mesh.devices_per_node", 1))

    def __repr__(self) -> str:
        extra = f", replica_axes={self.replica_axes}" if self.replica_axes != 1 else ""
        extra += f", folded={dict(self.folded)}" if self.folded else ""
        return f"Mesh({self.axes}{extra})"


def unit_mesh(unit_size: int, dp: int) -> Mesh:
    """The mesh of a plan that says only its unit and replicas (a third-party strategy's `degrees`)."""
    return Mesh(("dp", "unit"), (dp, unit_size), 1)


# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeshLayout:
    """How a strategy lays its degrees out, for `resolve_mesh`: the axes outer to inner (the first is
    the replicas' "dp"), the order in which an axis nobody gave absorbs the devices left over
    (`fill`), the sizes the others take when not given (`defaults`, else 1), the degree options that
    must be given (`require_one_of`: at least one of them), and the strategy's own checks of the
    options before anything is derived (`check`)."""

    names: tuple[str, ...]
    fill: tuple[str, ...]
    defaults: Mapping[str, int] = field(default_factory=dict)
    require_one_of: tuple[str, ...] = ()
    check: Optional[Callable[..., Optional[dict[str, Any]]]] = None  # fn(world_size, **options) -> extra degrees
    folded: tuple[str, ...] = ()  # degree options laid over the unit instead of multiplying it (ep's dense tp)
    replica_axes: int = 1
    extra: tuple[str, ...] = ()  # degree options taken only for `check` to judge (dp's tp=1)
    # Another layout the strategy lays its degrees out by when one of these degree options is given
    # above 1: megatron with ep= / etp= takes the experts' axes ((("ep", "etp"), the ep layout)).
    variant: Optional[tuple[tuple[str, ...], "MeshLayout"]] = None

    @property
    def degree_options(self) -> tuple[str, ...]:
        own = tuple(self.names) + tuple(self.folded) + tuple(self.extra)
        if self.variant is not None:
            own += tuple(n for n in self.variant[1].degree_options if n not in own)
        return own

    def for_options(self, options: Mapping[str, Any], strategy: str = "") -> "MeshLayout":
        """The layout these options are laid out by: the variant's when one of its trigger options is
        given above 1 (refusing a degree of this layout the variant has no axis for), else this one."""
        if self.variant is None:
            return self
        triggers, other = self.variant
        if not any(_above_one(options.get(n)) for n in triggers):
            return self
        lost = [n for n in self.degree_options if n not in other.degree_options and _above_one(options.get(n))]
        if lost:
            who = f"strategy {strategy!r}" if strategy else "the plan"
            raise PlanError(f"{who}: {', '.join(f'{n}={options[n]}' for n in lost)} with "
                            f"{' / '.join(f'{n}=' for n in triggers)} is not supported (the experts' layout has no "
                            f"{'/'.join(lost)} axis); drop {'/'.join(lost)} or the experts' degrees")
        return other


def _above_one(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1


def resolve_mesh(layout: MeshLayout, world_size: int, options: Mapping[str, Any], strategy: str = "") -> Mesh:
    """The one place degree options (dp=, tp=, pp=, cp=, ep=, etp=) become a mesh: given degrees are
    checked to divide the world, the first axis of `layout.fill` nobody gave absorbs what is left,
    the others take their defaults, and the product must be the world size; errors name the strategy,
    the degrees and what to choose instead."""
    who = f"strategy {strategy!r}" if strategy else "the plan"
    layout = layout.for_options(options, strategy)
    given: dict[str, int] = {}
    for name in layout.degree_options:
        v = options.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
            raise PlanError(f"{who}: {name}={v!r} must be a positive integer (the {AXIS_WORDS.get(name, name)} degree)")
        given[name] = int(v)
    if layout.check is not None:
        extra = layout.check(world_size, **{k: options.get(k) for k in layout.degree_options})
        for k, v in (extra or {}).items():
            given.setdefault(k, int(v))
    for name in layout.extra:
        given.pop(name, None)
    for name, v in given.items():
        if v < 1:
            raise PlanError(f"{who}: {name}={v} must be a positive integer (the {AXIS_WORDS.get(name, name)} degree)")
        if world_size % v:
            raise PlanError(f"{who}: {name}={v} does not divide the world size {world_size}")
    if layout.require_one_of and not any(n in given for n in layout.require_one_of):
        raise PlanError(f"{who} needs {' and/or '.join(f'{n}=' for n in layout.require_one_of)} (their product is the "
                        f"world size {world_size})")
    sizes = {n: given.get(n) for n in layout.names}
    absorber = next((n for n in layout.fill if sizes[n] is None), None)
    for n in layout.names:
        if sizes[n] is None and n != absorber:
            sizes[n] = int(layout.defaults.get(n, 1))
    rest = math.prod(v for n, v in sizes.items() if n != absorber)
    if absorber is not None:
        if world_size % rest:
            shown = " x ".join(f"{n}={sizes[n]}" for n in layout.names if n != absorber and sizes[n] != 1) or "1"
            raise PlanError(f"{who}: {shown} does not divide the world size {world_size}")
        sizes[absorber] = world_size // rest
    total = math.prod(sizes.values())
    if total != world_size:
        shown = " x ".join(f"{n}={sizes[n]}" for n in layout.names)
        raise PlanError(f"{who}: {shown} = {total}, but the world size is {world_size}; choose degrees whose product "
                        f"is {world_size}")
    folded = tuple((n, given[n]) for n in layout.folded if n in given and given[n] > 1)
    mesh = Mesh(tuple(layout.names), tuple(sizes[n] for n in layout.names), layout.replica_axes)
    for n, s in folded:
        if mesh.unit_size % s:
            raise PlanError(f"{who}: {n}={s} must divide the {mesh.unit_size} devices of a replica "
                            f"({' x '.join(f'{a} {b}' for a, b in zip(mesh.unit_names, mesh.unit_sizes))})")
    return Mesh(mesh.names, mesh.sizes, mesh.replica_axes, folded) if folded else mesh


def mesh_of_degrees(degrees: Sequence[tuple[str, int]], replica_axes: int = 1) -> Mesh:
    """A mesh from (name, size) pairs, outer to inner."""
    return Mesh(tuple(n for n, _ in degrees), tuple(int(s) for _, s in degrees), replica_axes)


def subop_devices(sizes: Sequence[int], split_axes: Sequence[int], chunks: int = 1) -> list[int]:
    """Where each sub-op of an op runs on a grid of devices (`sizes`, outer to inner, devices numbered
    row-major): the op is split along the axes `split_axes` (in that order) and copied along the
    others, its sub-ops numbered as `OpPlacement` numbers them (one replica digit over the copied axes,
    outermost, then one digit per split); the innermost split may cut `chunks` pieces per device
    (co-shard). Sub-op i runs on device `subop_devices(...)[i]`, at the grid coordinates of its digits,
    so that every op's pieces sit at the same coordinates whatever it splits."""
    sizes = list(sizes)
    split_axes = list(split_axes)
    copy_axes = [i for i in range(len(sizes)) if i not in split_axes]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    innermost = split_axes[-1] if split_axes else None
    radices = [math.prod(sizes[i] for i in copy_axes)] + [sizes[i] * (chunks if i == innermost else 1)
                                                           for i in split_axes]
    out = []
    for index in range(math.prod(radices)):
        digits, x = [], index
        for r in reversed(radices):
            digits.append(x % r)
            x //= r
        digits.reverse()
        coord = [0] * len(sizes)
        rep = digits[0]
        for i in reversed(copy_axes):
            coord[i] = rep % sizes[i]
            rep //= sizes[i]
        for i, d in zip(split_axes, digits[1:]):
            coord[i] = d // chunks if i == innermost else d
        out.append(sum(c * s for c, s in zip(coord, strides)))
    return out
