"""Dimension rules checked against the ops they describe.

A rule is a claim: "cut these dims into pieces, run the pieces (as `localize` says), put the outputs
back together by concatenation or summation, and you get the unsplit op". Plans, lowering and
codegen all trust that claim without re-checking it, so a wrong label shows up far away as a model
that trains to a slightly different loss. Here every claim is tested where it is made: for every op
of the five test models, and for hypothesis-drawn shapes of the core ops, every split a signature
offers is run piece by piece, forward and backward, and compared with the whole op.

Splits that need a process group (`comm_labels`, or a `localize` naming a `group_label`) cannot run
in one process; test_piece_functions.py covers them with real gloo workers.
"""
from __future__ import annotations

import itertools
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import models
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nnscaler_plugins as nns
from nnscaler_plugins import plugins
from nnscaler_plugins.capture.graph import Graph, Ref, TensorMeta
from nnscaler_plugins.errors import PlanError
from nnscaler_plugins.hookspecs import hookimpl
from nnscaler_plugins.layout import cat_dim, chunk_dim
from nnscaler_plugins.lower.placement import merged_host
from nnscaler_plugins.rules import (
    LocalCall,
    OpCall,
    ReplicateOnlyWarning,
    Signature,
    op_call,
    refresh,
    signature_of,
    unruled_ops,
)

aten = torch.ops.aten

RTOL = ATOL = 1e-5

Split = tuple[tuple[str, int, int], ...]  # ((label, pieces, blocks), ...), outermost first


# --------------------------------------------------------------------------------------------------
# Running a captured graph on real data
# --------------------------------------------------------------------------------------------------

def _bind(tree: Any, env: dict[str, Any]) -> Any:
    return pytree.tree_map(lambda x: env[x.name] if isinstance(x, Ref) else x, tree)


def _at_path(args: tuple, kwargs: dict, path: tuple) -> Any:
    node: Any = {"args": args, "kwargs": kwargs}
    for key in path:
        node = node[key]
    return node


