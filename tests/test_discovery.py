"""discover(): the static file, the real "no NVIDIA tooling" path of this machine, and host facts."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest

from agent.discovery import InventoryFileError, discover, host
from agent.discovery.static import load_static, parse_static

H100_NODE = """
driver_version = "550.54.15"
cuda_version = "12.4"

[[gpus]]
index = 0
uuid = "GPU-4a1c7e2f-9b3d-4c85-a0e6-1f2d3c4b5a69"
name = "NVIDIA H100 80GB HBM3"
compute_capability = "9.0"
memory_total_mib = 81559
pci_bus_id = "0000:1B:00.0"
nvlink_peers = [1]

[[gpus]]
index = 1
uuid = "GPU-7d2e8f31-0c4a-4b96-b1f7-2a3e4d5c6b70"
name = "NVIDIA H100 80GB HBM3"
compute_capability = "9.0"
memory_total_mib = 81559
nvlink_peers = [0]

[[gpus]]
index = 2
uuid = "GPU-9e3f9042-1d5b-4ca7-82a8-3b4f5e6d7c81"
name = "NVIDIA L40S"
compute_capability = "8.9"
memory_total_mib = 46068
"""


def nvidia_tooling_present() -> bool:
    if shutil.which("nvidia-smi"):
        return True
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


# --- static file ------------------------------------------------------------------------------------


def test_static_file_is_the_inventory(tmp_path: Path) -> None:
    path = tmp_path / "gpus.toml"
    path.write_text(H100_NODE)
    inventory = discover(path)
    assert inventory.source == "static"
    assert inventory.error == ""
    assert inventory.driver_version == "550.54.15"
    assert inventory.cuda_version == "12.4"
    assert [gpu.index for gpu in inventory.gpus] == [0, 1, 2]
    first, _, l40s = inventory.gpus
    assert first.compute_capability == (9, 0)
    assert first.memory_total_mib == 81559
    assert first.pci_bus_id == "00000000:1b:00.0"
    assert first.nvlink_peers == (1,)
    assert l40s.compute_capability == (8, 9)
    assert l40s.nvlink_peers == ()
    assert l40s.pci_bus_id == ""
    # Host facts come from the host unless the file sets them.
    assert inventory.cpu_count == host.cpu_count() > 0
    assert inventory.memory_total_mib == host.memory_total_mib() > 0


def test_static_file_may_override_host_facts() -> None:
    inventory = parse_static("gpus = []\ncpu_count = 64\nmemory_total_mib = 1048576\n")
    assert (inventory.cpu_count, inventory.memory_total_mib) == (64, 1048576)


def test_empty_gpu_list_is_a_cpu_only_node(tmp_path: Path) -> None:
    path = tmp_path / "cpu-only.toml"
    path.write_text("gpus = []\n")
    inventory = discover(path)
    assert inventory.gpus == ()
    assert inventory.source == "static"
    assert inventory.error == ""


def static_error(tmp_path: Path, text: str) -> InventoryFileError:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(InventoryFileError) as caught:
        discover(path)
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}: invalid static inventory:")
    return caught.value


def test_static_errors_name_file_key_and_expectation(tmp_path: Path) -> None:
    text = H100_NODE.replace("memory_total_mib = 46068", 'memory_total_mib = "45 GiB"')
    text = text.replace('compute_capability = "8.9"', "compute_capability = 8.9")
    text = text.replace("nvlink_peers = [0]", 'nvlink_peers = [0, "two"]')
    error = static_error(tmp_path, text)
    assert error.problems == (
        "gpus[1].nvlink_peers[1]: expected an integer, got 'two' (line 20)",
        'gpus[2].compute_capability: expected a string "major.minor" such as "9.0", got 8.9 (line 26)',
        "gpus[2].memory_total_mib: expected an integer, got '45 GiB' (line 27)",
    )
    assert "gpus[2].memory_total_mib: expected an integer" in str(error)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "gpus: required field missing"),
        ("gpus = 8\n", "gpus: expected a list, got 8 (line 1)"),
        ("gpus = [8]\n", "gpus[0]: expected a table, got 8 (line 1)"),
        ("gpus = []\ngpu = []\n", "gpu: unknown key (line 2)"),
        ("gpus = []\ndriver_version = 550\n", "driver_version: expected a string, got 550 (line 2)"),
        ("gpus = []\ncpu_count = true\n", "cpu_count: expected an integer, got True (line 2)"),
        (
            '[[gpus]]\nindex = 0\nuuid = "GPU-a"\ncompute_capability = "9.0"\nmemory_total_mib = 1\n',
            "gpus[0].name: required field missing (line 1)",
        ),
        (
            '[[gpus]]\nindex = 0\nuuid = "GPU-a"\nname = "x"\ncompute_capability = "9.0"\n'
            "memory_total_gib = 80\nmemory_total_mib = 1\n",
            "gpus[0].memory_total_gib: unknown key (line 6)",
        ),
        (
            '[[gpus]]\nindex = 0\nuuid = "GPU-a"\nname = "x"\ncompute_capability = "sm90"\nmemory_total_mib = 1\n',
            'gpus[0].compute_capability: expected a string "major.minor" such as "9.0", got \'sm90\' (line 5)',
        ),
        (
            '[[gpus]]\nindex = 0\nuuid = "GPU-a"\nname = "x"\ncompute_capability = "9.0"\nmemory_total_mib = 1\n'
            'nvlink_peers = "1,2"\n',
            "gpus[0].nvlink_peers: expected a list, got '1,2' (line 7)",
        ),
    ],
)
def test_static_type_errors(tmp_path: Path, text: str, problem: str) -> None:
    assert problem in static_error(tmp_path, text).problems


def test_static_consistency_errors(tmp_path: Path) -> None:
    text = (
        H100_NODE.replace("index = 1", "index = 0")
        .replace("nvlink_peers = [1]", "nvlink_peers = [0, 7]")
        .replace('uuid = "GPU-9e3f9042-1d5b-4ca7-82a8-3b4f5e6d7c81"', 'uuid = " "')
        .replace("memory_total_mib = 46068", "memory_total_mib = -1")
    )
    assert static_error(tmp_path, text).problems == (
        "gpus[0].index: GPU index 0 is listed more than once (line 6)",
        "gpus[0].nvlink_peers: GPU 0 cannot be its own peer (line 12)",
        "gpus[0].nvlink_peers: no GPU has index 7 (line 12)",
        "gpus[1].index: GPU index 0 is listed more than once (line 15)",
        "gpus[1].nvlink_peers: GPU 0 cannot be its own peer (line 20)",
        "gpus[2].uuid: expected a non-empty string (line 24)",
        "gpus[2].memory_total_mib: expected a non-negative integer, got -1 (line 27)",
    )


def test_static_not_toml(tmp_path: Path) -> None:
    (problem,) = static_error(tmp_path, "[[gpus]\nindex = 0\n").problems
    assert problem.startswith("not valid TOML:") and "line 1" in problem


def test_static_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(InventoryFileError) as caught:
        load_static(path)
    assert str(caught.value) == f"{path}: invalid static inventory:\n  cannot read: No such file or directory"


# --- no NVIDIA tooling, for real --------------------------------------------------------------------


@pytest.mark.skipif(nvidia_tooling_present(), reason="this machine has NVIDIA tooling")
def test_no_nvidia_tooling_gives_no_gpus_and_both_reasons() -> None:
    inventory = discover(None)
    assert inventory.gpus == ()
    assert inventory.source == ""
    assert inventory.error == "NVML: libnvidia-ml.so.1 not found; nvidia-smi: not on PATH"
    assert inventory.cpu_count > 0
    assert inventory.memory_total_mib > 0


# --- host facts -------------------------------------------------------------------------------------


def test_parse_meminfo() -> None:
    text = "MemTotal:       2113497960 kB\nMemFree:        1993488920 kB\nMemAvailable:   2070000000 kB\n"
    assert host.parse_meminfo(text) == 2113497960 // 1024
    assert host.parse_meminfo("MemFree: 1 kB\n") == 0


def test_memory_without_proc(tmp_path: Path) -> None:
    assert host.memory_total_mib(tmp_path / "meminfo") == 0


def test_cpu_count_follows_affinity() -> None:
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert host.cpu_count() == expected
