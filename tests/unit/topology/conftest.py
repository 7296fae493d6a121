"""Shared helpers of the topology tests: fixture hosts and a fake NVML."""
from __future__ import annotations

import shutil
import types
import warnings

import pytest

from topology import discover_host, fixture
from topology.snapshot import FIXTURES_DIR, materialize


def host_of(name: str, **kw):
    """Discover the shipped fixture ``name`` (probe warnings silenced)."""
    fx = fixture(name)
    args = {"root": fx.root, "nvidia_smi_topo": fx.nvidia_smi_topo,
            "nvidia_smi_query": fx.nvidia_smi_query, "live": False}
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover_host(**args)


@pytest.fixture
def host():
    return host_of


@pytest.fixture
def fixture_copy(tmp_path):
    """``fixture_copy(name)``: a private, editable materialised copy of a fixture's tree."""

    def make(name: str):
        root = tmp_path / name
        materialize(FIXTURES_DIR / name / "root.tree", root)
        return root

    return make


class NVMLError(Exception):
    pass


class FakeNVML(types.SimpleNamespace):
    """The pynvml calls the NVML probe makes, answered from a table.

    ``gpus``: list of (name, uuid, bus id, memory bytes, [remote bus id per link]).
    ``p2p_ok``: whether NVLink P2P between GPUs behind a switch reports OK.
    ``ancestor``: (i, j) -> nvmlGpuTopologyLevel value (default 50, SYSTEM).
    """

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_CAPS_INDEX_NVLINK = 2

    def __init__(self, gpus, p2p_ok=True, ancestor=None, fail_init=False, down_links=()):
        super().__init__()
        self.gpus, self.p2p_ok, self.ancestor = gpus, p2p_ok, ancestor or {}
        self.fail_init, self.down_links = fail_init, set(down_links)
        self.shutdown_called = False

    def nvmlInit(self):
        if self.fail_init:
            raise NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h][0]

    def nvmlDeviceGetUUID(self, h):
        return self.gpus[h][1]

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=self.gpus[h][2].encode())

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=self.gpus[h][3], free=0, used=0)

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.gpus[h][4]):
            raise NVMLError("Not Supported")
        return 0 if (h, link) in self.down_links else 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return types.SimpleNamespace(busId=self.gpus[h][4][link])

    def nvmlDeviceGetP2PStatus(self, a, b, caps):
        assert caps == self.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if self.p2p_ok else 4

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor.get((min(a, b), max(a, b)), 50)


A100_BUS = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0",
            "00000000:87:00.0", "00000000:90:00.0", "00000000:B7:00.0", "00000000:BD:00.0"]
SWITCHES = [f"00000000:{b:02X}:00.0" for b in range(0xC4, 0xCA)]  # six NVSwitches


def fake_dgx_a100(**kw) -> FakeNVML:
    """8 A100 on NVSwitch: 12 links each, two to each of six switches."""
    gpus = [("NVIDIA A100-SXM4-80GB", f"GPU-a100-{i}", A100_BUS[i], 80 << 30,
             [SWITCHES[k // 2] for k in range(12)]) for i in range(8)]
    return FakeNVML(gpus, ancestor={(0, 1): 20, (2, 3): 20}, **kw)


V100_BUS = ["0000:06:00.0", "0000:07:00.0", "0000:0a:00.0", "0000:0b:00.0",
            "0000:85:00.0", "0000:86:00.0", "0000:89:00.0", "0000:8a:00.0"]
CUBE = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2,
        (2, 3): 2, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1,
        (6, 7): 2}


def fake_dgx1(**kw) -> FakeNVML:
    """8 V100 in the hybrid cube-mesh, links straight to peer GPUs."""
    remotes = {i: [] for i in range(8)}
    for (a, b), n in CUBE.items():
        remotes[a] += [V100_BUS[b]] * n
        remotes[b] += [V100_BUS[a]] * n
    gpus = [("Tesla V100-SXM2-32GB", f"GPU-v100-{i}", V100_BUS[i], 32 << 30, remotes[i])
            for i in range(8)]
    return FakeNVML(gpus, ancestor={(0, 1): 10}, **kw)


def write(path, text):
    """Replace a materialised file (or symlink) with ``text``."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_nvml():
    """Factories of fake NVML modules: ``.a100()``, ``.dgx1()``, ``.FakeNVML(...)``."""
    return types.SimpleNamespace(a100=fake_dgx_a100, dgx1=fake_dgx1, FakeNVML=FakeNVML,
                                 cube=CUBE, v100_bus=V100_BUS)


@pytest.fixture
def write_file():
    """``write_file(path, text)`` replaces a materialised file, symlink or directory."""
    return write
