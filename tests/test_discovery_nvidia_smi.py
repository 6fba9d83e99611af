"""nvidia-smi fallback: the parsers on recorded and hand-written outputs, and the runner on real processes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from agent.discovery import nvidia_smi
from agent.discovery.nvidia_smi import (
    NvidiaSmiParseError,
    NvidiaSmiUnavailable,
    parse_cuda_version,
    parse_query_gpu,
    parse_topology,
    parse_usage,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def csv_fixture(name: str) -> str:
    """A hand-written CSV fixture without its explanatory comment (nvidia-smi prints no comments)."""
    return "".join(line for line in fixture(name).splitlines(keepends=True) if not line.startswith("#"))


ALL_OTHERS = {i: tuple(j for j in range(8) if j != i) for i in range(8)}
NO_PEERS: dict[int, tuple[int, ...]] = {i: () for i in range(8)}


# --- topo -m -----------------------------------------------------------------------------------------


def test_topology_h100_nv18_every_gpu_peers_with_all_others() -> None:
    assert parse_topology(fixture("topo-h100-8x-nv18.txt")) == ALL_OTHERS


def test_topology_rtx4090_pcie_with_nics_has_no_peers() -> None:
    assert parse_topology(fixture("topo-rtx4090-8x-pcie-nics.txt")) == NO_PEERS


def test_topology_space_separated_variant_of_tab_file() -> None:
    text = fixture("topo-rtx4090-8x-pcie-nics.txt")
    assert "\t" in text
    spaced = text.replace("\t", "    ")
    assert "\t" not in spaced
    assert parse_topology(spaced) == NO_PEERS


def test_topology_tab_separated_variant_of_space_file() -> None:
    text = fixture("topo-h100-8x-nv18.txt")
    # Columns are runs of 2+ spaces; "CPU Affinity" keeps its single space, as nvidia-smi prints it.
    tabbed = re.sub(r" {2,}|(?<=X) ", "\t", text)
    assert "\t" in tabbed
    assert parse_topology(tabbed) == ALL_OTHERS


def test_topology_ignores_terminal_underline_escapes_in_header() -> None:
    text = fixture("topo-h100-8x-nv18.txt")
    header, rest = text.split("\n", 1)
    underlined = f"\x1b[4m{header}\x1b[0m\n{rest}"
    assert parse_topology(underlined) == ALL_OTHERS


def test_topology_bridged_pairs_and_nic_legend() -> None:
    # A100 PCIe cards joined in pairs by NVLink bridges, as newer drivers print it (NIC legend).
    text = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV12\tSYS\tSYS\tNODE\t0-31\t0\t\tN/A\n"
        "GPU1\tNV12\t X \tSYS\tSYS\tNODE\t0-31\t0\t\tN/A\n"
        "GPU2\tSYS\tSYS\t X \tNV12\tSYS\t32-63\t1\t\tN/A\n"
        "GPU3\tSYS\tSYS\tNV12\t X \tSYS\t32-63\t1\t\tN/A\n"
        "NIC0\tNODE\tNODE\tSYS\tSYS\t X \n"
        "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
        "\nNIC Legend:\n\n  NIC0: mlx5_0\n"
    )
    assert parse_topology(text) == {0: (1,), 1: (0,), 2: (3,), 3: (2,)}


def test_topology_without_header_is_an_error() -> None:
    with pytest.raises(NvidiaSmiParseError, match="no header"):
        parse_topology("No devices were found\n")


def test_topology_short_row_is_an_error_naming_the_line() -> None:
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU1\tNV4\n"
    with pytest.raises(NvidiaSmiParseError, match="line 3: GPU1 has 1 cells"):
        parse_topology(text)


# --- --query-gpu -------------------------------------------------------------------------------------


def test_query_gpu_h100() -> None:
    result = parse_query_gpu(csv_fixture("query-gpu-h100-8x.csv"))
    assert result.driver_version == "550.54.15"
    assert [gpu.index for gpu in result.gpus] == list(range(8))
    first, last = result.gpus[0], result.gpus[7]
    assert first.uuid == "GPU-4a1c7e2f-9b3d-4c85-a0e6-1f2d3c4b5a69"
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.compute_capability == (9, 0)
    assert first.memory_total_mib == 81559
    assert first.memory_used_mib == 74213
    assert first.utilization_percent == 87
    assert first.pci_bus_id == "00000000:1b:00.0"
    assert first.nvlink_peers == ()  # peers come from topo -m
    assert last.memory_used_mib == 1 and last.utilization_percent == 0
    assert last.pci_bus_id == "00000000:df:00.0"


def test_recorded_h200_outputs() -> None:
    """nvidia-smi's own output on a one-GPU H200 node (driver 580.159.04): the query row, the
    one-GPU `topo -m` (underlined header, an empty GPU NUMA ID cell), `--version` and the banner."""
    result = parse_query_gpu(fixture("query-gpu-h200-1x.csv"))
    assert result.driver_version == "580.159.04"
    (gpu,) = result.gpus
    assert gpu.uuid == "GPU-9c3a9f27-d9e1-8b3a-af9b-6b147f9fb2d2"
    assert (gpu.name, gpu.compute_capability, gpu.memory_total_mib) == ("NVIDIA H200", (9, 0), 143771)
    assert gpu.pci_bus_id == "00000000:00:06.0"
    assert parse_topology(fixture("topo-h200-1x.txt")) == {0: ()}
    assert parse_cuda_version(fixture("version-h200.txt")) == "13.0"
    assert parse_cuda_version(fixture("smi-h200-1x.txt")) == "13.0"


def test_query_gpu_not_available_values_degrade() -> None:
    result = parse_query_gpu(csv_fixture("query-gpu-a100-4x-na.csv"))
    assert result.driver_version == "535.161.08"
    assert [gpu.compute_capability for gpu in result.gpus] == [(0, 0), (0, 0), (8, 0), (8, 0)]
    assert [gpu.utilization_percent for gpu in result.gpus] == [0, 12, 0, 0]
    assert result.gpus[3].memory_used_mib == 0
    assert all(gpu.memory_total_mib == 81920 for gpu in result.gpus)


def test_query_gpu_without_compute_cap_field() -> None:
    fields = [field for field in nvidia_smi.QUERY_FIELDS if field != "compute_cap"]
    text = "0, GPU-aaaa, Tesla V100-SXM2-32GB, 32510, 0, 0, 00000000:06:00.0, 470.223.02\n"
    (gpu,) = parse_query_gpu(text, fields).gpus
    assert gpu.compute_capability == (0, 0)
    assert gpu.name == "Tesla V100-SXM2-32GB"
    assert gpu.memory_total_mib == 32510


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("0, GPU-a, H100, 9.0, 81559, 0, 0, 00000000:1B:00.0\n", r"line 1: expected 9 fields .* got 8"),
        ("x, GPU-a, H100, 9.0, 81559, 0, 0, 00000000:1B:00.0, 550\n", r"line 1: index is 'x'"),
        ("0, [N/A], H100, 9.0, 81559, 0, 0, 00000000:1B:00.0, 550\n", r"line 1: uuid is \[N/A\]"),
        ("0, GPU-a, H100, nine, 81559, 0, 0, 00000000:1B:00.0, 550\n", r"compute_cap is 'nine'"),
        ("\n0, GPU-a, H100, 9.0, lots, 0, 0, 00000000:1B:00.0, 550\n", r"line 2: memory.total is 'lots'"),
    ],
)
def test_query_gpu_malformed_rows_name_line_and_field(line: str, message: str) -> None:
    with pytest.raises(NvidiaSmiParseError, match=message):
        parse_query_gpu(line)


def test_usage_parse() -> None:
    usage = parse_usage("0, 74213, 87\n1, [N/A], [N/A]\n")
    assert [(u.index, u.memory_used_mib, u.utilization_percent) for u in usage] == [(0, 74213, 87), (1, 0, 0)]


def test_cuda_version() -> None:
    version = (
        "NVIDIA-SMI version  : 550.54.15\nNVML version        : 550.54\n"
        "DRIVER version      : 550.54.15\nCUDA Version        : 12.4\n"
    )
    assert parse_cuda_version(version) == "12.4"
    banner = "| NVIDIA-SMI 535.161.08   Driver Version: 535.161.08   CUDA Version: 12.2     |"
    assert parse_cuda_version(banner) == "12.2"
    assert parse_cuda_version("nothing here") == ""


# --- running nvidia-smi (a stand-in script, run for real) ---------------------------------------------

FAKE = """#!{python}
import sys, time
args = sys.argv[1:]
mode = {mode!r}
fixtures = {fixtures!r}
if mode == "hang":
    time.sleep(30)  # a hung nvidia-smi: the caller's timeout (the deadline under test) must end it
