"""precision="fp8": bf16 training whose linears multiply in float8 through torchao's float8 training.

On a CPU the float8 products are emulated (torchao's emulation: float8 values, fp32 products), so
the numbers are those of a float8 GPU run; a device without float8 matmuls is refused unless
emulation is asked for. The guarantee is torchao's: a small GPT-style model (Llama layers, every
linear converted) trains 50 steps with its losses within 1 % of bf16, alone, under tensor and
sequence parallelism, and under ZeRO-3.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

import models

pytest.importorskip("torchao.float8")

STEPS = 50
LR = 1e-3


def _batches(n: int, batch: int = 4, seq: int = 16) -> list[dict]:
    """A learnable stream: each row counts up by 3 from a random start (mod the vocabulary)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = (torch.randint(0, models.VOCAB, (batch, 1), generator=g) * 5 + 3 * torch.arange(seq)) % models.VOCAB
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _float8_calls(src: str) -> int:
    """Calls of the float8 kernel in the generated `forward` (its `forward_loss` repeats them)."""
    alias = re.search(r"^import nnscaler_plugins\.kernels\.float8 as (\w+)$", src, flags=re.M)
    forward = src.split("\ndef forward(", 1)[-1].split("\ndef ", 1)[0]
    return len(re.findall(rf"\b{alias.group(1)}\.linear\(", forward)) if alias else 0


def _train(pm, batches) -> list[float]:
    import nnscaler_plugins as nns

    opt = nns.build_optimizer(pm, torch.optim.AdamW, lr=LR)
    losses = []
    for b in batches:
        losses.append(pm.train_step(b).item())
        opt.step()
        opt.zero_grad()
    return losses


def test_fp8_trains_within_one_percent_of_bf16():
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.llama_small(1)
    twin = copy.deepcopy(model)
    bf16 = nns.parallelize(model, batch, plan="dp", precision="bf16", cache_dir="/tmp/nns_test_cache")
    fp8 = nns.parallelize(twin, batch, plan="dp", precision="fp8", fp8_emulate=True, cache_dir="/tmp/nns_test_cache")
    assert _float8_calls(fp8.generated_source()) == 8  # 7 linears of the layer and the head
    batches = _batches(STEPS)
    want, got = _train(bf16, batches), _train(fp8, batches)
    assert want[-1] < 0.8 * want[0], f"the model did not learn: {want[0]:.3f} -> {want[-1]:.3f}"
    worst = max(abs(g - w) / w for g, w in zip(got, want))
    assert worst < 0.01, f"fp8 losses {worst:.2%} from bf16 at worst"
    assert got != want  # the products really ran in float8