def _interpret(graph: Graph, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every value of the graph on the model's real inputs and parameters.

    Integer and boolean tensors (token ids, targets, masks, position ids) only make sense with the
    values the model really computes, and real activations keep floats inside the domains the ops
    expect (a variance under rsqrt stays positive), so each op is later checked on these values.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    env: dict[str, Any] = {}
    for name, v in graph.values.items():
        if v.kind == "param":
            env[name] = params[v.fqn].detach()
        elif v.kind == "buffer":
            env[name] = buffers[v.fqn].detach()
        elif v.kind == "constant":
            env[name] = graph.constants[v.fqn]
    for spec in graph.inputs:
        env[spec.name] = _at_path(args, kwargs, spec.path)
    with torch.no_grad():
        for op in graph.ops:
            out = op.target(*_bind(op.args, env), **_bind(op.kwargs, env))
            if op.multi_output:
                for name, o in zip(op.outputs, out):
                    if name is not None:
                        env[name] = o
            elif op.outputs[0] is not None:
                env[op.outputs[0]] = out
    return env


def _record(name: str) -> tuple[Graph, dict[str, Any]]:
    torch.manual_seed(0)
    model, inputs = models.ALL[name]()
    model.eval()  # dropout off: pieces and the whole op must be comparable bit for bit in intent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicateOnlyWarning)
        graph = nns.capture(model, kwargs=inputs)
    env = _interpret(graph, model, (), inputs)
    # The interpreter is the ground truth for every op below, so it must reproduce the model.
    with torch.no_grad():
        expected = [t for t in pytree.tree_leaves(model(**inputs)) if isinstance(t, torch.Tensor)]
    got = [env[n] for n in graph.outputs if n is not None]
    assert len(got) == len(expected), f"{name}: graph has {len(got)} tensor outputs, model {len(expected)}"
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    return graph, env


@pytest.fixture(scope="module")
def recorded() -> Callable[[str], tuple[Graph, dict[str, Any]]]:
    cache: dict[str, tuple[Graph, dict[str, Any]]] = {}

    def get(name: str) -> tuple[Graph, dict[str, Any]]:
        if name not in cache:
            cache[name] = _record(name)
        return cache[name]

    return get


def _op_key(graph: Graph, op) -> tuple:
    scalars = pytree.tree_map(lambda x: "<tensor>" if isinstance(x, Ref) else x, (op.args, op.kwargs))
    metas = tuple((graph.meta(n).shape, graph.meta(n).dtype) for n in op.inputs)
    return (op.op_name, repr(scalars), metas)


# --------------------------------------------------------------------------------------------------
# The checker: one op, every split its signature offers
# --------------------------------------------------------------------------------------------------

class _Skip(Exception):
    """A split this process cannot run alone (it needs a process group, or the rule refuses it)."""


def _is_float(t: Any) -> bool:
    """Floating or complex: a tensor a gradient flows through (complex RoPE's tensors included)."""
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _dims(labels: Optional[Sequence[str]], label: str) -> list[int]:
    return [d for d, l in enumerate(labels or ()) if l == label]


def _cut_dims(sig, labels: Optional[Sequence[str]], label: str, block: int) -> list[tuple[int, int]]:
    """(dim, blocks) a split of `label` cuts on one tensor: the dims carrying it, or the merged dim
    that holds it (`Signature.merged`, in the merged dim's blocks)."""
    host = merged_host(sig, label, labels)
    if host is not None:
        return [(host[0], host[1] * block)]
    return [(d, block) for d in _dims(labels, label)]


def _difference(got: Any, want: Any) -> Optional[str]:
    """None when equal (floats to RTOL/ATOL, everything else exactly); else what differs."""
    if not isinstance(want, torch.Tensor):
        return None if got is None or not isinstance(got, torch.Tensor) else f"unexpected tensor {got.shape}"
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}, want a tensor"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if want.dtype.is_floating_point or want.dtype.is_complex:
        # A piece-wise sum (a weight gradient over a split batch) rounds like its largest terms, so
        # the absolute tolerance follows the tensor's scale, not each element's own size.
        scale = want.detach().abs().nan_to_num(0, 0, 0).max().item() if want.numel() else 0.0
        try:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=max(ATOL, 1e-6 * scale), equal_nan=True)
            return None
        except AssertionError:
            err = (got.detach().double() - want.detach().double()).abs().nan_to_num(float("inf")).max().item()
            return f"max error {err:.3g} (|want| max {want.detach().abs().max().item():.3g})"
    if torch.equal(got, want):
        return None
    return f"{int((got != want).sum())} of {want.numel()} elements differ"


