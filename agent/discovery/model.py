"""Value types for what discovery finds on a node: frozen, compared by value, cheap to pass around."""

from __future__ import annotations

import attrs


@attrs.frozen
class GpuInfo:
    """One GPU as discovery sees it; memory in MiB, as NVML and nvidia-smi report it."""

    index: int
    uuid: str
    name: str
    #: (major, minor), e.g. (9, 0) for H100, (8, 9) for L40S/RTX 4090.
    compute_capability: tuple[int, int]
    memory_total_mib: int
    memory_used_mib: int = 0
    pci_bus_id: str = ""
    #: Indices of the GPUs this one reaches over NVLink.
    nvlink_peers: tuple[int, ...] = ()
    utilization_percent: int = 0


@attrs.frozen
class FabricAttachment:
    """A configured fabric attachment: nothing on the node can tell two InfiniBand fabrics apart
    (the default OpenSM subnet prefix is the same on every fabric), so operators name them."""

    fabric: str
    hca: str
    port: int = 1


@attrs.frozen
class Inventory:
    """The node's hardware, plus why discovery failed when it did (a failed discovery is not fatal:
    the node still registers, with no GPUs and the reason, so an operator can see it)."""

    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str = ""
    cuda_version: str = ""
    cpu_count: int = 0
    memory_total_mib: int = 0
    #: How the GPUs were found: "nvml", "nvidia-smi", "static", or "" when nothing worked.
    source: str = ""
    error: str = ""
    #: Things that went wrong without stopping discovery (a GPU NVML could not read, a topology
    #: nvidia-smi would not print): the inventory is usable, but an operator should hear of them.
    warnings: tuple[str, ...] = ()


@attrs.frozen
class GpuUsage:
    """What a heartbeat says about one GPU: the few numbers that change while engines run."""

    index: int
    memory_used_mib: int = 0
    utilization_percent: int = 0
    #: Set when the GPU could not be read at all (fallen off the bus, for instance).
    error: str = ""
