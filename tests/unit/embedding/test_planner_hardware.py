"""Hardware numbers come from the topology layer's host, spec and link models."""
import pytest

from embedding.planner import Hardware, Workload, plan_sharding
from embedding.planner.hardware import (hardware_for, load_host, load_target, target_names,
                                        target_of_host)
from embedding.planner.tables import preset_tables
from embedding.presets import preset_pooling, synthetic_pooling
from topology import linkmodel
from topology.types import LinkKind

GIB = 1 << 30


def test_captured_dgx_a100_gives_links_memory_and_node_shape():
    host = load_host("dgx-a100")
    params = linkmodel.link_model(host)
    target = target_of_host(host)
    assert target.fabric.intra.bandwidth == params[LinkKind.NVLINK].bandwidth
    assert target.fabric.inter.bandwidth == params[LinkKind.INFINIBAND].bandwidth
    assert target.fabric.nics_per_node == sum(1 for n in host.nics if n.active
                                              and n.link_kind is LinkKind.INFINIBAND)
    hw = hardware_for(target, 16)
    assert (hw.ranks_per_node, hw.num_nodes) == (len(host.gpus), 16 // len(host.gpus))
    assert hw.device_memory == min(g.memory_bytes for g in host.gpus)
    assert hardware_for(target, 4).ranks_per_node == 4  # at most the world
    assert load_target("dgx-a100") == target


def test_fabric_spec_zionex():
    from topology.spec import load_spec

    spec = load_spec("zionex")
    target = load_target("zionex")
    assert target.devices_per_host == spec.gpus
    assert target.fabric.nics_per_node == spec.nic.count
    assert target.fabric.inter.bandwidth == linkmodel.nic_bandwidth(spec.nic.min_rate_gbps)
    assert target.fabric.intra.bandwidth == \
        spec.nvlink.min_lanes * linkmodel.nvlink_lane_bandwidth(spec.gpu_model)
    assert target.device_memory == int(spec.min_gpu_memory_gib * GIB)
    hw = hardware_for(target, 128, device_memory=80 * GIB)
    assert (hw.num_nodes, hw.ranks_per_node) == (16, 8)
    assert "zionex" in target_names() and "dgx-a100" in target_names()


def test_cpu_host_needs_explicit_memory():
    target = load_target("cpu-host")
    with pytest.raises(ValueError, match="memory"):
        hardware_for(target, 2)
    assert hardware_for(target, 2, device_memory=GIB).device_memory == GIB


def test_unknown_target_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="fabric: expected one of"):
        load_target("no-such-host")
    bad = tmp_path / "topo.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="fabric"):
        load_target(str(bad))
    spec = tmp_path / "spec.toml"
    spec.write_text("[fabric]\nname = 'x'\n[cluster]\nnodes = 0\n")
    with pytest.raises(ValueError, match="fabric: .*spec.toml"):
        load_target(str(spec))


def test_memory_bandwidth_sets_lookup_copy_and_reduce_rates():
    plain = Hardware(8, 8, GIB)
    assert plain.lookup_rate == 2 * plain.fabric.copy_bandwidth
    fast = Hardware(8, 8, GIB, memory_bandwidth=2e12)
    assert fast.lookup_rate == 2e12
    assert fast.fabric.copy_bandwidth == 1e12
    assert fast.fabric.reduce_bandwidth == pytest.approx(2e12 / 3)
    with pytest.raises(ValueError, match="memory_bandwidth"):
        Hardware(8, 8, GIB, memory_bandwidth=-1.0)
    tables, _ = preset_tables("criteo-1tb")
    slow_step = plan_sharding(tables, Hardware(8, 8, 80 * GIB)).step_seconds
    fast_step = plan_sharding(tables, Hardware(8, 8, 80 * GIB, memory_bandwidth=2e12)).step_seconds
    assert fast_step < slow_step


def test_synthetic_pooling_is_part_of_the_preset():
    tables, cons = preset_tables("synthetic-20")
    assert len(tables) == 20 and set(cons) == {t.name for t in tables}
    assert all(1.0 <= c.ids_per_sample <= 100.0 for c in cons.values())
    assert preset_pooling("synthetic-20") == synthetic_pooling(20)
    assert preset_pooling("criteo-1tb") == {}
    heavy = max(cons, key=lambda k: cons[k].ids_per_sample)
    report = plan_sharding(tables, Hardware(4, 4, 80 * GIB), Workload(), constraints=cons)
    light = plan_sharding(tables, Hardware(4, 4, 80 * GIB), Workload())
    assert report.step_seconds > light.step_seconds
    assert heavy in {t.table for t in report.tables}


def test_a_captured_host_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
    """The planner probes a captured host's tree and keeps only what it found: a job
    killed after planning (SIGKILL skips exit handlers) leaves no tree behind."""
    import tempfile

    from embedding.planner.hardware import load_host

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    host = load_host("cpu-host")
    assert host.cpus > 0
    assert list(tmp_path.iterdir()) == []
