"""Context parallelism (strategy `cp`): the sequence split across devices, attention by ring,
all-gather or Ulysses, causal load balancing by default. Each plan trains exactly like one process
(SGD, fp32, relative 1e-5), the kernels match whole-sequence attention in value and gradient, and
what cannot run exactly is refused before launch with the sizes named."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from sgd_check import sgd_equivalence

ALL = os.environ.get("NNS_TEST_ALL_PLANS") == "1"
VOCAB = 64


class _Attention(torch.nn.Module):
    """Pre-norm block with grouped-query causal attention written by hand (no library model)."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = torch.nn.Linear(hidden, hidden)
        self.k = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.v = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.o = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.ff = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm(x)
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        return x + self.ff(torch.relu(x))


class CausalLM(torch.nn.Module):
    def __init__(self, layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 32, positions: int = 64):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, hidden)
        self.pos = torch.nn.Embedding(positions, hidden)
        self.layers = torch.nn.ModuleList([_Attention(hidden, heads, kv_heads) for _ in range(layers)])
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def causal_lm(batch: int = 2, seq: int = 16, kv_heads: int = 2, **kw):
    model = CausalLM(kv_heads=kv_heads, **kw)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return model, {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def llama_gqa(batch: int = 2, seq: int = 16):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, : seq // 2 + 1] = -100  # ignored tokens all in the first chunks: the loss must weigh by tokens
    return model, {"input_ids": ids, "labels": labels}


def hf_family(family: str, batch: int = 2, seq: int = 16):
    """A small causal LM of one Hugging Face family (SDPA attention), some labels ignored."""
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  attn_implementation="sdpa")
    gqa = dict(intermediate_size=64, num_key_value_heads=2)
    cfg, cls = {
        "qwen2": lambda: (T.Qwen2Config(**gqa, **common), T.Qwen2ForCausalLM),
        "mistral": lambda: (T.MistralConfig(**gqa, **common), T.MistralForCausalLM),
        "phi3": lambda: (T.Phi3Config(**gqa, **common), T.Phi3ForCausalLM),
        "neox": lambda: (T.GPTNeoXConfig(intermediate_size=64, **common), T.GPTNeoXForCausalLM),
        "gpt2": lambda: (T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa"),
                         T.GPT2LMHeadModel),
    }[family]()
    model = cls(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100
    return model, {"input_ids": ids, "labels": labels}


FAMILIES = ("qwen2", "mistral", "phi3", "neox", "gpt2")
BUILDERS = {"causal": causal_lm, "causal4": functools.partial(causal_lm, layers=4), "llama": llama_gqa, **{f: functools.partial(hf_family, f) for f in FAMILIES}}


def _equivalence(rank, world, model, options, dp):
    return sgd_equivalence(rank, world, BUILDERS[model], "cp", options, dp, cache_dir="/tmp/nns_test_cache_cp")


def _kernel(rank, world, mode, causal, balanced, heads, kv_heads):
    import torch.distributed as dist

    from nnscaler_plugins.layout import chunk_dim
    from nnscaler_plugins.kernels.ring_attention import context_parallel_attention

    torch.manual_seed(0)
    b, s, d = 2, 16, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    g = torch.randn(b, heads, s, d, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    ref.backward(g)
    blocks = -2 if balanced else 1
    local = [chunk_dim(t.detach(), 2, world, rank, blocks).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, is_causal=causal, balanced=balanced, mode=mode, group=dist.group.WORLD)
    out.backward(chunk_dim(g, 2, world, rank, blocks))
    errors = [(out - chunk_dim(ref, 2, world, rank, blocks)).abs().max().item()]
    errors += [(lo.grad - chunk_dim(t.grad, 2, world, rank, blocks)).abs().max().item() for t, lo in zip((q, k, v), local)]
    return max(errors)


@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
def test_kernels_match_whole_attention_in_value_and_gradient(workers2, mode):
    for causal, balanced in ((True, True), (True, False), (False, False)):
        errors = workers2.run(_kernel, mode, causal, balanced, 4, 2)
        assert max(errors) < 1e-12, (mode, causal, balanced, errors)


def test_mirrored_split_is_the_head_tail_balance():
    from nnscaler_plugins.layout import Layout, cat_dim, chunk_dim

    t = torch.arange(16)
    assert [chunk_dim(t, 0, 4, j, -2).tolist() for j in range(4)] == \
        [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert torch.equal(cat_dim([chunk_dim(t, 0, 4, j, -2) for j in range(4)], 0, -2), t)
    lay = Layout.sharded((2, 16, 3), (0, 1, 2, 3), 1, 4, blocks=-2)
    x = torch.randn(2, 16, 3)
    assert torch.equal(lay.assemble({r: lay.slice_full(x, r) for r in range(4)}), x)
    assert Layout.from_json(lay.to_json()) == lay
    # rows of a mirrored sequence split flattened together (b, s) -> b*s: the merged dim in -2b blocks
    # holds each row's pieces (what the placement gives the flattened logits and the loss's rows)
    x = torch.arange(3 * 16).reshape(3, 16)
    for j in range(4):
        assert torch.equal(chunk_dim(x, 1, 4, j, -2).flatten(), chunk_dim(x.flatten(), 0, 4, j, -6))


@functools.lru_cache(maxsize=1)
def _graph24():
    """One capture (length 24) serves the plan and refusal tests."""
    import nnscaler_plugins as nns

    model, batch = causal_lm(seq=24)
    return nns.capture(model, kwargs=batch)


def test_plan_splits_every_attention_and_the_stream_head_tail():
    import nnscaler_plugins as nns

    graph = _graph24()
    plan = nns.plan(graph, strategy="cp", world_size=4)
    attn = [n for n, op in plan.ops.items() if "scaled_dot_product_attention" in n]
    assert len(attn) == 2
    for name in attn:
        assert plan.ops[name].splits == [("s", 4)] and plan.ops[name].blocks == {"s": -2}
    # the residual stream (embeddings' sum, norms, projections) is split too, not only attention
    split = [n for n, op in plan.ops.items() if op.splits]
    assert len(split) > 20, split
    plain = nns.plan(graph, strategy="cp", world_size=4, balance=False)
    assert plain.ops[attn[0]].blocks.get("s", 1) == 1


def test_refused_before_launch_with_sizes():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    graph = _graph24()
    with pytest.raises(PlanError, match=r"sequence length 24 is not divisible by 2 x cp = 16"):
        nns.plan(graph, strategy="cp", world_size=8)
    with pytest.raises(PlanError, match=r"sequence length 24 is not divisible by cp = 16"):
        nns.plan(graph, strategy="cp", world_size=16, balance=False)
    # Ulysses over 4 devices, 2 key/value heads
    with pytest.raises(PlanError, match=r"cp_comm='ulysses' over cp=4 devices needs query heads \(4\) and "
                                        r"key/value heads \(2\) divisible by 4"):
        nns.plan(graph, strategy="cp", world_size=4, cp_comm="ulysses")
    # Ulysses under tp: the heads each device holds (4 / 2 and 2 / 2) must split cp ways again
    with pytest.raises(PlanError, match=r"query heads / tp \(4 / 2 = 2\) and key/value heads / tp \(2 / 2 = 1\) "
                                        r"divisible by 2"):
        nns.plan(graph, strategy="cp", world_size=4, cp=2, tp=2, cp_comm="ulysses")
    with pytest.raises(PlanError, match="cp_comm='ringg'"):
        nns.plan(graph, strategy="cp", world_size=2, cp_comm="ringg")


def test_packed_documents_refused_by_name():
    """position_ids restarting inside a row: Hugging Face builds a per-document mask from them,
    which cp would have to carry around the ring with the keys; refused before launch."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    model, batch = llama_gqa(batch=1)
    batch["position_ids"] = torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0)
    graph = nns.capture(model, kwargs=batch)
    with pytest.raises(PlanError, match=r"attention mask is a tensor \(padding or packed documents\).*Packed "
                                        r"documents"):
        nns.plan(graph, strategy="cp", world_size=2)


WORLD2: list = [("gpt2", {"cp_comm": "ring"})]  # cp=2 also runs by default under cp x dp at world 4
WORLD2_ALL = [("llama", {"cp_comm": "ring"}), ("causal", {"cp_comm": "ring"}), ("causal", {"cp_comm": "allgather"}), ("causal", {"cp_comm": "ulysses"}),
              ("llama", {"cp_comm": "allgather"}), ("llama", {"cp_comm": "ulysses"}),
              ("causal", {"cp_comm": "ring", "balance": False})] + \
    [(f, {"cp_comm": mode}) for f in FAMILIES for mode in ("ring", "ulysses") if (f, mode) != ("gpt2", "ring")]


@pytest.mark.parametrize("model,options", WORLD2 + (WORLD2_ALL if ALL else []))
def test_cp_trains_like_one_process_world2(workers2, model, options):
    problems = workers2.run(_equivalence, model, options, 1)
    assert not any(problems), problems


WORLD4 = [("llama", {"cp_comm": "ring", "cp": 2, "dp": 2}, 2)]
WORLD4_ALL = [("causal", {"cp_comm": "ring"}, 1), ("llama", {"cp_comm": "ring"}, 1), ("causal", {"cp_comm": "allgather"}, 1),
              ("llama", {"cp_comm": "allgather", "cp": 2, "dp": 2}, 2), ("causal", {"cp_comm": "ulysses",
                                                                                  "cp": 2, "dp": 2}, 2),
              ("llama", {"cp_comm": "ulysses", "cp": 2, "dp": 2}, 2), ("causal", {"cp_comm": "ring", "cp": 2, "dp": 2}, 2),
              ("causal", {"cp_comm": "ring", "cp": 2, "dp": 2, "zero": 1}, 2)]


@pytest.mark.parametrize("model,options,dp", WORLD4 + (WORLD4_ALL if ALL else []))
def test_cp_trains_like_one_process_world4(workers4, model, options, dp):
    problems = workers4.run(_equivalence, model, options, dp)
    assert not any(problems), problems


CP_TP: list = []
CP_TP_ALL = [("llama", {"cp_comm": "ring", "cp": 2, "tp": 2}, 1), ("causal", {"cp_comm": "ring", "cp": 2, "tp": 2}, 1), ("causal", {"cp_comm": "allgather", "cp": 2, "tp": 2}, 1),
             ("llama", {"cp_comm": "ulysses", "cp": 2, "tp": 2}, 1)]


@pytest.mark.parametrize("model,options,dp", CP_TP + (CP_TP_ALL if ALL else []))
def test_cp_x_tp_trains_like_one_process(workers4, model, options, dp):
    problems = workers4.run(_equivalence, model, options, dp)
    assert not any(problems), problems


def _megatron_equivalence(rank, world, model, options, dp):
    return sgd_equivalence(rank, world, BUILDERS[model], "megatron", options, dp, cache_dir="/tmp/nns_test_cache_cp")


MEGATRON_CP = [("llama", {"cp_comm": "p2p", "cp": 2, "tp": 2}, 1)]
MEGATRON_CP_ALL = [("causal", {"cp_comm": "a2a", "cp": 2, "pp": 2}, 1), ("causal", {"cp": 2, "dp": 2}, 2)]


@pytest.mark.parametrize("model,options,dp", MEGATRON_CP + (MEGATRON_CP_ALL if ALL else []))
def test_megatron_cp_trains_like_one_process(workers4, model, options, dp):
    """The megatron strategy's cp= (Megatron's rank order: tp innermost, then cp) trains exactly
    like one process."""
    problems = workers4.run(_megatron_equivalence, model, options, dp)
    assert not any(problems), problems


def test_megatron_cp_keeps_tensor_parallel_groups_neighbours_and_refuses_what_it_cannot_run():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    graph = _graph24()
    plan = nns.plan(graph, strategy="megatron", world_size=8, tp=2, cp=2, cp_comm="allgather")
    assert plan.mesh["cp"] == 2 and plan.mesh["tp"] == 2 and plan.dp == 2 and plan.knobs.cp_comm == "allgather"
    # Megatron's rank order: device c * tp + t, a tensor-parallel group on neighbouring devices
    assert plan.mesh.group(0, ["tp"]) == (0, 1) and plan.mesh.group(0, ["cp"]) == (0, 2)
    q = next(op for op in graph.ops if op.op_name.startswith("aten.linear"))
    assert len(plan.ops[q.name].label_counts()) == 2  # split over both: the sequence and the features
    with pytest.raises(PlanError, match="cp_comm='ulysses' over cp=2 devices with the heads split tp=2"):
        nns.plan(graph, strategy="megatron", world_size=4, tp=2, cp=2, cp_comm="a2a")  # Megatron's all-to-all
    with pytest.raises(PlanError, match="sequence_parallel=True with cp=2"):
        nns.plan(graph, strategy="megatron", world_size=4, tp=2, cp=2, sequence_parallel=True)
    with pytest.raises(PlanError, match="cp_comm='ringg'"):
        nns.plan(graph, strategy="megatron", world_size=4, cp=2, cp_comm="ringg")


CP_PP = [("causal", {"cp_comm": "ring", "cp": 2, "pp": 2}, 1)]
CP_PP_ALL = [("llama", {"cp_comm": "ring", "cp": 2, "pp": 2, "micro_batches": 2}, 1),
             ("causal", {"cp_comm": "allgather", "cp": 2, "pp": 2, "schedule": "gpipe", "micro_batches": 2}, 1),
             ("llama", {"cp_comm": "ulysses", "cp": 2, "pp": 2}, 1),
             ("causal", {"cp_comm": "ring", "cp": 2, "pp": 2, "balance": False}, 1),
             ("causal", {"cp_comm": "ring", "cp": 2, "pp": 2, "schedule": "zero-bubble", "micro_batches": 2}, 1),
             ("causal4", {"cp_comm": "ring", "cp": 2, "pp": 2, "schedule": "interleaved", "micro_batches": 2}, 1),
             ("gpt2", {"cp_comm": "ring", "cp": 1, "pp": 2, "dp": 2}, 2),
             ("causal", {"cp_comm": "ring", "cp": 1, "pp": 2, "tp": 2}, 1),
             ("causal", {"cp_comm": "ring", "cp": 2, "pp": 2, "recompute": "full", "micro_batches": 2}, 1),
             ("neox", {"cp_comm": "ring", "cp": 2, "pp": 2}, 1),
             ("qwen2", {"cp_comm": "ulysses", "cp": 2, "pp": 2, "micro_batches": 2}, 1)]


@pytest.mark.parametrize("model,options,dp", CP_PP + (CP_PP_ALL if ALL else []))
def test_cp_x_pp_trains_like_one_process(workers4, model, options, dp):
    """Each pipeline stage's ops sequence-split over the stage's own cp devices."""
    problems = workers4.run(_equivalence, model, options, dp)
    assert not any(problems), problems


def test_cp_x_pp_plan_stages_and_refusals():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    graph = _graph24()
    plan = nns.plan(graph, strategy="cp", world_size=8, cp=2, pp=2, dp=2)
    assert plan.dp == 2 and plan.pipeline is not None and plan.pipeline.stage_devices == [[0, 1], [2, 3]]
    attn = [op for n, op in plan.ops.items() if "scaled_dot_product_attention" in n]
    assert [(op.stage, op.devices, op.splits, op.blocks) for op in attn] == \
        [(0, [0, 1], [("s", 2)], {"s": -2}), (1, [2, 3], [("s", 2)], {"s": -2})]
    with pytest.raises(PlanError, match=r"pp=3 does not divide the world size 4"):
        nns.plan(graph, strategy="cp", world_size=4, cp=2, pp=3)
    with pytest.raises(PlanError, match=r"cannot cut CausalLM into 4 pipeline stages.*2 layers"):
        nns.plan(graph, strategy="cp", world_size=8, cp=2, pp=4)


def test_cp_x_pp_is_priced_by_the_simulator():
    import nnscaler_plugins as nns

    graph = _graph24()
    cluster = nns.cluster("h100-dgx")
    both = nns.simulate(nns.plan(graph, strategy="cp", world_size=4, cp=2, pp=2), cluster, graph)
    alone = nns.simulate(nns.plan(graph, strategy="1f1b", world_size=2, pp=2), cluster, graph)
    assert 0 < both.step_time_s < float("inf")
    assert both.max_memory_bytes < alone.max_memory_bytes  # each stage's activations halved by cp


@pytest.mark.skipif(not ALL, reason="a 10-20 s search; NNS_TEST_ALL_PLANS=1")
def test_search_finds_cp_x_pp_plans_for_long_sequences():
    """The search prices cp inside each intra-op group and pipelines around the groups, so cp x pp
    plans come out of it at long sequences (here 32k tokens, pipelines of 2 stages asked for)."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.search.constraints import PipelineStages

    with torch.device("meta"):
        model = CausalLM(layers=4, heads=16, kv_heads=8, hidden=2048, positions=32768)
    ids = torch.randint(0, VOCAB, (1, 32768), device="meta")
    graph = nns.capture(model, kwargs={"input_ids": ids, "labels": ids})
    result = nns.search(graph, world_size=16, cluster="h100-dgx", constraints=[PipelineStages([2])],
                        progress=False, memory_limit="8GiB")
    found = [p for p in result.plans if p.pipeline is not None and all(
        dict(op.splits).get("s", 1) > 1 for n, op in p.ops.items() if "scaled_dot_product_attention" in n)]
    assert found, [(p.pipeline, p.dp) for p in result.plans]


def saved_activation_bytes(fn, params, which=lambda t: True) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn` runs, parameters
    excepted (only the tensors `which` picks). Measured through the runtime's meter: a parallel
    forward installs saved-tensor hooks of its own, which replace an outer hook and report to the
    innermost meter (`kernels.coshard.active_meter`)."""
    from nnscaler_plugins.kernels.coshard import SavedBytes

    skip = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    class Meter(SavedBytes):
        def _count(self, t):
            st = t.untyped_storage()
            if st.data_ptr() not in skip and st.device.type != "meta" and which(t):
                storages[st.data_ptr()] = st.nbytes()

    meter = Meter()
    with meter():
        fn()
    return sum(storages.values()) + meter.bytes  # meter.bytes: gathered inputs kept as shards


def _memory(rank, world):
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    # hidden 48 != VOCAB: the tensors whose last dim is the vocabulary are the logits and the loss's
    model, batch = causal_lm(batch=2, seq=128, hidden=48, layers=4, positions=128)
    logits = lambda t: t.ndim >= 1 and t.shape[-1] == VOCAB  # noqa: E731
    ref = [saved_activation_bytes(lambda: model(**batch).backward(), list(model.parameters()), w)
           for w in (lambda t: True, logits)]
    pm = nns.parallelize(model, batch, plan="cp", cache_dir="/tmp/nns_test_cache_cp")
    ours = [saved_activation_bytes(lambda: pm.train_step(batch), list(pm.parameters()), w)
            for w in (lambda t: True, logits)]
    return ours, ref


def test_saved_activations_per_device_are_about_one_over_cp(workers4):
    """Each device saves about a quarter of what one process saves at cp=4: the sequence is split
    on every op it reaches, the flattened logits and the loss over them included (their rows are
    the sequence's mirrored pieces of each batch row, see `sequence_choices`)."""
    results = workers4.run(_memory)
    for (ours, ours_logits), (ref, ref_logits) in results:
        # measured: 0.258 (a quarter of the logits and of the loss's log-softmax, plus the label
        # piece); 1.0 when the flattened logits were gathered whole
        assert ours_logits < 0.27 * ref_logits, (ours_logits, ref_logits, ours_logits / ref_logits)
        # measured: 0.288 (0.25 for the split ops; positions and the labels' shift run whole)
        assert ours < 0.30 * ref, (ours, ref, ours / ref)


def test_cost_prices_ring_overlapped_and_ulysses_all_to_all():
    from nnscaler_plugins.search.cluster import cluster as make_cluster
    from nnscaler_plugins.search.context_parallel_cost import AttentionShape, context_parallel_attention_time
    from nnscaler_plugins.search.network import Network, span_of

    cluster = make_cluster("h100-dgx")
    net = Network(cluster)
    span = span_of(cluster, range(8))
    shape = AttentionShape(batch=1, heads=32, kv_heads=8, length=131072, head_dim=128)
    long = context_parallel_attention_time(net, span, shape, 8, "ring", attention_seconds=8.0)
    # at 128k tokens attention compute dwarfs a key/value hop: the ring hides all but the last hop
    hop = net.p2p(shape.kv_bytes(8), False)
    assert long.exposed_comm == pytest.approx(hop)
    assert long.forward == pytest.approx(1.0, rel=1e-6)
    short = context_parallel_attention_time(net, span, shape, 8, "ring", attention_seconds=1e-6)
    assert short.exposed_comm > 10 * hop  # nothing to hide behind: every hop shows
    uly = context_parallel_attention_time(net, span, shape, 8, "ulysses", attention_seconds=8.0)
    assert uly.exposed_comm == pytest.approx(2 * net.all_to_all(2 * shape.q_bytes(1) + shape.kv_bytes(1), span))
    unbalanced = context_parallel_attention_time(net, span, shape, 8, "ring", 8.0, balanced=False)
    assert unbalanced.forward > 1.8 * long.forward
