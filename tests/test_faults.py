"""Jobs that survive faults, on tp and zero3 (and a pipeline), with nothing lost.

In real processes started here, and only those: a rank SIGKILLed at a seeded random step and a rank
killed while writing a background save (torchrun restarts the job, which resumes from
`nns.checkpoint.latest` and ends with weights exactly equal to an uninterrupted run's, dropout
masks and data order included); a rank stalled inside a step (the other rank's watchdog names it,
the collective, the op and its source line, and every rank's position, within the timeout plus 10
s, then ends its process so torchrun restarts the job); a NaN injected into one rank's batch
(NonFiniteError on every rank at the same step before any weight changes, naming the first op
that made it; or the step skipped everywhere); and a restart on another number of processes (the
global batch kept, the trajectory continued).

torchrun starts are slow on 2 cores, so the scenarios share launches (tests/fault_job.py runs
several in one, restarting once per fault) and the references: one uninterrupted run per plan. The
default suite kills under zero3 and stalls under tp (both resume exactly); NNS_TEST_ALL_PLANS=1 adds
tp's and the pipeline's kill, zero3's stall and the frameworks' resumes.
"""
from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPES = os.path.join(ROOT, "recipes")
if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)

import resilient_train as recipe  # noqa: E402

JOB = os.path.join(HERE, "fault_job.py")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    return env


def torchrun(work: str, args: list[str], nproc: int = 2, restarts: int = 0, timeout: float = 900,
             static: bool = False, share_store: bool = False) -> tuple[int, str]:
    """Run tests/fault_job.py under torchrun, gloo on 127.0.0.1; (exit code, output). Standalone (c10d
    rendezvous on a local store) by default; `static`: a static rendezvous on `--master_port`, as a job
    started by hand is; `share_store`: the workers share the launcher's store (torchrun's default)."""
    launch = (["--master_addr", "127.0.0.1", "--master_port", str(_free_port())] if static else ["--standalone"])
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), "--monitor-interval", "0.5", JOB, "--work", work,
           "--cache-dir", os.path.join(work, "cache")] + args
    env = _env()
    if share_store:
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def events(out: str) -> list[dict]:
    return [json.loads(line.split("[fault] ", 1)[1]) for line in out.splitlines() if "[fault] " in line]


