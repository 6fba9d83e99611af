"""GPU discovery through NVML (``pynvml``), the same library nvidia-smi is built on.

NVML is the first choice because it answers in microseconds without forking a process, which also
makes it cheap enough to read memory and utilization for every heartbeat. The handle lives in an
:class:`NvmlSession` the caller opens and closes: no module-level state, and a heartbeat loop reuses
the initialised library instead of paying ``nvmlInit`` every few seconds.

Every per-device call may raise ``NVMLError_NotSupported``: consumer GPUs have no NVLink, MIG-enabled
GPUs report no utilization, some integrated parts report no memory size. Those degrade to a default;
other per-device errors degrade too but leave a warning, so one sick GPU never hides the healthy ones.
These calls block (briefly); async callers run them in ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs
import pynvml

from agent.discovery.model import GpuInfo, GpuUsage, Inventory
from agent.discovery.pci import normalize_bus_id

__all__ = ["NvmlLibrary", "NvmlSession", "NvmlUnavailable", "discover_nvml"]

_T = TypeVar("_T")
_MIB = 1024 * 1024

# NVML's nvmlNvLinkDeviceType_t, with fallbacks for pynvml releases that predate the enum.
_DEVICE_TYPE_GPU = 0
_DEVICE_TYPE_IBMNPU = 1
_DEVICE_TYPE_SWITCH = 2


class NvmlLibrary(Protocol):
    """The part of ``pynvml`` discovery uses.

    It exists so tests on machines without a GPU can pass a fake library; production code passes the
    real module (the default everywhere). The names are pynvml's own, so the real module satisfies it.
    """

    @property
    def NVMLError(self) -> type[Exception]: ...
    @property
    def NVMLError_NotSupported(self) -> type[Exception]: ...
    @property
    def NVMLError_LibraryNotFound(self) -> type[Exception]: ...
    @property
    def NVML_NVLINK_MAX_LINKS(self) -> int: ...

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any: ...


class NvmlUnavailable(Exception):
    """NVML cannot be used on this node; ``reason`` says why in words an operator can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"NVML: {reason}")
        self.reason = reason


