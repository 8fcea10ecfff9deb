"""A zoo of outside model code (tests/outside_*.py, written the way their projects write them, not
through transformers) and Hugging Face's Llama and Mixtral, each trained under dp, tp, zero3, a
pipeline and, for the mixtures of experts, ep, in training mode, equal to one process on the global
batch (SGD, fp32, relative 1e-5).

The default run trains a few representative cases (each model family once, each strategy once);
NNS_TEST_ALL_PLANS=1 runs the whole matrix.
"""
from __future__ import annotations

import os
import warnings

import pytest

import outside_llama
import outside_moe
import outside_nanogpt
import outside_vit
import zoo_models
from sgd_check import sgd_equivalence

EVERY = os.environ.get("NNS_TEST_ALL_PLANS") == "1"


def _hf(name):
    def build():
        model, batch = zoo_models.ZOO[name]()
        return model, batch
    return build


MODELS = {
    "titan_llama": outside_llama.titan_llama,
    "reference_llama": outside_llama.reference_llama,
    "titan_moe": outside_moe.titan_moe_lm,
    "nanogpt": outside_nanogpt.nanogpt,
    "vit": outside_vit.vit,
    "hf_llama": _hf("llama"),
    "hf_mixtral": _hf("mixtral"),
}
MOE = ("titan_moe", "hf_mixtral")

# strategy -> (options, data-parallel replicas)
STRATEGIES = {"dp": ({}, 2), "tp": ({}, 1), "zero3": ({}, 2), "gpipe": ({"pp": 2, "micro_batches": 2}, 1),
              "ep": ({"ep": 2}, 1)}
ALL = [(m, s) for m in MODELS for s in STRATEGIES if s != "ep" or m in MOE]
# nanoGPT's (logits, loss) read as its loss in a pipeline; a causal mask made by `type_as(h)` that
# crosses a pipeline stage needs no gradient (it waited for one forever).
DEFAULT = [("nanogpt", "gpipe"), ("vit", "zero3"), ("titan_llama", "tp"), ("reference_llama", "gpipe"),
           ("hf_mixtral", "ep")]


def _train(rank, world, name, strategy):
    options, dp = STRATEGIES[strategy]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sgd_equivalence(rank, world, MODELS[name], strategy, options, dp, what=f"{name} {strategy}",
                               training=True)


@pytest.mark.parametrize("name,strategy", ALL if EVERY else DEFAULT)
def test_outside_code_trains_like_one_process(workers2, name, strategy):
    problems = workers2.run(_train, name, strategy)
    assert not any(problems), "\n".join(p for ps in problems for p in ps)