def same_weights(a_path: str, b_path: str) -> list[str]:
    a, b = torch.load(a_path), torch.load(b_path)
    if set(a) != set(b):
        return [f"names differ: {sorted(set(a) ^ set(b))}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> str:
    """One folder for this module's launches, so each plan's uninterrupted reference runs once."""
    return str(tmp_path_factory.mktemp("faults"))


# -- a killed rank, a killed save ------------------------------------------------------------------------------
def test_sigkill_at_a_random_step_resumes_exactly_under_tp_zero3_and_a_pipeline(work):
    # By default zero3 (its sharded optimizer state resumed); tp resumes exactly after its stall in the
    # test below. tp's and the pipeline's kill/resume with NNS_TEST_ALL_PLANS=1 (a torchrun attempt per
    # scenario on 2 cores).
    scenarios = ["zero3:kill"] + (["tp:kill", "pipeline:kill"] if os.environ.get("NNS_TEST_ALL_PLANS") == "1" else [])
    code, out = torchrun(work, ["--scenarios", ",".join(scenarios), "--micro-batch-size", "2"], restarts=3)
    assert code == 0, out[-6000:]
    ev = events(out)
    for s in scenarios:
        name = s.replace(":", "-")
        kill = [e for e in ev if e["event"] == "kill" and e["scenario"] == name]
        resumed = [e for e in ev if e["event"] == "resumed" and e["scenario"] == name]
        assert len(kill) == 1 and len(resumed) == 1, (name, ev)
        # the newest checkpoint complete at the kill (saved every 3 steps, after the step's fault point; the
        # last one may still have been in the writing), never a later one
        last = (kill[0]["step"] - 1) // 3 * 3
        assert resumed[0]["step"] in (last, last - 3), (name, kill, resumed)
        plan = s.split(":")[0]
        assert not same_weights(os.path.join(work, f"{plan}-ref.pt"), os.path.join(work, f"{name}.pt")), name


@pytest.mark.parametrize("share_store", [False, pytest.param(True, marks=pytest.mark.skipif(
    os.environ.get("NNS_TEST_ALL_PLANS") != "1", reason="a second torchrun launch; NNS_TEST_ALL_PLANS=1 runs it"))],
    ids=["own store", "launcher's store"])
def test_a_killed_rank_resumes_exactly_under_a_static_rendezvous(work, share_store):
    """`torchrun --master_port P --max-restarts 1` (no c10d rendezvous): the restarted job meets in the
    store the killed one used, where the killed processes' addresses still are; the default group is
    set up on a view of the store per restart attempt (runtime/job_store.py), so it connects, resumes
    from the last checkpoint and ends with the uninterrupted run's weights."""
    tag = "-static-shared" if share_store else "-static"
    # the restarted rank 1 comes late: rank 0 reads the store first, where rank 1's old address still is
    code, out = torchrun(work, ["--scenarios", "zero3:kill", "--micro-batch-size", "2", f"--work-tag={tag}",
                                "--late-rank-on-restart", "4"],
                         restarts=1, static=True, share_store=share_store)
    assert code == 0, out[-6000:]
    ev = events(out)
    name = "zero3-kill" + tag
    assert [e["event"] for e in ev if e["scenario"] == name].count("resumed") == 1, ev
    assert not same_weights(os.path.join(work, "zero3-ref.pt"), os.path.join(work, f"{name}.pt"))


def test_kill_during_a_background_save_keeps_the_previous_checkpoint(work):
    # tp by default; zero3's (its chunks saved per rank) with NNS_TEST_ALL_PLANS=1
    scenarios = ["tp:savekill"] + (["zero3:savekill"] if os.environ.get("NNS_TEST_ALL_PLANS") == "1" else [])
    code, out = torchrun(work, ["--scenarios", ",".join(scenarios), "--micro-batch-size", "2"], restarts=2)
    assert code == 0, out[-6000:]
    ev = events(out)
    for s in scenarios:
        name = s.replace(":", "-")
        kill = [e for e in ev if e["event"] == "kill during save" and e["scenario"] == name]
        resumed = [e for e in ev if e["event"] == "resumed" and e["scenario"] == name]
        assert len(kill) == 1 and len(resumed) == 1, (name, ev)
        assert ".saving-" in kill[0]["file"], kill  # the save being written, under its hidden name
        # the save of step 6 was killed: the job resumes from step 3's, and the unfinished one was left aside
        assert resumed[0]["step"] == kill[0]["step"] - 3, (name, kill, resumed)
        assert any(".saving-" in n for n in resumed[0]["leftovers"]), resumed
        plan = s.split(":")[0]
        assert not same_weights(os.path.join(work, f"{plan}-ref.pt"), os.path.join(work, f"{name}.pt")), name


# -- the same through the three adapters --------------------------------------------------------------------------
ADAPTER_JOB = os.path.join(HERE, "fault_adapters_job.py")


def test_adapters_resume_a_killed_job_their_own_way_exactly(work):
    """Lightning `fit(ckpt_path="last")` under tp, the Hugging Face Trainer `resume_from_checkpoint=True`
    under zero3, the DeepSpeed engine `load_checkpoint` of the latest tag under tp: a rank SIGKILLed after
    a seeded step, torchrun restarts the job, and the weights end equal to an uninterrupted run's."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    cases = ["lightning:tp", "hf:zero3", "deepspeed:tp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "3", "--monitor-interval", "0.5", ADAPTER_JOB, "--work", work, "--adapters", ",".join(cases)]
    proc = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    ev = events(out)
    for case in cases:
        name = case.replace(":", "-")
        kill = [e for e in ev if e["event"] == "kill" and e["scenario"] == f"{name}-kill"]
        resumed = [e for e in ev if e["event"] == "resumed" and e["scenario"] == f"{name}-kill"]
        assert len(kill) == 1 and len(resumed) == 1, (case, ev)
        assert 2 <= resumed[0]["step"] < kill[0]["step"], (case, kill, resumed)  # from a checkpoint, not the start
        assert not same_weights(os.path.join(work, f"{name}-ref.pt"), os.path.join(work, f"{name}-kill.pt")), case


# -- a stalled rank -------------------------------------------------------------------------------------------
TIMEOUT_S = 4.0


def test_stalled_rank_is_named_with_its_collective_and_the_job_restarts(work):
    # tp by default (collectives inside the ops: the report names the op and its line); zero3's stall
    # (in its parameter gathers) with NNS_TEST_ALL_PLANS=1
    scenarios = ["tp:stall"] + (["zero3:stall"] if os.environ.get("NNS_TEST_ALL_PLANS") == "1" else [])
    code, out = torchrun(work, ["--scenarios", ",".join(scenarios), "--micro-batch-size", "2",
                                "--collective-timeout", str(TIMEOUT_S)], restarts=2)
    assert code == 0, out[-6000:]
    ev = events(out)
    for s in scenarios:
        name = s.replace(":", "-")
        stall = [e for e in ev if e["event"] == "stall" and e["scenario"] == name]
        assert len(stall) == 1, ev
        reports = glob.glob(os.path.join(work, name, "reports", "hang-*.json"))
        assert [os.path.basename(r) for r in reports] == [f"hang-step{stall[0]['step']}-rank00000.json"], reports
        with open(reports[0]) as f:
            report = json.load(f)
        text = report["message"]
        assert report["missing_ranks"] == [1], text
        assert "Missing: rank 1 did not reach it" in text, text
        # the collective, the op it serves and that op's source line in the model
        assert "over ranks [0, 1]" in text and ("fault_job.py:" in text or "resilient_train.py:" in text), text
        assert report["op"] or report["collective"], report
        # every rank's position: step, phase, stage, micro-batch; rank 1 is not waiting
        for r in (0, 1):
            assert f"rank {r}" in text and f"step {stall[0]['step']}, forward" in text, text
        assert "not waiting for other ranks" in text.split("rank 1:")[1], text
        assert text in out  # also on the job's output
        waited = report["unix_time"] - json.load(open(os.path.join(work, f"fault-{name}.json")))["time"]
        assert waited <= TIMEOUT_S + 10, waited
        assert "exit code 75" in out
        resumed = [e for e in ev if e["event"] == "resumed" and e["scenario"] == name]
        assert len(resumed) == 1, ev
        plan = s.split(":")[0]
        assert not same_weights(os.path.join(work, f"{plan}-ref.pt"), os.path.join(work, f"{name}.pt")), name


# -- a restart on another world size ------------------------------------------------------------------------------
def eager_reference(steps: int, global_batch: int = 8, lr: float = 0.05) -> dict:
    """One process, no plan: the same model, global batches and SGD with momentum."""
    model = recipe.build_model(0, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        model(**recipe.global_batch(step, global_batch)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_restart_on_fewer_processes_keeps_the_global_batch_and_the_trajectory(work):
    scenarios = "tp:none,zero3:none"
    common = ["--scenarios", scenarios, "--no-reference", "--micro-batch-size", "2", "--dropout", "0",
              "--work-tag=-resize"]
    code, out = torchrun(work, common + ["--steps", "6", "--final-tag=-2procs"], nproc=2)
    assert code == 0, out[-6000:]
    code, out = torchrun(work, common + ["--steps", "12", "--final-tag=-1proc"], nproc=1)
    assert code == 0, out[-6000:]
    want = eager_reference(12)
    for plan, micro in (("tp", 4), ("zero3", 4)):
        # resumed on 1 process from the 2-process job's step 6, each step cut into 4 micro-batches of 2
        assert f"resumed from {work}/{plan}-none-resize/step-00000006 at step 6 on 1 process(es)" in out, out[-4000:]
        got = torch.load(os.path.join(work, f"{plan}-none-resize-1proc.pt"))
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{plan} {k}: {m}")
    assert out.count("4 micro-batch(es) per step") == 2, out[-4000:]


# -- a non-finite value ------------------------------------------------------------------------------------------
def _nonfinite(rank: int, world: int, plan: str, mode: str, bad_step: int = 2, steps: int = 4) -> dict:
    """Train the recipe's model (no dropout); rank 1's batch holds a NaN at `bad_step`."""
    import nnscaler_plugins as nns

    def batch(step: int) -> dict:
        b = recipe.replica_slice(recipe.global_batch(step, 8), pm.dp_rank, pm.dp_size)
        if step == bad_step and rank == 1:
            b = dict(b, x=b["x"].clone())
            b["x"][0, 3] = float("nan")
        return b

    pm = None
    dp = recipe.replicas(plan, world, {})
    example = recipe.replica_slice(recipe.global_batch(0, 8), rank // (world // dp), dp)
    pm = nns.parallelize(recipe.build_model(0, dropout=0.0), example, plan=plan, cache_dir="/tmp/nns_test_cache",
                         on_nonfinite="skip" if mode.startswith("skip") else mode)
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.05, momentum=0.9)
    out: dict = {"skipped": []}
    for step in range(steps):
        if mode == "skip-reference" and step == bad_step:
            continue  # the run the skipped one must equal: that step never taken
        pm.train_step(batch(step))
        if step == bad_step and mode == "raise":
            before = pm.full_state_dict()
            try:
                opt.step()
            except nns.NonFiniteError as e:
                out["error"] = (str(e), e.step, e.op, e.rank)
            out["unchanged"] = all(torch.equal(before[k], v) for k, v in pm.full_state_dict().items())
            return out
        opt.step()
        if opt.last_step_skipped:
            out["skipped"].append(step)
        opt.zero_grad()
    out["weights"] = pm.full_state_dict()
    return out


@pytest.mark.parametrize("plan", ["dp", "tp", "zero3"])  # dp: the loss flag agreed behind backward
def test_nonfinite_raises_on_every_rank_before_any_weight_changes(workers2, plan):
    results = workers2.run(_nonfinite, plan, "raise")
    for r in results:
        assert "error" in r and r["unchanged"], r
    messages = {r["error"][0] for r in results}
    assert len(messages) == 1, messages  # the same error, at the same step, on every rank
    text, step, op, where = results[0]["error"]
    assert step == 3 and where == 1, text  # the third optimizer step; the NaN entered on rank 1
    # the first op in program order whose output was not finite: the input layer, on rank 1
    assert "in inp at resilient_train.py:" in op and "h = self.inp(x)" in text, text
    assert "micro-batch 0" in text and "rank 1" in text, text


@pytest.mark.parametrize("plan", ["dp", "tp", "zero3"])  # dp: the loss flag agreed behind backward
def test_nonfinite_step_is_skipped_on_every_rank(workers2, plan):
    skipped = workers2.run(_nonfinite, plan, "skip")
    reference = workers2.run(_nonfinite, plan, "skip-reference")
    for got, want in zip(skipped, reference):
        assert got["skipped"] == [2] and want["skipped"] == [], (got["skipped"], want["skipped"])
        assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items())


class _OffsetLoss(torch.nn.Module):
    """A regression whose loss adds a batch-given offset: an infinite offset makes the loss infinite
    while every gradient stays finite (the offset needs none)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.lin(x), y) + offset.sum()