def test_converted_linears_follow_torchao_defaults_and_the_knobs():
    """Every nn.Linear with both dims divisible by 16 (torchao's default and its hardware rule);
    fp8_linears picks module paths, fp8_skip leaves some out; GPT-2's Conv1D layers are not nn.Linear."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.llama_small(2)

    def calls(**knobs) -> int:
        compiled = nns.compile(model, batch, "tp", world_size=2, precision="fp8", fp8_emulate=True,
                               cache_dir="/tmp/nns_test_cache", **knobs)
        return _float8_calls(compiled.artifact(0).source())

    assert calls() == 15
    assert calls(fp8_skip=["lm_head"]) == 14
    assert calls(fp8_linears=["model.layers.*.mlp.*"]) == 6
    gpt2, b2 = models.gpt2_small()
    compiled = nns.compile(gpt2, b2, "dp", world_size=1, precision="fp8", fp8_emulate=True,
                           cache_dir="/tmp/nns_test_cache")
    assert _float8_calls(compiled.artifact(0).source()) == 1  # only lm_head is an nn.Linear


def test_fp8_knobs_in_plan_files(tmp_path):
    import nnscaler_plugins as nns
    from nnscaler_plugins.plan.plan import Plan

    torch.manual_seed(0)
    model, batch = models.mlp()
    plan = nns.plan(model, strategy="dp", world_size=1, example_inputs=batch, precision="fp8", fp8_recipe="rowwise",
                    fp8_skip=["head"], fp8_linears=["fc*"], fp8_emulate=True)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.precision == "fp8" and loaded.knobs.fp8_recipe == "rowwise" and loaded.knobs.fp8_emulate
    assert loaded.knobs.fp8_skip == ("head",) and loaded.knobs.fp8_linears == ("fc*",)


def test_device_without_float8_matmuls_is_refused_by_name():
    import nnscaler_plugins as nns
    from nnscaler_plugins.errors import PlanError

    torch.manual_seed(0)
    model, batch = models.mlp()
    with pytest.raises(PlanError, match=r"cpu device has no float8 matmul units.*fp8_emulate=True"):
        nns.parallelize(model, batch, plan="dp", precision="fp8", cache_dir="/tmp/nns_test_cache")
    with pytest.raises(Exception, match="fp8_recipe='rowwize'"):
        nns.plan(model, strategy="dp", world_size=1, example_inputs=batch, precision="fp8", fp8_recipe="rowwize")


def test_rowwise_recipes_and_compile():
    """The rowwise recipes run (other numbers than tensorwise, still within 1 % of bf16), and fp8
    composes with compile=True (the float8 products inside the compiled regions)."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.llama_small(1)
    batches = _batches(3)
    runs = {}
    for name, opts in (("bf16", {"precision": "bf16"}),
                       ("tensorwise", {"precision": "fp8", "fp8_emulate": True}),
                       ("rowwise", {"precision": "fp8", "fp8_emulate": True, "fp8_recipe": "rowwise"}),
                       ("gw_hp", {"precision": "fp8", "fp8_emulate": True, "fp8_recipe": "rowwise_with_gw_hp"}),
                       ("compiled", {"precision": "fp8", "fp8_emulate": True, "compile": True,
                                     "compile_backend": "aot_eager"})):
        pm = nns.parallelize(copy.deepcopy(model), batch, plan="dp", cache_dir="/tmp/nns_test_cache", **opts)
        runs[name] = _train(pm, batches)
    assert runs["rowwise"] != runs["tensorwise"] and runs["gw_hp"] != runs["rowwise"]
    for name in ("tensorwise", "rowwise", "gw_hp", "compiled"):
        assert max(abs(a - b) / b for a, b in zip(runs[name], runs["bf16"])) < 0.01, (name, runs)
    torch.testing.assert_close(torch.tensor(runs["compiled"]), torch.tensor(runs["tensorwise"]), rtol=2e-3, atol=0)


def float8_parallel(rank: int, world: int, strategy: str, options: dict, dp: int, steps: int = 8):
    """bf16 on one process and fp8 under the plan (emulated), from the same weights on the same
    global batches: the losses within 1 %, and the plan's linears calling the float8 kernel."""
    import nnscaler_plugins as nns

    torch.manual_seed(0)
    model, batch = models.llama_small(2)
    reference = copy.deepcopy(model)
    batches = _batches(steps)
    n = batch["input_ids"].shape[0] // dp
    local = lambda b: {k: v[(rank // (world // dp)) * n:(rank // (world // dp) + 1) * n] for k, v in b.items()}  # noqa: E731
    pm = nns.parallelize(model, local(batch), plan=strategy, precision="fp8", fp8_emulate=True,
                         cache_dir="/tmp/nns_test_cache", **options)
    problems = []
    if _float8_calls(pm.generated_source()) < 7:
        problems.append(f"only {_float8_calls(pm.generated_source())} float8 linears in the generated file")
    got = _train(pm, [local(b) for b in batches])
    if dp > 1:
        t = torch.tensor(got)
        torch.distributed.all_reduce(t)
        got = (t / world).tolist()
    # the single-process bf16 reference, computed by the model itself under autocast (fp32 master weights)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    want = []
    for b in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(**b).loss
        loss.backward()
        want.append(loss.item())
        opt.step()
        opt.zero_grad()
    worst = max(abs(g - w) / w for g, w in zip(got, want))
    if worst >= 0.01:
        problems.append(f"losses {worst:.2%} from bf16 at worst: {got} vs {want}")
    return problems


@pytest.mark.parametrize("strategy,options,dp", [("megatron", {"tp": 2, "sequence_parallel": True}, 1),
                                                 ("dp", {"zero": 3}, 2)])
def test_fp8_under_tensor_sequence_parallel_and_zero3(workers2, strategy, options, dp):
    problems = workers2.run(float8_parallel, strategy, options, dp)
    assert not any(problems), problems
