"""PCI addresses in one spelling, so what NVML, nvidia-smi and a static file say can be compared."""

from __future__ import annotations

import re

__all__ = ["normalize_bus_id"]

_BUS_ID = re.compile(r"^([0-9a-f]+):([0-9a-f]+):([0-9a-f]+)\.([0-9a-f]+)$")


def normalize_bus_id(bus_id: str | bytes) -> str:
    """The canonical form of a PCI address: 8-digit domain, lower case (``00000000:18:00.0``).

    NVML says ``00000000:18:00.0``, lspci and sysfs ``0000:18:00.0``, and the case of the hex digits
    varies; NVLink peers are found by comparing these, so they must compare equal. pynvml hands out
    bytes in older releases. Text that is not a PCI address comes back stripped and lower-cased.
    """
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace").rstrip("\x00")
    text = bus_id.strip().lower()
    match = _BUS_ID.match(text)
    if match is None:
        return text
    domain, bus, device, function = (int(part, 16) for part in match.groups())
    return f"{domain:08x}:{bus:02x}:{device:02x}.{function:x}"