class OpChecker:
    """Runs one op whole once, then any number of splits of it against that reference."""

    def __init__(self, call: OpCall, values: dict[str, Any], seed: int = 0):
        self.call = call
        self.sig = signature_of(call)
        self.sig.check(call)
        self.values = values
        self.names = list(call.input_names)
        # An input named twice (mul(x, x)) is one tensor: one leaf, one gradient.
        self.first = {n: self.names.index(n) for n in self.names}
        gen = torch.Generator().manual_seed(seed)
        leaves = {n: self._leaf(values[n]) for n in self.first}
        self.outs = _as_list(self._run(self.call.target, self.call.args, self.call.kwargs, leaves))
        self.upstream: dict[int, torch.Tensor] = {}
        for j, o in enumerate(self.outs):
            if _is_float(o) and o.requires_grad:
                self.upstream[j] = torch.randn(o.shape, generator=gen, dtype=o.dtype)
        self.grads: dict[str, torch.Tensor] = {}
        if self.upstream:
            wrt = [n for n, t in leaves.items() if t.requires_grad]
            got = torch.autograd.grad([self.outs[j] for j in self.upstream], [leaves[n] for n in wrt],
                                      list(self.upstream.values()), allow_unused=True)
            for n, g in zip(wrt, got):
                self.grads[n] = torch.zeros_like(leaves[n]) if g is None else g
        self.outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in self.outs]

    @staticmethod
    def _leaf(t: Any) -> Any:
        if _is_float(t):
            return t.detach().clone().requires_grad_(True)
        return t

    @staticmethod
    def _run(target: Any, args: Any, kwargs: Any, env: dict[str, Any]) -> Any:
        return target(*_bind(tuple(args), env), **_bind(dict(kwargs), env))

    # -- which splits ----------------------------------------------------------------------------
    def splits(self) -> list[Split]:
        """num 2 and (where it divides) 4 along each label, one 2 x 2 nesting of two labels, and
        a blocked split (2 pieces of 2 or 3 blocks) of every label a plan may split in blocks."""
        sig, call = self.sig, self.call
        labels = [l for l in sig.splittable() if l not in sig.comm_labels]
        out: list[Split] = []
        for l in labels:
            for num in (2, 4):
                if sig.divides(l, num, call):
                    out.append(((l, num, 1),))
            if sig.blockable(l, call) is None:
                block = next((b for b in (3, 2) if sig.divides(l, 2, call, b)), None)
                if block is not None:
                    out.append(((l, 2, block),))
        for a, b in itertools.combinations(labels, 2):
            host_a, host_b = sig.merged.get(a, (None,))[0], sig.merged.get(b, (None,))[0]
            if host_a == b or host_b == a or (host_a is not None and host_a == host_b):
                continue  # one dim cut twice (refused by the placement)
            if sig.divides(a, 2, call) and sig.divides(b, 2, call):
                out.append(((a, 2, 1), (b, 2, 1)))
                break
        return out

    # -- one split -------------------------------------------------------------------------------
    def check(self, split: Split) -> list[str]:
        """What differs from the whole op ([] when nothing); raises _Skip when it cannot run here."""
        sig = self.sig
        problems: list[str] = []
        pieces: dict[tuple[int, ...], list[Any]] = {}
        grads: dict[tuple[int, ...], dict[str, Any]] = {}
        local_shapes: dict[tuple[int, ...], dict[str, tuple[int, ...]]] = {}
        for index in itertools.product(*(range(num) for _, num, _ in split)):
            local, shapes = self._slice_inputs(split, index)
            local_shapes[index] = shapes
            lz_target, lz_args, lz_kwargs, expected = self._localize(split, index, local)
            try:
                outs = _as_list(self._run(lz_target, lz_args, lz_kwargs, local))
            except Exception as e:  # noqa: BLE001 - a piece that cannot run is the finding
                return [f"piece {index} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
            if len(outs) != len(self.outs):
                return [f"piece {index} returned {len(outs)} outputs, the op {len(self.outs)}"]
            for j, (o, m) in enumerate(zip(outs, expected)):
                if m is not None and isinstance(o, torch.Tensor) and tuple(o.shape) != tuple(m.shape):
                    problems.append(f"piece {index} output {j} has shape {tuple(o.shape)}, "
                                    f"local_outputs says {tuple(m.shape)}")
            pieces[index] = outs
            grads[index] = self._piece_backward(split, index, outs, local)
        if problems:
            return problems

        for j, want in enumerate(self.outs):
            if not isinstance(want, torch.Tensor):
                continue
            got = self._combine({i: p[j] for i, p in pieces.items()}, split, self.sig.outputs[j], None, problems,
                                f"output {j}")
            diff = _difference(got, want)
            if diff:
                problems.append(f"forward output {j}: {diff}")
        for n, want in self.grads.items():
            pos = self.first[n]
            per_piece = {i: g[n] if g.get(n) is not None else torch.zeros(local_shapes[i][n], dtype=want.dtype)
                         for i, g in grads.items()}
            got = self._combine(per_piece, split, sig.inputs[pos], pos, problems, f"grad of input {pos}")
            diff = _difference(got, want)
            if diff:
                problems.append(f"backward grad of input {pos} ({n}): {diff}")
        return problems

    def _slice_inputs(self, split: Split, index: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, tuple]]:
        sig = self.sig
        local: dict[str, Any] = {}
        shapes: dict[str, tuple] = {}
        for n, pos in self.first.items():
            t = self.values[n]
            labels = sig.inputs[pos]
            constant = False
            for (label, num, block), i in zip(split, index):
                dims = _cut_dims(sig, labels, label, sig.blocks.get((label, pos), block))
                if dims:
                    for d, b in dims:
                        t = chunk_dim(t, d, num, i, b)
                elif pos in sig.partial_inputs.get(label, ()) and i != 0:
                    # Only piece 0 holds a partial input's value; the zeros elsewhere are made on
                    # the spot, not taken from the input, so no gradient flows back through them.
                    t = torch.zeros_like(t)
                    constant = True
            t = t.detach().clone()
            if _is_float(t) and n in self.grads and not constant:
                t.requires_grad_(True)
            local[n] = t
            shapes[n] = tuple(t.shape)
        return local, shapes

    def _localize(self, split: Split, index: tuple[int, ...], local: dict[str, Any]):
        sig, call = self.sig, self.call
        expected: list[Optional[TensorMeta]] = []
        for m, labels in zip(call.outputs, sig.outputs):
            if m is None:
                expected.append(None)
                continue
            shape = list(m.shape)
            for label, num, block in split:
                for d, _ in _cut_dims(sig, labels, label, block):
                    shape[d] //= num
            expected.append(TensorMeta(tuple(shape), m.dtype, m.requires_grad))
        if sig.localize is None:
            return call.target, call.args, call.kwargs, expected
        local_inputs = tuple(TensorMeta(tuple(local[n].shape), local[n].dtype) for n in self.names)
        lc = LocalCall(call=call, splits={l: n for l, n, _ in split}, index={l: i for (l, _, _), i in zip(split, index)},
                       local_inputs=local_inputs, local_outputs=tuple(expected))
        try:
            lz = sig.localize(lc)
        except PlanError as e:
            raise _Skip(f"rule refuses: {e}") from e
        if lz.group_label is not None:
            raise _Skip(f"needs the process group of {lz.group_label!r}")
        return lz.target, lz.args, lz.kwargs, expected

    def _piece_backward(self, split: Split, index: tuple[int, ...], outs: list[Any],
                        local: dict[str, Any]) -> dict[str, Any]:
        """Input grads of one piece, fed the piece's share of the whole op's upstream gradient."""
        sig = self.sig
        ys, gs = [], []
        for j, g in self.upstream.items():
            o = outs[j]
            if not (isinstance(o, torch.Tensor) and o.requires_grad):
                continue
            labels = sig.outputs[j]
            for (label, num, block), i in zip(split, index):
                dims = _cut_dims(sig, labels, label, block)
                if dims:
                    for d, b in dims:
                        g = chunk_dim(g, d, num, i, b)
                elif label not in sig.reduce and i != 0:
                    # A replicated output is counted once: the other copies get no gradient.
                    g = torch.zeros_like(g)
                # A partial-sum output's gradient is the whole upstream gradient on every summand.
            ys.append(o)
            gs.append(g.contiguous())
        wrt = [n for n, t in local.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        if not ys or not wrt:
            return {}
        got = torch.autograd.grad(ys, [local[n] for n in wrt], gs, allow_unused=True)
        return dict(zip(wrt, got))

    def _combine(self, pieces: dict[tuple[int, ...], torch.Tensor], split: Split, labels: Optional[Sequence[str]],
                 input_pos: Optional[int], problems: list[str], what: str) -> torch.Tensor:
        """Pieces back into one tensor, innermost split first: concatenate along dims carrying the
        label; otherwise sum (reduce-label outputs are partial sums; gradients of inputs used whole
        by every piece add up). Outputs of a spatial label they lack are copies: they must agree."""
        sig = self.sig
        for level in reversed(range(len(split))):
            label, num, block = split[level]
            groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
            for key, t in sorted(pieces.items()):
                groups.setdefault(key[:level], []).append(t)
            merged = {}
            for prefix, ts in groups.items():
                blocks = sig.blocks.get((label, input_pos), block) if input_pos is not None else block
                dims = _cut_dims(sig, labels, label, blocks)
                if dims:
                    merged[prefix] = cat_dim(ts, dims[0][0], dims[0][1])
                elif input_pos is not None or label in sig.reduce:
                    merged[prefix] = torch.stack(list(ts)).sum(0)
                else:
                    for k, t in enumerate(ts[1:], 1):
                        diff = _difference(t, ts[0])
                        if diff:
                            problems.append(f"{what}: copy {k} along {label!r} differs from copy 0: {diff}")
                    merged[prefix] = ts[0]
            pieces = merged
        return pieces[()]


def _describe(split: Split) -> str:
    return " x ".join(f"{l}/{n}" + (f" in {b} blocks" if b > 1 else "") for l, n, b in split)


def check_call(call: OpCall, values: dict[str, Any], where: str) -> tuple[list[str], int]:
    """Every split of one op: (problems, number of splits actually run)."""
    try:
        checker = OpChecker(call, values)
    except Exception as e:  # noqa: BLE001 - a signature that does not fit is a rule bug
        return [f"{where}: cannot check: {type(e).__name__}: {e}"], 0
    problems, ran = [], 0
    for split in checker.splits():
        try:
            found = checker.check(split)
        except _Skip:
            continue
        except Exception as e:  # noqa: BLE001
            found = [f"raised {type(e).__name__}: {e}"]
        ran += 1
        problems += [f"{where} split {_describe(split)}: {p}" for p in found]
    return problems, ran


# --------------------------------------------------------------------------------------------------
# Every op of every test model
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_name", sorted(models.ALL))
def test_every_split_of_every_model_op_matches_the_whole_op(model_name, recorded):
    started = time.perf_counter()
    graph, env = recorded(model_name)
    problems: list[str] = []
    seen: set = set()
    ran = 0
    for op in graph.ops:
        if not any(op.outputs):
            continue
        key = _op_key(graph, op)
        if key in seen:
            continue
        seen.add(key)
        found, n = check_call(op_call(graph, op), {n: env[n] for n in op.inputs},
                              f"{model_name} {op.name} ({op.op_name})")
        problems += found
        ran += n
    assert ran > 0, f"{model_name}: no split was checked"
    assert not problems, (f"{len(problems)} problem(s) in {ran} splits of {len(seen)} distinct ops "
                          f"({time.perf_counter() - started:.1f} s):\n" + "\n".join(problems))


# --------------------------------------------------------------------------------------------------
# Core rules on random shapes
# --------------------------------------------------------------------------------------------------

def call_of(target: Any, args: tuple, kwargs: dict, tensors: dict[str, torch.Tensor]) -> OpCall:
    """An OpCall as capture would build it; the output metas come from running on meta tensors."""
    names: list[str] = []
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, Ref):
            names.append(leaf.name)
    metas = {n: TensorMeta(tuple(t.shape), t.dtype, _is_float(t)) for n, t in tensors.items()}
    fake = {n: t.to("meta") for n, t in tensors.items()}
    out = target(*_bind(args, fake), **_bind(kwargs, fake))
    outs = tuple(TensorMeta(tuple(o.shape), o.dtype, _is_float(o)) if isinstance(o, torch.Tensor) else None
                 for o in _as_list(out))
    return OpCall(target, args, kwargs, inputs=tuple(metas[n] for n in names), outputs=outs,
                  input_names=tuple(names))


