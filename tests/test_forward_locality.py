"""Which forwards only compute (`Program.forward_is_local`): only those may run while the data-parallel
replicas still agree on a step's sizes, since a step refused by another replica throws their work away.
A forward that draws random numbers, updates batch-norm statistics or runs a collective must not run
before the agreement: the ranks would drift apart (or wait inside a collective) when a step is refused."""
from __future__ import annotations

import nnscaler_plugins as nns

import models
from test_batch_norm_statistics import build as batch_norm_net


def _program(graph, plan, world=2, **options):
    compiled = nns.compile(graph, None, plan, world_size=world, cache_dir="/tmp/nns_test_cache", **options)
    return compiled.artifact(0).program


def gpt2_without_dropout():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=models.VOCAB, n_positions=32, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    _, batch = models.gpt2_small()
    return GPT2LMHeadModel(cfg), batch


def test_a_plain_data_parallel_forward_only_computes():
    model, batch = gpt2_without_dropout()
    program = _program(nns.capture(model, kwargs=batch), "dp")
    assert not program.draws and not program.forward_communicates(0)
    assert program.forward_is_local(0)


def test_draws_collectives_and_running_statistics_are_not_local():
    model, batch = models.gpt2_small(1)  # dropout 0.1: the forward draws
    assert not _program(nns.capture(model, kwargs=batch), "dp").forward_is_local(0)
    model, batch = gpt2_without_dropout()
    tp = _program(nns.capture(model, kwargs=batch), "tp")  # tensor parallelism: collectives in the forward
    assert tp.forward_communicates(0) and not tp.forward_is_local(0)
    net, batch = batch_norm_net()
    graph = nns.capture(net, kwargs=batch)
    synced = _program(graph, "dp")  # the replicas' moments combined: a collective in the forward
    assert synced.forward_communicates(0) and not synced.forward_is_local(0)
    local = _program(graph, "dp", batch_statistics="local")  # DDP's per-replica statistics: no collective,
    assert not local.forward_communicates(0) and not local.forward_is_local(0)  # but running statistics written
