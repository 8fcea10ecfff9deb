"""Cluster specs: presets, files a user writes, and the local CPU measured."""
from __future__ import annotations

import json

import pytest

import nnscaler_plugins as nns
from nnscaler_plugins.search import ClusterError, ClusterSpec, presets
from nnscaler_plugins.search.network import Network, Span, span_of

GiB = 1024 ** 3


def test_presets():
    v100 = nns.cluster("v100-p3")
    assert (v100.devices_per_node, v100.memory_bytes, v100.peak_flops["fp16"]) == (8, 16 * GiB, 125e12)
    assert v100.inter_node.per_node and v100.inter_node.bandwidth == pytest.approx(25e9 / 8)  # 25 Gbps per node
    a100 = nns.cluster("a100-dgx", nodes=4)
    assert a100.num_devices == 32 and a100.memory_bytes == 80 * GiB and a100.peak_flops["bf16"] == 312e12
    assert a100.inter_node.bandwidth / a100.devices_per_node == pytest.approx(25e9)  # 200 Gb/s HDR per GPU
    h100 = nns.cluster("h100-dgx", nodes=2)
    assert h100.peak_flops["bf16"] == 989e12 and h100.num_devices == 16
    h200 = nns.cluster("h200", nodes=2)
    assert h200.peak_flops["bf16"] == h100.peak_flops["bf16"] and h200.memory_bandwidth > h100.memory_bandwidth
    assert h200.memory_bytes > h100.memory_bytes and h200.kernels is not None
    assert h100.efficiency.tp_comm_overlap and not a100.efficiency.tp_comm_overlap  # today's stack vs 2021's
    assert set(presets()) == {"v100-p3", "a100-dgx", "h100-dgx", "h200", "local-cpu"}


@pytest.mark.parametrize("ext", ["yaml", "json"])
def test_file_round_trip(tmp_path, ext):
    spec = nns.cluster("a100-dgx", nodes=3)
    path = tmp_path / f"cluster.{ext}"
    spec.save(path)
    again = nns.cluster(str(path))
    assert again == spec and again.num_devices == 24
    assert nns.cluster(str(path), nodes=5).nodes == 5


def test_user_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("""
name: lab
nodes: 2
devices_per_node: 4
device: L40S
peak_flops: {bf16: 362e12, fp32: 91.6e12}
memory_bytes: 48e9
memory_bandwidth: 864e9
intra_node: {name: pcie4, bandwidth: 32e9, latency: 10e-6}
inter_node: {name: roce-100g, bandwidth: 12.5e9, latency: 20e-6, per_node: true}
""")
    spec = nns.cluster(str(path))
    assert spec.num_devices == 8 and spec.dtype == "bf16" and spec.flops() == 362e12


def test_bad_input(tmp_path):
    with pytest.raises(ClusterError, match="unknown cluster 'dgx-z'.*v100-p3"):
        nns.cluster("dgx-z")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "nodes": 1}))
    with pytest.raises(ClusterError, match="lacks devices_per_node"):
        nns.cluster(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed")
    with pytest.raises(ClusterError, match="not valid YAML"):
        nns.cluster(str(broken))
    with pytest.raises(ClusterError, match="no peak FLOP/s for its training dtype"):
        ClusterSpec("x", 1, 1, "d", {"fp32": 1e12}, 1e9, 1e9, nns.cluster("a100-dgx").intra_node,
                    nns.cluster("a100-dgx").inter_node, dtype="bf16")


def test_local_cpu_measures_and_caches(tmp_path):
    spec = nns.cluster("local-cpu", devices=2, cache_dir=str(tmp_path))
    assert spec.devices_per_node == 2 and spec.dtype == "fp32"
    assert spec.peak_flops["fp32"] > 1e8 and spec.intra_node.bandwidth > 1e6 and spec.intra_node.latency > 0
    assert "measured" in spec.notes
    cached = list(tmp_path.glob("local-cpu-*.json"))
    assert len(cached) == 1
    again = nns.cluster("local-cpu", devices=2, cache_dir=str(tmp_path))
    assert again == spec  # read back, not measured again: every rank sees the same numbers


def test_local_cpu_falls_back_to_preset_gloo_figures_when_measuring_takes_too_long(tmp_path):
    """A busy machine that cannot finish the gloo measurement in time gets the preset figures, said in
    a warning and in the cluster's notes, instead of a failed plan (the two processes are killed)."""
    from nnscaler_plugins.search.calibrate import DEFAULTS, measurements

    with pytest.warns(UserWarning, match="took longer than 0.01 s.*preset gloo figures"):
        m = measurements(cache_dir=str(tmp_path), gloo_timeout_s=0.01)
    assert (m["gloo_bandwidth"], m["gloo_latency"]) == (DEFAULTS["gloo_bandwidth"], DEFAULTS["gloo_latency"])
    assert m["measured"] and m["matmul_flops"] > 1e8  # what was measured in time is kept
    spec = nns.cluster("local-cpu", devices=2, cache_dir=str(tmp_path))  # the cached figures, nothing waits
    assert "gloo figures preset" in spec.notes and spec.intra_node.bandwidth == DEFAULTS["gloo_bandwidth"]


def test_alpha_beta_on_the_link_hierarchy():
    spec = nns.cluster("a100-dgx", nodes=4)
    net = Network(spec)
    M = 1e9
    inside = span_of(spec, range(8))
    assert inside == Span(8, 1, 8)
    ring = 2 * 7 * net.alpha_in + 2 * 7 / 8 * M / net.beta_in
    assert net.all_reduce(M, inside) == pytest.approx(ring)
    assert net.all_gather(M, inside) == pytest.approx(ring / 2)
    across = span_of(spec, [0, 8, 16, 24])  # one device per node: every byte crosses InfiniBand
    assert net.all_reduce(M, across) == pytest.approx(2 * 3 * net.alpha_x + 2 * 3 / 4 * M / net.beta_x)
    hier = span_of(spec, range(32))  # 8 per node: in-node reduce-scatter, 1/8 across, in-node gather
    expected = 2 * 7 * net.alpha_in + 2 * 7 / 8 * M / net.beta_in + 2 * 3 * net.alpha_x + 2 * 3 / 4 * (M / 8) / net.beta_x
    assert net.all_reduce(M, hier) == pytest.approx(expected)
    assert net.p2p(M, cross_node=True) == pytest.approx(net.alpha_x + M / net.beta_x)