def check_random(target: Any, args: tuple, kwargs: dict, tensors: dict[str, torch.Tensor]) -> None:
    call = call_of(target, args, kwargs, tensors)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    problems, _ = check_call(call, tensors, f"{target} {shapes} args {args!r} kwargs {kwargs!r}")
    assert not problems, "\n".join(problems)


SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 12])
EVEN = st.sampled_from([2, 4, 8])
HYP = settings(max_examples=15, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(tuple(shape))


def _broadcast_operand(draw, out: Sequence[int]) -> list[int]:
    """A shape that broadcasts to `out`: a suffix of it with some dims set to 1."""
    n = draw(st.integers(0, len(out)))
    return [1 if draw(st.booleans()) else s for s in out[len(out) - n:]]


@HYP
@given(batch=st.lists(SIZES, max_size=2), k=SIZES, n=SIZES, bias=st.booleans())
def test_linear_random(batch, k, n, bias):
    tensors = {"x": _randn(*batch, k), "w": _randn(n, k)}
    args = (Ref("x"), Ref("w"))
    if bias:
        tensors["b"] = _randn(n)
        args += (Ref("b"),)
    check_random(aten.linear.default, args, {}, tensors)


@HYP
@given(m=SIZES, k=SIZES, n=SIZES, bias_kind=st.sampled_from(["n", "mn", "1n", "m1"]),
       beta=st.sampled_from([1, 0.5]))
def test_addmm_random(m, k, n, bias_kind, beta):
    bias = {"n": (n,), "mn": (m, n), "1n": (1, n), "m1": (m, 1)}[bias_kind]
    tensors = {"bias": _randn(*bias), "a": _randn(m, k), "b": _randn(k, n)}
    kwargs = {} if beta == 1 else {"beta": beta}
    check_random(aten.addmm.default, (Ref("bias"), Ref("a"), Ref("b")), kwargs, tensors)


@HYP
@given(data=st.data(), m=SIZES, k=SIZES, n=SIZES, a_vec=st.booleans(), b_vec=st.booleans())
def test_matmul_random_with_broadcast_batch(data, m, k, n, a_vec, b_vec):
    batch = data.draw(st.lists(SIZES, max_size=2))
    a = [k] if a_vec else _broadcast_operand(data.draw, batch) + [m, k]
    b = [k] if b_vec else _broadcast_operand(data.draw, batch) + [k, n]
    check_random(aten.matmul.default, (Ref("a"), Ref("b")), {}, {"a": _randn(*a), "b": _randn(*b)})


@HYP
@given(bb=SIZES, m=SIZES, k=SIZES, n=SIZES)
def test_bmm_random(bb, m, k, n):
    check_random(aten.bmm.default, (Ref("a"), Ref("b")), {}, {"a": _randn(bb, m, k), "b": _randn(bb, k, n)})


@HYP
@given(data=st.data(), out=st.lists(SIZES, min_size=1, max_size=4), alpha=st.sampled_from([1, 2.0]),
       swap=st.booleans())
def test_add_random_broadcast(data, out, alpha, swap):
    other = _broadcast_operand(data.draw, out)
    x, y = ("a", "b") if not swap else ("b", "a")
    kwargs = {} if alpha == 1 else {"alpha": alpha}
    check_random(aten.add.Tensor, (Ref(x), Ref(y)), kwargs, {"a": _randn(*out), "b": _randn(*other)})


@st.composite
def _reshape_pair(draw):
    """(src, dst) shapes related by merging runs of dims or splitting dims into factors."""
    groups = draw(st.lists(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3), min_size=1, max_size=3))
    src, dst = [], []
    for factors in groups:
        merged = [1]
        for f in factors:
            merged[0] *= f
        if draw(st.booleans()):
            src += factors
            dst += merged
        else:
            src += merged
            dst += factors
    return src, dst


