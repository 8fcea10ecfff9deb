"""Value reads on tensors made from sizes alone are answered at capture (capture/shape_values.py);
value reads on data are still refused by name.

Lightning's demo Transformer (torch.nn.Transformer, its masks from its own
`generate_square_subsequent_mask`) and an encoder on nn.TransformerEncoder under nn.Transformer's
causal mask (torch's `_detect_is_causal_mask` reads it) are captured and trained under dp and tp (the
encoder also under zero3) on two gloo processes in training mode with dropout on, equal to one process: the one-process reference
draws each dropout under the seed the plan's replica and op draw it with (`piece_rng`; under tp only
the dropouts tensor parallelism keeps whole are on, see `shape_only_models.whole_dropouts_only`).
A model whose read answer changes with the length trains at a second length like eager does.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import shape_only_models as M
from nnscaler_plugins.capture.tracing import CaptureError, capture
from sgd_check import sgd_equivalence


def _sdpa(graph):
    return [op for op in graph.ops if "scaled_dot_product_attention" in str(op.target)]


def _is_causal(op) -> bool:
    return bool(op.args[5] if len(op.args) > 5 else op.kwargs.get("is_causal", False))


# -- capture ------------------------------------------------------------------------------------------
def test_nn_transformer_causal_detection_is_answered():
    model, batch = M.build_causal_encoder()
    g = capture(model, kwargs=batch)
    reads = [r for r in g.folded if r.call == "Tensor.__bool__"]
    assert reads and all(r.value == "True" for r in reads), g.folded
    assert "mask == causal_comparison" in reads[0].code and "shape_only_models.py" in reads[0].source
    calls = _sdpa(g)
    assert calls and all(_is_causal(op) and len(op.inputs) == 3 for op in calls)  # the causal kernel, no mask


def test_lightning_demo_transformer_captures():
    model, batch = M.build_lightning_demo()
    g = capture(model, kwargs=batch)
    assert [r.value for r in g.folded] == ["True"]  # the decoder's tgt_mask, detected causal
    assert model.model.pos_encoder.pe is None  # what forward assigned while traced is not left behind


class _CausalLayer(torch.nn.Module):
    """A layer that makes its own causal mask and asks torch whether it is causal, as nn.Transformer does."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(M.WIDTH, 3 * M.WIDTH)

    def forward(self, h):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(h.shape[1], device=h.device)
        causal = torch.nn.modules.transformer._detect_is_causal_mask(mask)
        q, k, v = self.qkv(h).view(h.shape[0], h.shape[1], 3, 2, M.WIDTH // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True) if causal else \
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return h + a.transpose(1, 2).reshape(h.shape)


class _CausalStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_CausalLayer() for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_reads_inside_repeated_layers_keep_the_two_layer_trace():
    g = capture(_CausalStack(), (torch.randn(2, 8, M.WIDTH),))
    assert g.traced == "two layers" and [r.value for r in g.folded] == ["True", "True"]
    calls = _sdpa(g)
    assert len(calls) == 4 and all(_is_causal(op) for op in calls)


def test_a_mask_that_is_not_causal_is_read_as_such():
    class Windowed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

        def forward(self, x):
            i = torch.arange(x.shape[1], device=x.device)
            keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
            mask = torch.zeros(x.shape[1], x.shape[1], device=x.device).masked_fill(~keep, float("-inf"))
            return self.encoder(x, mask=mask)

    torch.manual_seed(0)
    model = Windowed()
    x = torch.randn(2, 8, 16)
    g = capture(model, (x,))
    assert [r.value for r in g.folded] == ["False"]
    (op,) = _sdpa(g)
    assert not _is_causal(op) and len(op.inputs) == 4  # the window mask is applied


class _LikeScores(torch.nn.Module):
    """A mask made `like` the attention scores (their size, never their values), then compared with
    nn.Transformer's causal mask; `scaled=True` multiplies it by the scores first (their values)."""

    def __init__(self, scaled: bool):
        super().__init__()
        self.proj = torch.nn.Linear(M.WIDTH, M.WIDTH)
        self.scaled = scaled

    def forward(self, x):
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2)
        mask = torch.full_like(scores, float("-inf")).triu(1)
        if self.scaled:
            mask = mask * scores
        if torch.equal(mask[0], torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)):
            scores = scores + mask
        return scores.softmax(-1).sum()