def _loss_only_nonfinite(rank: int, world: int, skip_reference: bool) -> dict:
    """dp over 2 ranks; at step 2 rank 1's loss alone is infinite, its gradients finite."""
    import nnscaler_plugins as nns

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(100 * step + rank)
        bad = step == 2 and rank == 1
        return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g),
                "offset": torch.full((1,), float("inf") if bad else 0.0)}

    torch.manual_seed(0)
    pm = nns.parallelize(_OffsetLoss(), batch(0), plan="dp", cache_dir="/tmp/nns_test_cache", on_nonfinite="skip")
    opt = nns.build_optimizer(pm, torch.optim.SGD, lr=0.05)
    skipped, flags = [], []
    for step in range(4):
        if skip_reference and step == 2:
            continue
        pm.train_step(batch(step))
        grads = [p.grad for p in pm.parameters() if p.grad is not None]
        flags.append(all(bool(torch.isfinite(g).all()) for g in grads))
        opt.step()
        if opt.last_step_skipped:
            skipped.append(step)
        opt.zero_grad()
    return {"skipped": skipped, "finite_grads": flags,
            "weights": {k: v.clone() for k, v in pm.full_state_dict().items()}}


def test_a_loss_nonfinite_on_one_rank_only_skips_the_step_on_every_rank_under_dp(workers2):
    """Under plain dp the loss's flag is summed with the first gradient bucket (no collective of its
    own). Rank 1's loss alone is infinite and every gradient finite, so only that carried flag tells
    rank 0 to skip: both skip the same step and end equal to a run that never took it."""
    got = workers2.run(_loss_only_nonfinite, False)
    want = workers2.run(_loss_only_nonfinite, True)
    for g, w in zip(got, want):
        assert all(g["finite_grads"]), g["finite_grads"]
        assert g["skipped"] == [2] and w["skipped"] == [], (g["skipped"], w["skipped"])
        for k, v in w["weights"].items():
            assert torch.equal(g["weights"][k], v), k