@HYP
@given(pair=_reshape_pair(), op=st.sampled_from(["view", "reshape"]), minus_one=st.booleans())
def test_view_reshape_random(pair, op, minus_one):
    src, dst = pair
    size = list(dst)
    if minus_one:
        size[0] = -1
    target = aten.view.default if op == "view" else aten.reshape.default
    check_random(target, (Ref("x"), size), {}, {"x": _randn(*src)})


@HYP
@given(shape=st.lists(SIZES, min_size=2, max_size=4), data=st.data())
def test_transpose_random(shape, data):
    n = len(shape)
    d0 = data.draw(st.integers(-n, n - 1))
    d1 = data.draw(st.integers(-n, n - 1))
    check_random(aten.transpose.int, (Ref("x"), d0, d1), {}, {"x": _randn(*shape)})


@HYP
@given(shape=st.lists(SIZES, min_size=1, max_size=4), data=st.data())
def test_softmax_random(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    check_random(aten.softmax.int, (Ref("x"), dim), {}, {"x": _randn(*shape)})


@HYP
@given(lead=st.lists(SIZES, min_size=1, max_size=2), normed=st.lists(SIZES, min_size=1, max_size=2),
       affine=st.sampled_from(["none", "weight", "both"]))
def test_layer_norm_random(lead, normed, affine):
    tensors = {"x": _randn(*lead, *normed)}
    args: tuple = (Ref("x"), list(normed))
    if affine != "none":
        tensors["w"] = _randn(*normed)
        args += (Ref("w"),)
        if affine == "both":
            tensors["b"] = _randn(*normed)
            args += (Ref("b"),)
    check_random(aten.layer_norm.default, args, {}, tensors)


@HYP
@given(b=st.sampled_from([1, 2, 4]), kv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2]),
       lq=st.sampled_from([1, 4, 6]), lk=st.sampled_from([4, 6]), e=st.sampled_from([4, 8]),
       mask=st.sampled_from(["none", "bool_full", "bool_bcast", "float_heads", "causal"]))