def test_a_mask_made_like_the_scores_is_made_from_sizes():
    x = torch.randn(2, 5, M.WIDTH)
    g = capture(_LikeScores(False), (x,))
    assert [(r.call, r.value) for r in g.folded] == [("torch.equal", "True")]
    assert any(op.op_name == "aten.triu.default" for op in g.ops)  # the graph computes the mask as eager does
    with pytest.raises(CaptureError, match="reads a tensor's value"):
        capture(_LikeScores(True), (x,))  # its values are the scores'


def test_a_value_read_on_data_is_refused_by_name():
    with pytest.raises(CaptureError) as e:
        capture(M.ReadsData(), (torch.randn(2, 4, M.WIDTH),))
    text = str(e.value)
    assert "reads a tensor's value" in text and "shape_only_models.py" in text
    assert "if (x.sum() > 0).item():" in text


def test_a_shape_tensor_too_large_to_compute_is_refused_saying_so():
    class Huge(torch.nn.Module):
        def forward(self, x):
            grid = torch.zeros(x.shape[1] * 1024, 4096, device=x.device)  # 16.8M elements from sizes alone
            if bool((grid != 0).any()):
                return x * 2
            return x

    with pytest.raises(CaptureError) as e:
        capture(Huge(), (torch.randn(2, 5),))
    text = str(e.value)
    assert "made from sizes alone" in text and "20,971,520 elements" in text and "test_shape_values.py" in text


class _Poisoned(torch.nn.Module):
    """A tensor made from sizes, then written in place with data (directly, through a view, or
    through `.data`, which counts its versions apart), then read: its value is the data's."""

    def __init__(self, through: str):
        super().__init__()
        self.through = through

    def forward(self, x):
        m = torch.zeros(x.shape[1], device=x.device)
        target = {"in-place": lambda: m, "view": lambda: m[:2], "data": lambda: m.data}[self.through]()
        target.add_(x[0, :target.shape[0], 0])
        if m.sum().item() > 0:
            return x * 2
        return x


@pytest.mark.parametrize("through", ["in-place", "view", "data"])
def test_a_shape_tensor_written_with_data_is_data(through):
    with pytest.raises(CaptureError, match="reads a tensor's value"):
        capture(_Poisoned(through), (torch.randn(2, 4, 3),))


def test_random_tensors_are_data_and_their_real_value_draws_nothing():
    class Draws(torch.nn.Module):
        def forward(self, x):
            if (torch.rand(x.shape[1]) > 2).any():
                return x * 2
            return x

    class DrawsNothing(torch.nn.Module):
        def forward(self, x):
            return x * 2

    start = torch.random.get_rng_state()
    capture(DrawsNothing(), (torch.randn(2, 4),))
    after_plain = torch.random.get_rng_state()  # whatever torch.export itself draws
    torch.random.set_rng_state(start)
    with pytest.raises(CaptureError, match="reads a tensor's value"):
        capture(Draws(), (torch.randn(2, 4),))
    assert torch.equal(after_plain, torch.random.get_rng_state())  # the rand computed beside the trace is given back


def test_the_answer_is_the_one_at_the_captured_length():
    for length, doubled in ((6, False), (9, True)):
        model, batch = M.build_length_decides(length)
        g = capture(model, kwargs=batch)
        assert [r.value for r in g.folded] == [str(3 if doubled else 2)]
        assert any(op.op_name.startswith("aten.mul") for op in g.ops) == doubled


# -- training on two processes ------------------------------------------------------------------------
@contextlib.contextmanager
def _keyed_dropout(seed: int, forward: int, replica: int):
    """Eager dropout (nn.Dropout's and attention's) drawing what replica `replica` of a plan draws for
    whole ops in forward `forward`: the k-th random call under the seed of (seed, forward, replica, k)."""
    import nnscaler_plugins.kernels.piece_rng as piece_rng

    token = piece_rng.Token(seed, forward, replica)
    calls = [0]
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def keyed(fn, p, device, *args):
        if not p:
            return fn(*args)
        key, calls[0] = calls[0], calls[0] + 1
        with piece_rng.fork(token, key, 0, device):
            return fn(*args)

    def keyed_dropout(x, p=0.5, training=True, inplace=False):
        return keyed(dropout, p if training else 0, x.device, x, p, training, inplace)

    def keyed_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        return keyed(lambda *a: sdpa(*a, **kw), dropout_p, q.device, q, k, v, attn_mask, dropout_p, is_causal)

    F.dropout, F.scaled_dot_product_attention = keyed_dropout, keyed_sdpa  # nn.Dropout and nn.MultiheadAttention call these
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa


def _train_with_dropout(rank, world, builder, strategy, dp, steps=2):
    import nnscaler_plugins as nns

    build = getattr(M, builder)
    torch.manual_seed(0)
    ref, batch = build()
    model, _ = build()
    model.load_state_dict(ref.state_dict())
    ref.train(), model.train()
    n = next(iter(batch.values())).shape[0] // dp

    def rows(r):
        return {k: v[r * n:(r + 1) * n] for k, v in batch.items()}

    replica = rank // (world // dp)
    torch.manual_seed(11)  # the base seed of the plan's random stream
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nns.parallelize(model, rows(replica), plan=strategy, cache_dir="/tmp/nns_test_cache",
                             executor="captured")  # the captured program, not the model's own forward
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    problems = []
    for step in range(steps):
        loss = pm.train_step(rows(replica)).detach().float().clone()
        if dp > 1:
            torch.distributed.all_reduce(loss)
            loss /= world
        ref_loss = 0.0
        for r in range(dp):  # each replica's rows under its own draws; the mean of equal halves' means
            with _keyed_dropout(11, step, r):
                part = ref(**rows(r)) / dp
            part.backward()
            ref_loss = ref_loss + part.detach()
        label = f"{builder} {strategy} step {step}"
        if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
            problems.append(f"{label}: loss {loss.item():.7g} vs one process {ref_loss.item():.7g}")
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
        full = pm.full_state_dict()
        for k, t in ref.state_dict().items():
            if not torch.allclose(full[k].float(), t.float(), rtol=1e-5, atol=1e-6):
                problems.append(f"{label}: {k} differs from one process's by {(full[k] - t).abs().max().item():.3g}")
    return problems


@pytest.mark.parametrize("builder,strategy,dp", [
    ("build_lightning_demo", "dp", 2), ("build_lightning_demo_tp", "tp", 1),
    ("build_causal_encoder", "dp", 2), ("build_causal_encoder_tp", "tp", 1), ("build_causal_encoder", "zero3", 2)],
    ids=["lightning-demo-dp", "lightning-demo-tp", "nn-transformer-encoder-dp", "nn-transformer-encoder-tp",
         "nn-transformer-encoder-zero3"])
def test_trains_like_one_process_with_dropout(workers2, builder, strategy, dp):
    problems = workers2.run(_train_with_dropout, builder, strategy, dp)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)


def _lengths(rank, world, scale, lengths):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sgd_equivalence(rank, world, lambda: M.build_length_decides(lengths[0], scale), "dp",
                               {"executor": "captured"}, 2,
                               steps=len(lengths), batch_of_step=lambda step: M.build_length_decides(lengths[step])[1],
                               what=f"lengths {lengths}")


def _demo_lengths(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sgd_equivalence(rank, world, lambda: M.build_lightning_demo(0.0), "dp", {"executor": "captured"}, 2,
                               steps=3, training=True, what="Lightning demo at lengths 8, 12, 20",
                               batch_of_step=lambda step: M.build_lightning_demo(0.0, (8, 12, 20)[step])[1])


def test_lightning_demo_at_other_lengths_is_answered_again(workers2):
    """The demo's decoder mask is read at each length the programs for other lengths are captured at."""
    problems = workers2.run(_demo_lengths)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)


def test_an_answer_in_the_program_follows_the_length(workers2):
    """`h * int(t.item())`: the factor is 2 at the example's length 6, 3 at 9 and 5 at 15; the
    programs for those lengths are made from captures at other lengths, equal to eager at each."""
    problems = workers2.run(_lengths, True, (6, 9, 15))
    assert not any(problems), "\n".join(p for ps in problems for p in ps)


def _other_ops(rank, world):
    from nnscaler_plugins.errors import PlanError

    try:
        return _lengths(rank, world, False, (6, 9))
    except PlanError as e:
        lines, first = inspect.getsourcelines(M.LengthDecides.forward)
        doubled = first + next(i for i, line in enumerate(lines) if "h = h * 2" in line)
        return [] if f"shape_only_models.py:{doubled}" in str(e) and "other ops" in str(e) else [f"refused: {e}"]


def test_an_answer_that_changes_the_ops_is_never_the_examples(workers2):
    """Doubled at length 9, not at 6: the program at 9 either computes as eager does or is refused
    naming the model's line whose op the example's program lacks, never the example's program run."""
    problems = workers2.run(_other_ops)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)