# -- the pieces, in one process ------------------------------------------------------------------------------------
def test_latest_finds_the_newest_complete_checkpoint_and_skips_unfinished_ones(tmp_path):
    import nnscaler_plugins as nns

    root = str(tmp_path)
    assert nns.checkpoint.latest(root) is None and nns.checkpoint.latest(str(tmp_path / "nowhere")) is None
    model = torch.nn.Linear(4, 4)
    nns.checkpoint.save(os.path.join(root, "step-1"), model, step=1)
    nns.checkpoint.save(os.path.join(root, "step-2"), model, step=2)
    assert nns.checkpoint.latest(root) == os.path.join(root, "step-2")
    # what a save killed on its way leaves: a hidden directory, and (copied by hand) a truncated one
    os.makedirs(os.path.join(root, ".step-3.saving-0123"))
    trunc = os.path.join(root, "step-4")
    subprocess.run(["cp", "-r", os.path.join(root, "step-2"), trunc], check=True)
    with open(os.path.join(trunc, "rank-00000.bin"), "r+b") as f:
        f.truncate(10)
    os.makedirs(os.path.join(root, "notes"))
    assert nns.checkpoint.latest(root) == os.path.join(root, "step-2")
    assert nns.checkpoint.load(nns.checkpoint.latest(root), model) == {"step": 2}
    assert nns.checkpoint.latest(os.path.join(root, "step-1")) == os.path.join(root, "step-1")