def test_sdpa_random(b, kv, group, lq, lk, e, mask):
    h = kv * group
    tensors = {"q": _randn(b, h, lq, e), "k": _randn(b, kv, lk, e), "v": _randn(b, kv, lk, e)}
    args: tuple = (Ref("q"), Ref("k"), Ref("v"))
    kwargs: dict = {"enable_gqa": True} if group > 1 else {}
    if mask == "bool_full":
        m = torch.rand(b, h, lq, lk) > 0.3
        m[..., 0] = True  # no fully masked row: its softmax is NaN either way
        tensors["m"] = m
        args += (Ref("m"),)
    elif mask == "bool_bcast":
        m = torch.rand(b, 1, lq, lk) > 0.3
        m[..., 0] = True
        tensors["m"] = m
        args += (Ref("m"),)
    elif mask == "float_heads":
        tensors["m"] = _randn(1, h, lq, lk)
        args += (Ref("m"),)
    elif mask == "causal" and lq <= lk:
        kwargs["is_causal"] = True
    check_random(aten.scaled_dot_product_attention.default, args, kwargs, tensors)


@HYP
@given(vocab=st.sampled_from([4, 8, 12, 16]), dim=SIZES, ids=st.lists(SIZES, min_size=1, max_size=2),
       padding=st.booleans())