if mode == "driver-down":
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
          "Make sure that the latest NVIDIA driver is installed and running.")
    sys.exit(9)
if args and args[0].startswith("--query-gpu="):
    fields = args[0].split("=", 1)[1].split(",")
    if "compute_cap" in fields and mode == "old-driver":
        print('Field "compute_cap" is not a valid field to query.')
        print("")
        print("Run 'nvidia-smi --help' for usage.")
        sys.exit(2)
    if fields == ["index", "memory.used", "utilization.gpu"]:
        print("0, 74213, 87")
        print("1, 1, 0")
        sys.exit(0)
    text = open(fixtures + "/query-gpu-h100-8x.csv").read()
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        cells = line.split(", ")
        if "compute_cap" not in fields:
            del cells[3]
        print(", ".join(cells))
elif args == ["topo", "-m"]:
    if mode == "no-topo":
        print("Topology not supported", file=sys.stderr)
        sys.exit(3)
    sys.stdout.write(open(fixtures + "/topo-h100-8x-nv18.txt").read())
elif args == ["--version"]:
    if mode == "old-driver":
        print("Unknown option: --version")
        sys.exit(1)
    print("NVIDIA-SMI version  : 550.54.15")
    print("CUDA Version        : 12.4")
else:
    sys.exit(99)
