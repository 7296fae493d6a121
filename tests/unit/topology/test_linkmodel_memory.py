"""Device memory throughput by GPU model (datasheet figures)."""
from topology.linkmodel import memory_bandwidth


def test_known_models_and_unknown():
    assert memory_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert memory_bandwidth("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert memory_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert memory_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert memory_bandwidth("NVIDIA H200") == 4.8e12
    assert memory_bandwidth("Tesla V100-SXM2-32GB") == 0.9e12
    assert memory_bandwidth("Some CPU") == 0.0