def test_embedding_random(vocab, dim, ids, padding):
    tensors = {"w": _randn(vocab, dim), "ids": torch.randint(0, vocab, tuple(ids))}
    args: tuple = (Ref("w"), Ref("ids"))
    if padding:
        args += (vocab - 1,)
        tensors["ids"][..., 0] = vocab - 1  # the padding row is looked up and gets no gradient
    check_random(aten.embedding.default, args, {}, tensors)


# --------------------------------------------------------------------------------------------------
# Ops without rules, and rules from plugins
# --------------------------------------------------------------------------------------------------

class _Unruled(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.linalg.qr(x)[0]  # marker: unruled-qr
        return torch.fft.fft(q).real.sum() + q.sum()


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# marker: {marker}"):
                return i
    raise LookupError(marker)


def test_ops_without_rule_are_listed_in_one_warning_with_their_source_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = nns.capture(_Unruled(), (torch.randn(6, 4),))
    ours = [w for w in caught if issubclass(w.category, ReplicateOnlyWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    text = str(ours[0].message)
    missing = unruled_ops(graph)
    assert any(op.op_name == "aten.linalg_qr.default" for op in missing)
    for op in missing:
        assert text.count(op.where()) == 1, f"{op.where()} missing from:\n{text}"
    assert f"test_rules.py:{_line_of('unruled-qr')}" in text
    assert "nnscaler_register_op_rules" in text  # says how to fix it


@torch.library.custom_op("nnstest::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s.unsqueeze(-1)


@scale_rows.register_fake
def _scale_rows_fake(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scale_rows_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _scale_rows_backward(ctx, grad: torch.Tensor):
    x, s = ctx.saved_tensors
    return grad * s.unsqueeze(-1), (grad * x).sum(-1)


scale_rows.register_autograd(_scale_rows_backward, setup_context=_scale_rows_setup)


def scale_rows_rule(call: OpCall) -> Signature:
    # Rows pair with the scales; the columns never meet each other, so both dims split.
    return Signature(inputs=(("r", "c"), ("r",)), outputs=(("r", "c"),))


class _ScaleRowsPlugin:
    @hookimpl
    def nnscaler_register_op_rules(self):
        return {"nnstest.scale_rows.default": scale_rows_rule}


class _ScalesRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.s = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_rows(x, self.s).sum()


def _rule_less(caught) -> str:
    return "\n".join(str(w.message) for w in caught if issubclass(w.category, ReplicateOnlyWarning))


def test_plugin_rule_for_a_custom_op_is_used_by_capture_and_checks_out():
    model, x = _ScalesRows(), torch.randn(8, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nns.capture(model, (x,))
    assert "nnstest.scale_rows.default" in _rule_less(caught)  # without the plugin: replicate only

    plugin = _ScaleRowsPlugin()
    plugins.register(plugin)
    refresh()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph = nns.capture(model, (x,))
        assert "nnstest.scale_rows.default" not in _rule_less(caught)
        assert all(op.op_name != "nnstest.scale_rows.default" for op in unruled_ops(graph))
        (op,) = graph.find(target="nnstest.scale_rows.default")
        call = op_call(graph, op)
        assert signature_of(call) == scale_rows_rule(call)
        env = _interpret(graph, model, (x,), {})
        problems, ran = check_call(call, {n: env[n] for n in op.inputs}, "plugin scale_rows")
        assert ran >= 3 and not problems, "\n".join(problems)
    finally:
        plugins.unregister(plugin)
        refresh()
    assert signature_of(call).note == "replicate-only"  # unregistered: the built-in table again


def test_type_as_never_splits_the_tensor_that_only_gives_the_dtype():
    out = TensorMeta((4, 8), torch.float32)
    call = OpCall(aten.type_as.default, (Ref("x"), Ref("s")), {}, (out, TensorMeta((), torch.float16)), (out,),
                  ("x", "s"))
    sig = signature_of(call)
    assert sig.inputs[0] == ("d0", "d1") and sig.inputs[1] == ()
    wider = OpCall(aten.type_as.default, (Ref("x"), Ref("s")), {}, (TensorMeta((), torch.float32),
                   TensorMeta((3, 5), torch.float16)), (TensorMeta((), torch.float16),), ("x", "s"))
    assert all(label.startswith("^") for label in signature_of(wider).inputs[1])  # was an IndexError


class _BrokenRulePlugin:
    @hookimpl
    def nnscaler_register_op_rules(self):
        def broken(call):
            raise IndexError("tuple index out of range")
        return {"aten.relu.default": broken}


def test_a_rule_that_fails_leaves_its_op_whole_and_says_which():
    plugin = _BrokenRulePlugin()
    plugins.register(plugin)
    refresh()
    try:
        meta = TensorMeta((4, 8), torch.float32)
        call = OpCall(aten.relu.default, (Ref("x"),), {}, (meta,), (meta,), ("x",))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sig = signature_of(call)
        assert sig.note == "replicate-only"
        assert any("aten.relu.default" in str(w.message) and "IndexError" in str(w.message) for w in caught)
    finally:
        plugins.unregister(plugin)
        refresh()


class _ReluWholePlugin:
    @hookimpl
    def nnscaler_register_op_rules(self):
        return {"aten.relu.default": lambda call: None}  # declines: relu runs whole


def test_signature_for_follows_the_rule_table_on_a_graph_asked_before():
    """signature_for keeps each op's signature beside its graph; after a rule is registered or
    removed, or `refresh()` (rules changed in place), the next question on the same graph asks the
    rule table again."""
    from nnscaler_plugins.rules import signature_for

    graph = nns.capture(torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU()), (torch.randn(4, 6),))
    (op,) = graph.find(target="aten.relu.default")
    builtin = signature_for(graph, op)
    assert builtin.note != "replicate-only" and signature_for(graph, op) is builtin
    plugin = _ReluWholePlugin()
    plugins.register(plugin)
    try:
        assert signature_for(graph, op).note == "replicate-only"
    finally:
        plugins.unregister(plugin)
    again = signature_for(graph, op)
    assert again == builtin and again is not builtin  # asked the table again
    refresh()  # rules changed in place: asked again too
    assert signature_for(graph, op) is not again


@pytest.mark.parametrize("order", [0, 1])
def test_two_labels_merged_into_one_dim_are_not_split_together(order):
    """A view of (8,) as (2, 2, 2) puts two output labels inside the input's one dim; one block
    factor cannot hold both splits' nesting, so the placement refuses the pair in either order
    (the search and the lowering then keep out such a plan) instead of cutting the wrong elements."""
    from nnscaler_plugins.lower.placement import tensor_blocks
    from nnscaler_plugins.plan.plan import OpPlacement

    call = call_of(aten.view.default, (Ref("x"), [2, 2, 2]), {}, {"x": torch.randn(8)})
    sig = OpChecker(call, {"x": torch.randn(8)}).sig
    inner = [l for l in sig.outputs[0] if merged_host(sig, l, sig.inputs[0]) is not None]
    assert len(inner) == 2, sig
    pair = inner if order == 0 else inner[::-1]
    p = OpPlacement(splits=[(pair[0], 2), (pair[1], 2)], devices=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="both merged into it"):
        tensor_blocks(sig, p, sig.inputs[0], False, 0, 1)