def test_background_save_writes_the_state_of_the_call_while_training_goes_on(tmp_path):
    import nnscaler_plugins as nns
    from nnscaler_plugins.checkpoint import CheckpointError

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    first = nns.checkpoint.save(str(tmp_path / "a"), model, opt, background=True, step=1)
    assert isinstance(first, nns.checkpoint.SaveHandle)
    with torch.no_grad():  # training changes the weights while the thread writes
        for p in model.parameters():
            p.add_(1.0)
    second = nns.checkpoint.save(str(tmp_path / "b"), model, opt, background=True, step=2)  # waits for the first
    assert first.done() and first.wait() == str(tmp_path / "a")
    assert second.wait() == str(tmp_path / "b")
    fresh = torch.nn.Linear(64, 64)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert nns.checkpoint.load(str(tmp_path / "a"), fresh, fresh_opt) == {"step": 1}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    assert fresh_opt.state_dict()["state"][0]["momentum_buffer"] is not None
    # a failure in the background is raised by wait(), and the previous checkpoint stays
    bad = nns.checkpoint.save(str(tmp_path / "a"), model, background=True, callback=lambda: None)
    with pytest.raises(CheckpointError, match="untouched"):
        bad.wait()
    assert nns.checkpoint.load(str(tmp_path / "a"), fresh) == {"step": 1}
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


