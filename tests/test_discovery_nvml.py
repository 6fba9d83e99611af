"""NVML discovery against a stand-in for ``pynvml`` (no GPU on the machines these tests run on).

The stand-in imitates pynvml's surface closely: the same function names, exceptions derived from one
NVMLError, structures with ``total``/``used``/``gpu``/``busId`` attributes, bytes from some calls.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import attrs
import pytest

from agent.discovery.nvml import NvmlSession, NvmlUnavailable, discover_nvml

MIB = 1024 * 1024
SWITCH_BUS_IDS = ("00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0")
H100_BUS_IDS = (
    "00000000:1B:00.0",
    "00000000:43:00.0",
    "00000000:52:00.0",
    "00000000:61:00.0",
    "00000000:9D:00.0",
    "00000000:C3:00.0",
    "00000000:D1:00.0",
    "00000000:DF:00.0",
)


class FakeNVMLError(Exception):
    def __str__(self) -> str:
        return self.args[0] if self.args else "Unknown Error"


class FakeNotSupported(FakeNVMLError):
    def __init__(self) -> None:
        super().__init__("Not Supported")


class FakeFunctionNotFound(FakeNVMLError):
    def __init__(self) -> None:
        super().__init__("Function Not Found")


class FakeLibraryNotFound(FakeNVMLError):
    def __init__(self) -> None:
        super().__init__("NVML Shared Library Not Found")


@attrs.define
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] = (9, 0)
    total_mib: int = 81559
    used_mib: int = 0
    #: What the driver keeps for itself: NVML's v1 memory query counts it as used, v2 does not.
    reserved_mib: int = 0
    utilization: int = 0
    bus_id: str | bytes = ""
    #: link number -> (remote PCI bus id, remote device type: 0 GPU, 1 IBM NPU, 2 switch)
    links: dict[int, tuple[str, int]] = attrs.Factory(dict)
    #: calls (pynvml function names) that raise, e.g. {"nvmlDeviceGetUtilizationRates": FakeNotSupported}
    failing: dict[str, Callable[[], Exception]] = attrs.Factory(dict)


class FakeNvml:
    """Old pynvml: no nvmlDeviceGetNvLinkRemoteDeviceType (see FakeNvmlWithDeviceType)."""

    NVMLError = FakeNVMLError
    NVMLError_NotSupported = FakeNotSupported
    NVMLError_LibraryNotFound = FakeLibraryNotFound
    NVMLError_FunctionNotFound = FakeFunctionNotFound
    NVML_NVLINK_MAX_LINKS = 18
    nvmlMemory_v2 = 0x2000028  # pynvml's value
    NVML_FEATURE_ENABLED = 1

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        init_error: Exception | None = None,
        driver: str | bytes = b"550.54.15",
        cuda: int = 12040,
        unopenable: frozenset[int] = frozenset(),
        memory_v2: bool = True,
    ) -> None:
        self.memory_v2 = memory_v2
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.unopenable = unopenable
        self.calls: list[str] = []

    def _gpu(self, handle: Any, call: str) -> FakeGpu:
        self.calls.append(call)
        assert isinstance(handle, FakeGpu)
        if call in handle.failing:
            raise handle.failing[call]()
        return handle

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self.calls.append("nvmlDeviceGetHandleByIndex")
        if index in self.unopenable:
            raise FakeNVMLError("Insufficient Permissions")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._gpu(handle, "nvmlDeviceGetCudaComputeCapability").capability

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        """pynvml's: without ``version`` the v1 call (used includes the reserved memory), with
        ``nvmlMemory_v2`` the v2 call, which an older driver does not have."""
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        total, used, reserved = gpu.total_mib * MIB, gpu.used_mib * MIB, gpu.reserved_mib * MIB
        if version is None:
            return SimpleNamespace(total=total, used=used + reserved, free=total - used - reserved)
        assert version == self.nvmlMemory_v2, version
        if not self.memory_v2:
            raise FakeFunctionNotFound()
        return SimpleNamespace(
            version=version, total=total, reserved=reserved, used=used, free=total - used - reserved
        )

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return SimpleNamespace(gpu=self._gpu(handle, "nvmlDeviceGetUtilizationRates").utilization, memory=0)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return SimpleNamespace(busId=self._gpu(handle, "nvmlDeviceGetPciInfo").bus_id)

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkState")
        if not gpu.links:
            raise FakeNotSupported()
        if link >= 18:
            raise FakeNVMLError("Invalid Argument")
        return 1 if link in gpu.links else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkRemotePciInfo")
        return SimpleNamespace(busId=gpu.links[link][0].encode())


class FakeNvmlWithDeviceType(FakeNvml):
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_IBMNPU = 1
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetNvLinkRemoteDeviceType").links[link][1]


def hgx_h100(**gpu_fields: Any) -> list[FakeGpu]:
    """8 GPUs, each with 18 links spread over 4 NVSwitches, as on an HGX H100 board."""
    return [
        FakeGpu(
            uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
            bus_id=bus_id,
            links={link: (SWITCH_BUS_IDS[link % 4], 2) for link in range(18)},
            **gpu_fields,
        )
        for index, bus_id in enumerate(H100_BUS_IDS)
    ]


ALL_OTHERS = [tuple(j for j in range(8) if j != i) for i in range(8)]


@pytest.mark.parametrize("library", [FakeNvml, FakeNvmlWithDeviceType])
def test_nvswitch_makes_every_gpu_a_peer_of_every_other(library: type[FakeNvml]) -> None:
    inventory = discover_nvml(library(hgx_h100()))
    assert inventory.source == "nvml"
    assert [gpu.nvlink_peers for gpu in inventory.gpus] == ALL_OTHERS
    assert inventory.warnings == ()


def test_device_values() -> None:
    gpus = hgx_h100(used_mib=74213, utilization=87)
    gpus[0].bus_id = gpus[0].bus_id.encode()  # type: ignore[union-attr]  # older pynvml: bytes
    inventory = discover_nvml(FakeNvml(gpus, driver=b"550.54.15", cuda=12040))
    assert inventory.driver_version == "550.54.15"
    assert inventory.cuda_version == "12.4"
    first = inventory.gpus[0]
    assert first.index == 0
    assert first.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.compute_capability == (9, 0)
    assert first.memory_total_mib == 81559
    assert first.memory_used_mib == 74213
    assert first.utilization_percent == 87
    assert first.pci_bus_id == "00000000:1b:00.0"
    assert inventory.cpu_count == 0 and inventory.memory_total_mib == 0  # host facts are discover()'s


@pytest.mark.parametrize(
    ("raw", "text"), [(12040, "12.4"), (12080, "12.8"), (11080, "11.8"), (13000, "13.0")]
)
def test_cuda_version_form(raw: int, text: str) -> None:
    assert discover_nvml(FakeNvml([], cuda=raw)).cuda_version == text


def test_bridged_pairs_match_peers_by_bus_id_in_any_spelling() -> None:
    # Two pairs of PCIe cards joined by NVLink bridges; the remote ends are spelled as sysfs does.
    bus = ["00000000:17:00.0", "00000000:31:00.0", "00000000:B1:00.0", "00000000:CA:00.0"]
    remote = ["0000:31:00.0", "0000:17:00.0", "0000:ca:00.0", "0000:b1:00.0"]
    gpus = [
        FakeGpu(
            uuid=f"GPU-{i}",
            name="NVIDIA A100 80GB PCIe",
            bus_id=bus[i],
            links={0: (remote[i], 0), 1: (remote[i], 0)},
        )
        for i in range(4)
    ]
    for library in (FakeNvml, FakeNvmlWithDeviceType):
        inventory = discover_nvml(library(gpus))
        assert [gpu.nvlink_peers for gpu in inventory.gpus] == [(1,), (0,), (3,), (2,)]


def test_ibm_npu_links_add_no_peers() -> None:
    gpus = [
        FakeGpu(
            uuid="GPU-0",
            bus_id="00000004:04:00.0",
            links={0: ("00000004:05:00.0", 0), 1: ("00000007:00:00.0", 1)},
        ),
        FakeGpu(
            uuid="GPU-1",
            bus_id="00000004:05:00.0",
            links={0: ("00000004:04:00.0", 0), 1: ("00000007:00:00.1", 1)},
        ),
        FakeGpu(uuid="GPU-2", bus_id="00000035:03:00.0", links={1: ("00000007:00:00.2", 1)}),
    ]
    inventory = discover_nvml(FakeNvmlWithDeviceType(gpus))
    assert [gpu.nvlink_peers for gpu in inventory.gpus] == [(1,), (0,), ()]


def test_consumer_gpus_without_nvlink_or_utilization_degrade_quietly() -> None:
    gpus = [
        FakeGpu(
            uuid=f"GPU-{i}",
            name="NVIDIA GeForce RTX 4090",
            capability=(8, 9),
            total_mib=24564,
            bus_id=f"00000000:{0x41 + i:02X}:00.0",
            failing={"nvmlDeviceGetUtilizationRates": FakeNotSupported},
        )
        for i in range(2)
    ]
    inventory = discover_nvml(FakeNvml(gpus))
    assert [gpu.nvlink_peers for gpu in inventory.gpus] == [(), ()]
    assert [gpu.utilization_percent for gpu in inventory.gpus] == [0, 0]
    assert [gpu.compute_capability for gpu in inventory.gpus] == [(8, 9), (8, 9)]
    assert inventory.warnings == ()


def test_unsupported_memory_and_capability_degrade_with_a_warning_for_memory() -> None:
    (gpu,) = hgx_h100()[:1]
    gpu.failing = {
        "nvmlDeviceGetMemoryInfo": FakeNotSupported,
        "nvmlDeviceGetCudaComputeCapability": FakeNotSupported,
        "nvmlDeviceGetName": lambda: FakeNVMLError("Unknown Error"),
    }
    inventory = discover_nvml(FakeNvml([gpu]))
    (found,) = inventory.gpus
    assert found.memory_total_mib == 0 and found.memory_used_mib == 0
    assert found.compute_capability == (0, 0)
    assert found.name == ""
    assert "NVML: GPU 0 name: Unknown Error" in inventory.warnings
    assert "NVML: GPU 0 reports no memory size" in inventory.warnings


def test_broken_gpus_are_skipped_and_the_rest_reported() -> None:
    gpus = hgx_h100()
    gpus[3].failing = {"nvmlDeviceGetUUID": lambda: FakeNVMLError("GPU is lost")}
    inventory = discover_nvml(FakeNvml(gpus, unopenable=frozenset({5})))
    assert [gpu.index for gpu in inventory.gpus] == [0, 1, 2, 4, 6, 7]
    assert inventory.warnings == (
        "NVML: GPU 5 skipped: Insufficient Permissions",
        "NVML: GPU 3 skipped: cannot read its UUID: GPU is lost",
    )
    # Skipped GPUs are nobody's peers; the rest stay mutual peers through the switch.
    assert [gpu.nvlink_peers for gpu in inventory.gpus] == [
        tuple(j for j in (0, 1, 2, 4, 6, 7) if j != i) for i in (0, 1, 2, 4, 6, 7)
    ]


def test_library_missing_is_a_reason_not_a_crash() -> None:
    library = FakeNvml([], init_error=FakeLibraryNotFound())
    with pytest.raises(NvmlUnavailable) as caught:
        discover_nvml(library)
    assert str(caught.value) == "NVML: libnvidia-ml.so.1 not found"
    assert "nvmlShutdown" not in library.calls


def test_driver_not_loaded_is_a_reason() -> None:
    with pytest.raises(NvmlUnavailable, match="NVML: initialisation failed: Driver Not Loaded"):
        discover_nvml(FakeNvml([], init_error=FakeNVMLError("Driver Not Loaded")))


def test_session_reuses_handles_for_usage_and_shuts_down_once() -> None:
    gpus = hgx_h100(used_mib=1000, utilization=50)
    library = FakeNvml(gpus)
    with NvmlSession.open(library) as session:
        session.inventory()
        gpus[2].used_mib = 70000
        gpus[2].utilization = 99
        first = session.usage()
        second = session.usage()
    assert library.calls.count("nvmlInit") == 1
    assert library.calls.count("nvmlDeviceGetHandleByIndex") == 8
    assert library.calls.count("nvmlShutdown") == 1
    assert first == second
    assert (first[2].memory_used_mib, first[2].utilization_percent) == (70000, 99)
    assert (first[0].memory_used_mib, first[0].utilization_percent) == (1000, 50)
    session.close()  # a second close is harmless
    assert library.calls.count("nvmlShutdown") == 1
    with pytest.raises(RuntimeError, match="after close"):
        session.usage()


def test_usage_degrades_for_mig_and_reports_a_lost_gpu() -> None:
    gpus = hgx_h100(used_mib=10)
    with NvmlSession.open(FakeNvml(gpus)) as session:
        gpus[0].failing = {"nvmlDeviceGetUtilizationRates": FakeNotSupported}
        gpus[1].failing = {"nvmlDeviceGetMemoryInfo": lambda: FakeNVMLError("GPU is lost")}
        usage = session.usage()
    assert (usage[0].memory_used_mib, usage[0].utilization_percent, usage[0].error) == (10, 0, "")
    assert usage[1].error == "GPU is lost"
    assert len(usage) == 8


def test_memory_used_is_counted_as_nvidia_smi_counts_it() -> None:
    """Recorded on an H200 (driver 580.159.04), idle: v1 said 615 MiB used, v2 and nvidia-smi 0; with
    64 GiB allocated, v1 66769 MiB and nvidia-smi 66155. Discovery and heartbeats ask v2."""
    gpu = FakeGpu(uuid="GPU-h200", name="NVIDIA H200", total_mib=143771, used_mib=0, reserved_mib=615)
    lib = FakeNvml([gpu])
    (found,) = discover_nvml(lib).gpus
    assert (found.memory_total_mib, found.memory_used_mib) == (143771, 0)
    gpu.used_mib = 66155
    with NvmlSession.open(lib) as session:
        (usage,) = session.usage()
    assert usage.memory_used_mib == 66155


def test_driver_without_memory_v2_is_asked_v1() -> None:
    gpu = FakeGpu(uuid="GPU-old", total_mib=81559, used_mib=100, reserved_mib=500)
    lib = FakeNvml([gpu], memory_v2=False)
    (found,) = discover_nvml(lib).gpus
    assert (found.memory_total_mib, found.memory_used_mib) == (81559, 600)
    with NvmlSession.open(lib) as session:
        assert session.usage()[0].memory_used_mib == 600
