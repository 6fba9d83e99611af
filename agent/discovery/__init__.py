"""Find the node's GPUs: a static file if one is configured, else NVML, else nvidia-smi.

Discovery never fails a node for lacking GPUs: a node whose GPU stack is missing or broken still
registers, with no GPUs and the reason in :attr:`Inventory.error`, so an operator sees "NVML: driver
not loaded" in the fleet view instead of a node that never appeared. The one error that stops the
agent is a static inventory file that is malformed, since that is a mistake in the configuration.

These functions block (NVML calls, nvidia-smi with a timeout); async callers run them in
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from agent.discovery import host
from agent.discovery.model import FabricAttachment, GpuInfo, GpuUsage, Inventory
from agent.discovery.nvidia_smi import NvidiaSmiUnavailable, discover_nvidia_smi
from agent.discovery.nvml import NvmlSession, NvmlUnavailable, discover_nvml
from agent.discovery.static import InventoryFileError, load_static

__all__ = [
    "FabricAttachment",
    "GpuInfo",
    "GpuUsage",
    "Inventory",
    "InventoryFileError",
    "NvmlSession",
    "discover",
]


def _with_host(inventory: Inventory) -> Inventory:
    """Fill in CPUs and memory from the host, unless the inventory (a static file) already set them."""
    return attrs.evolve(
        inventory,
        cpu_count=inventory.cpu_count or host.cpu_count(),
        memory_total_mib=inventory.memory_total_mib or host.memory_total_mib(),
    )


def discover(static_path: Path | None, *, nvidia_smi_timeout_s: float = 10.0) -> Inventory:
    """The node's inventory, by the first method that works.

    With ``static_path`` the file is the whole truth about GPUs (and a malformed one raises
    :class:`InventoryFileError`). Without it, NVML is tried, then nvidia-smi; if both fail the
    inventory has no GPUs and ``error`` names why each failed, e.g.
    ``"NVML: libnvidia-ml.so.1 not found; nvidia-smi: not on PATH"``.
    """
    if static_path is not None:
        return _with_host(load_static(static_path))
    reasons: list[str] = []
    try:
        return _with_host(discover_nvml())
    except NvmlUnavailable as exc:
        reasons.append(str(exc))
    try:
        found = discover_nvidia_smi(timeout_s=nvidia_smi_timeout_s)
    except NvidiaSmiUnavailable as exc:
        reasons.append(str(exc))
    else:
        # Why NVML failed is still worth knowing when nvidia-smi stood in for it.
        return _with_host(attrs.evolve(found, warnings=(*reasons, *found.warnings)))
    return _with_host(Inventory(error="; ".join(reasons)))