# -- two launchers as two nodes -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_as_two_nodes_train_like_one_process(work):
    """torchrun started twice with --nnodes 2 --nproc-per-node 2 and a c10d rendezvous on 127.0.0.1: the
    mesh knows two ranks share each node (tp inside a node, dp across) and the job trains like one process."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
           "--monitor-interval", "0.5", JOB, "--work", work, "--cache-dir", os.path.join(work, "cache"),
           "--scenarios", "tp:none", "--no-reference", "--work-tag=-two-nodes", "--option", "tp=2",
           "--micro-batch-size", "2", "--dropout", "0", "--steps", "4"]
    nodes = [subprocess.Popen(cmd, cwd=work, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-4000:] for o in outs)
    mesh = [e for o in outs for e in events(o) if e["event"] == "mesh"]
    assert len(mesh) == 1, mesh  # rank 0 (on one of the two nodes) says it
    assert mesh[0]["axes"] == {"dp": 2, "tp": 2} and mesh[0]["devices_per_node"] == 2, mesh
    assert mesh[0]["nodes"] == [0, 0, 1, 1] and mesh[0]["inner_within_node"] is True, mesh
    assert mesh[0]["dp_across_nodes"] is False, mesh
    got = torch.load(os.path.join(work, "tp-none-two-nodes.pt"))
    for k, v in eager_reference(4).items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_the_search_plans_for_the_launchers_nodes(monkeypatch):
    """`auto` under a launcher that started 2 processes per node searches a cluster of such nodes
    (tensor parallelism stays inside a node), and the plan's mesh records them."""
    import nnscaler_plugins as nns
    from nnscaler_plugins.session import Session
    from nnscaler_plugins.strategies import auto as auto_strategy

    seen = []

    def cluster(name, nodes=None, devices=None, **kw):
        seen.append((name, nodes, devices))
        return nns.cluster(name, nodes=nodes, devices=devices, measure=False)

    monkeypatch.setattr(auto_strategy, "make_cluster", cluster)
    session = Session("auto")
    session.devices_per_node = 2
    model, batch = recipe.build_model(0, dropout=0.0), recipe.global_batch(0, 8)
    plan = session.plan_for(model, batch, 4)
    assert seen == [("local-cpu", 2, 2)], seen
    assert plan.mesh.devices_per_node == 2 and plan.mesh.within_node(["tp", "cp"]) is True, plan.mesh


def test_nonfinite_flag_sees_nan_and_both_infinities_in_any_tensor():
    """The per-step check: a NaN, +inf or -inf anywhere (one element of a half tensor, or beside
    finite values whose squares overflow the CPU's screening 2-norm) sets the flag, finite values
    of any size do not."""
    from nnscaler_plugins.runtime.nonfinite import nonfinite_flag

    cpu = torch.device("cpu")
    tensors = [torch.randn(300, 7), torch.full((5,), -3.0e38), torch.randn(64).half(), None, torch.arange(4),
               torch.full((3,), 2.0e20).bfloat16()]
    assert nonfinite_flag(tensors, cpu).item() == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (2, 1, 5):
            t = [x.clone() if x is not None else None for x in tensors]
            t[where][-1] = bad
            assert nonfinite_flag(t, cpu).item() == 1.0, (bad, where)
    assert nonfinite_flag([], cpu).item() == 0.0


def test_the_watchdog_thread_ends_when_its_module_is_gone_and_when_stopped():
    """No thread outlives what it watches (Lightning's fixtures fail a test that leaves one; a notebook
    would gather them): the thread ends once the watched recorder is gone, and at `stop` (a strategy's
    teardown); watching again starts it again."""
    import gc
    import threading
    import time

    from nnscaler_plugins.runtime.flight_recorder import FlightRecorder
    from nnscaler_plugins.runtime.watchdog import Watchdog

    def alive() -> bool:
        return any(t.name == "nnscaler-watchdog" and t.is_alive() for t in threading.enumerate())

    def ends_within(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not alive()

    assert ends_within(5.0)  # none left from earlier tests in this process
    dog = Watchdog()
    program = type("P", (), {"ranks": [], "plan": None})()
    rec = FlightRecorder.__new__(FlightRecorder)  # only its identity is watched here
    dog.watch(rec, 1.0, "nnscaler_reports", torch.device("cpu"))
    assert alive()
    dog.stop()
    assert ends_within(5.0)
    dog.watch(rec, 1.0, "nnscaler_reports", torch.device("cpu"))
    assert alive()
    del rec, program
    gc.collect()
    assert ends_within(5.0)