def _text(value: str | bytes) -> str:
    """pynvml returns bytes from older releases and str from newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def _cuda_version(raw: int) -> str:
    """NVML encodes CUDA 12.4 as 12040 (1000 * major + 10 * minor)."""
    if raw <= 0:
        return ""
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def _capability(raw: tuple[int, int]) -> tuple[int, int]:
    major, minor = raw
    return int(major), int(minor)


def _memory_info(lib: NvmlLibrary, handle: Any) -> Any:
    """A GPU's memory as nvidia-smi counts it: NVML's v2 query, whose ``used`` leaves out what the
    driver reserves. v1's ``used`` includes it (615 MiB on an H200 with driver 580, idle), so a node
    would report memory in use that ``nvidia-smi`` on it does not show. ``total`` is the same in
    both. A driver or pynvml without the v2 call is asked v1."""
    version = getattr(lib, "nvmlMemory_v2", None)
    if version is not None:
        no_v2 = tuple(
            e for e in (getattr(lib, "NVMLError_FunctionNotFound", None), lib.NVMLError_NotSupported) if e
        )
        try:
            return lib.nvmlDeviceGetMemoryInfo(handle, version=version)
        except no_v2:
            pass
    return lib.nvmlDeviceGetMemoryInfo(handle)


@attrs.define
class _Device:
    """An NVML handle and what identifies it; internal to a session."""

    index: int
    handle: Any
    bus_id: str


class NvmlSession:
    """An initialised NVML library and the device handles found when it was opened.

    Open it with :meth:`open`, close it with :meth:`close` (or use it as a context manager). The
    caller owns it: the agent keeps one for its lifetime so heartbeats call :meth:`usage` on handles
    that already exist.
    """

    def __init__(self, lib: NvmlLibrary, devices: list[_Device], warnings: list[str]) -> None:
        """Use :meth:`open`; this only stores what it found."""
        self._lib = lib
        self._devices = devices
        self._open_warnings = warnings
        self._closed = False

    @classmethod
    def open(cls, nvml: NvmlLibrary = pynvml) -> NvmlSession:
        """Initialise NVML and take a handle for every GPU.

        Raises :class:`NvmlUnavailable` when the library is missing or the driver will not talk; a
        GPU that cannot be opened is skipped with a warning instead (the others are still usable).
        """
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound:
            raise NvmlUnavailable("libnvidia-ml.so.1 not found") from None
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"initialisation failed: {exc}") from None
        warnings: list[str] = []
        devices: list[_Device] = []
        try:
            count = nvml.nvmlDeviceGetCount()
            for index in range(count):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                except nvml.NVMLError as exc:
                    warnings.append(f"NVML: GPU {index} skipped: {exc}")
                    continue
                try:
                    bus_id = normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
                except nvml.NVMLError:
                    # Without a bus id the GPU cannot be matched as an NVLink peer; still listed.
                    bus_id = ""
                devices.append(_Device(index=index, handle=handle, bus_id=bus_id))
        except nvml.NVMLError as exc:
            _shutdown_quietly(nvml)
            raise NvmlUnavailable(f"cannot count GPUs: {exc}") from None
        return cls(nvml, devices, warnings)

    def close(self) -> None:
        """Release NVML (pynvml counts inits, so other users in the process are unaffected)."""
        if not self._closed:
            self._closed = True
            _shutdown_quietly(self._lib)

    def __enter__(self) -> NvmlSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def inventory(self) -> Inventory:
        """Everything NVML knows about the GPUs; host facts (CPUs, memory) are left to the caller."""
        self._check_open()
        lib = self._lib
        warnings = list(self._open_warnings)
        driver = self._optional(
            "driver version", lambda: _text(lib.nvmlSystemGetDriverVersion()), "", warnings
        )
        cuda = self._optional(
            "CUDA version", lambda: _cuda_version(lib.nvmlSystemGetCudaDriverVersion()), "", warnings
        )
        peers = self._nvlink_peers()
        gpus: list[GpuInfo] = []
        for device in self._devices:
            gpu = self._gpu(device, peers.get(device.index, ()), warnings)
            if gpu is not None:
                gpus.append(gpu)
        # A peer that was skipped (no UUID) cannot be offered, so it must not appear as a peer either.
        listed = {gpu.index for gpu in gpus}
        gpus = [
            attrs.evolve(gpu, nvlink_peers=tuple(p for p in gpu.nvlink_peers if p in listed)) for gpu in gpus
        ]
        return Inventory(
            gpus=tuple(gpus),
            driver_version=driver,
            cuda_version=cuda,
            source="nvml",
            warnings=tuple(warnings),
        )

    def usage(self) -> tuple[GpuUsage, ...]:
        """Memory used and utilization per GPU, for heartbeats: two NVML calls per GPU, no fork."""
        self._check_open()
        lib = self._lib
        not_supported = lib.NVMLError_NotSupported
        result: list[GpuUsage] = []
        for device in self._devices:
            try:
                used = _memory_info(lib, device.handle).used // _MIB
            except not_supported:
                used = 0
            except lib.NVMLError as exc:
                result.append(GpuUsage(index=device.index, error=str(exc)))
                continue
            try:
                utilization = int(lib.nvmlDeviceGetUtilizationRates(device.handle).gpu)
            except lib.NVMLError:
                # MIG-enabled GPUs never report utilization; a heartbeat is best effort anyway.
                utilization = 0
            result.append(
                GpuUsage(index=device.index, memory_used_mib=int(used), utilization_percent=utilization)
            )
        return tuple(result)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("NvmlSession used after close()")

    def _optional(self, what: str, call: Callable[[], _T], default: _T, warnings: list[str]) -> _T:
        """Run one NVML call that may legitimately be unsupported; other failures leave a warning."""
        lib = self._lib
        try:
            return call()
        except lib.NVMLError_NotSupported:
            return default
        except lib.NVMLError as exc:
            warnings.append(f"NVML: {what}: {exc}")
            return default

    def _gpu(self, device: _Device, peers: tuple[int, ...], warnings: list[str]) -> GpuInfo | None:
        lib = self._lib
        handle = device.handle
        index = device.index
        try:
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
        except lib.NVMLError as exc:
            # The UUID is how engines are pinned to a GPU; a GPU without one cannot be offered.
            warnings.append(f"NVML: GPU {index} skipped: cannot read its UUID: {exc}")
            return None
        name = self._optional(f"GPU {index} name", lambda: _text(lib.nvmlDeviceGetName(handle)), "", warnings)
        capability = self._optional(
            f"GPU {index} compute capability",
            lambda: _capability(lib.nvmlDeviceGetCudaComputeCapability(handle)),
            (0, 0),
            warnings,
        )
        memory = self._optional(f"GPU {index} memory", lambda: _memory_info(lib, handle), None, warnings)
        if memory is None:
            warnings.append(f"NVML: GPU {index} reports no memory size")
        utilization = self._optional(
            f"GPU {index} utilization",
            lambda: int(lib.nvmlDeviceGetUtilizationRates(handle).gpu),
            0,
            warnings,
        )
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            compute_capability=capability,
            memory_total_mib=int(memory.total) // _MIB if memory is not None else 0,
            memory_used_mib=int(memory.used) // _MIB if memory is not None else 0,
            pci_bus_id=device.bus_id,
            nvlink_peers=peers,
            utilization_percent=utilization,
        )

    def _nvlink_peers(self) -> dict[int, tuple[int, ...]]:
        """Which local GPUs each GPU reaches over NVLink.

        A link's far end is either another GPU (matched by PCI address) or an NVSwitch. Every GPU on
        an NVSwitch fabric reaches every other through it, so all switch-attached GPUs become peers
        of each other; a far end that is neither a local GPU nor a switch (an IBM NPU, a GPU of
        another node) adds no local peer.
        """
        lib = self._lib
        by_bus = {device.bus_id: device.index for device in self._devices if device.bus_id}
        max_links = int(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18))
        feature_enabled = int(getattr(lib, "NVML_FEATURE_ENABLED", 1))
        type_gpu = int(getattr(lib, "NVML_NVLINK_DEVICE_TYPE_GPU", _DEVICE_TYPE_GPU))
        type_switch = int(getattr(lib, "NVML_NVLINK_DEVICE_TYPE_SWITCH", _DEVICE_TYPE_SWITCH))
        type_npu = int(getattr(lib, "NVML_NVLINK_DEVICE_TYPE_IBMNPU", _DEVICE_TYPE_IBMNPU))
        remote_type = getattr(lib, "nvmlDeviceGetNvLinkRemoteDeviceType", None)

        peers: dict[int, set[int]] = {device.index: set() for device in self._devices}
        on_switch: set[int] = set()
        for device in self._devices:
            for link in range(max_links):
                try:
                    if int(lib.nvmlDeviceGetNvLinkState(device.handle, link)) != feature_enabled:
                        continue
                    remote_bus = normalize_bus_id(
                        lib.nvmlDeviceGetNvLinkRemotePciInfo(device.handle, link).busId
                    )
                except lib.NVMLError:
                    # Links past the GPU's own count, and GPUs without NVLink, answer NotSupported or
                    # InvalidArgument; neither is worth a warning.
                    continue
                kind: int | None = None
                if remote_type is not None:
                    try:
                        kind = int(remote_type(device.handle, link))
                    except lib.NVMLError:
                        kind = None
                if kind == type_npu:
                    continue
                if kind == type_switch:
                    on_switch.add(device.index)
                elif remote_bus in by_bus:
                    peers[device.index].add(by_bus[remote_bus])
                elif kind != type_gpu:
                    # Unknown far end that is no local GPU: on HGX boards it is an NVSwitch, whose
                    # PCI address older drivers report without saying what it is.
                    on_switch.add(device.index)
        for index in on_switch:
            peers[index] |= on_switch
        return {index: tuple(sorted(found - {index})) for index, found in peers.items()}


def _shutdown_quietly(nvml: NvmlLibrary) -> None:
    """Shutdown errors carry no information a caller could act on."""
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass


def discover_nvml(nvml: NvmlLibrary = pynvml) -> Inventory:
    """One-shot discovery: open NVML, read the inventory, close it. Raises :class:`NvmlUnavailable`."""
    with NvmlSession.open(nvml) as session:
        return session.inventory()