"""


def fake_nvidia_smi(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "nvidia-smi"
    script.write_text(FAKE.format(python=sys.executable, mode=mode, fixtures=str(FIXTURES)))
    script.chmod(0o755)
    return str(script)


def test_discover_through_nvidia_smi(tmp_path: Path) -> None:
    inventory = nvidia_smi.discover_nvidia_smi(executable=fake_nvidia_smi(tmp_path, "ok"))
    assert inventory.source == "nvidia-smi"
    assert inventory.driver_version == "550.54.15"
    assert inventory.cuda_version == "12.4"
    assert inventory.warnings == ()
    assert [gpu.nvlink_peers for gpu in inventory.gpus] == [ALL_OTHERS[i] for i in range(8)]
    assert all(gpu.compute_capability == (9, 0) for gpu in inventory.gpus)


def test_old_driver_without_compute_cap_is_asked_again(tmp_path: Path) -> None:
    inventory = nvidia_smi.discover_nvidia_smi(executable=fake_nvidia_smi(tmp_path, "old-driver"))
    assert len(inventory.gpus) == 8
    assert all(gpu.compute_capability == (0, 0) for gpu in inventory.gpus)
    assert inventory.gpus[0].memory_total_mib == 81559
    assert inventory.cuda_version == ""
    assert any("compute_cap" in warning for warning in inventory.warnings)


def test_topology_failure_keeps_gpus_and_warns(tmp_path: Path) -> None:
    inventory = nvidia_smi.discover_nvidia_smi(executable=fake_nvidia_smi(tmp_path, "no-topo"))
    assert len(inventory.gpus) == 8
    assert all(gpu.nvlink_peers == () for gpu in inventory.gpus)
    (warning,) = inventory.warnings
    assert "NVLink topology unknown" in warning and "Topology not supported" in warning


def test_driver_down_reason_quotes_nvidia_smi(tmp_path: Path) -> None:
    with pytest.raises(NvidiaSmiUnavailable) as caught:
        nvidia_smi.discover_nvidia_smi(executable=fake_nvidia_smi(tmp_path, "driver-down"))
    assert "exited with status 9" in caught.value.reason
    assert "couldn't communicate with the NVIDIA driver" in caught.value.reason
    assert str(caught.value).startswith("nvidia-smi: ")


def test_hung_nvidia_smi_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(NvidiaSmiUnavailable, match=r"did not finish within 0\.5 s"):
        nvidia_smi.discover_nvidia_smi(executable=fake_nvidia_smi(tmp_path, "hang"), timeout_s=0.5)


def test_not_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NvidiaSmiUnavailable) as caught:
        nvidia_smi.discover_nvidia_smi()
    assert str(caught.value) == "nvidia-smi: not on PATH"


def test_usage_through_nvidia_smi(tmp_path: Path) -> None:
    usage = nvidia_smi.usage(executable=fake_nvidia_smi(tmp_path, "ok"))
    assert [(u.index, u.memory_used_mib, u.utilization_percent) for u in usage] == [(0, 74213, 87), (1, 1, 0)]
