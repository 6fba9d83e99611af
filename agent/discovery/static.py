"""A static inventory file: the GPUs written down, for nodes without NVIDIA tooling and for tests.

::

    driver_version = "550.54.15"     # optional
    cuda_version = "12.4"            # optional

    [[gpus]]
    index = 0
    uuid = "GPU-5f3ad1b2-..."
    name = "NVIDIA H100 80GB HBM3"
    compute_capability = "9.0"
    memory_total_mib = 81559
    pci_bus_id = "00000000:18:00.0"  # optional
    nvlink_peers = [1, 2, 3]         # optional

``gpus = []`` describes a CPU-only node. ``cpu_count`` and ``memory_total_mib`` at the top level are
optional overrides of what the host reports (a fleet of simulated nodes on one machine wants them).

The file is read and structured as every llmgw config file is (:mod:`settings`), strictly: a wrong
type is not coerced (``memory_total_mib = "80"`` is an error, not 80) and an unknown key is an error,
because a typo in a hand-written file silently becoming a default is how a node ends up advertising
GPUs it does not have. Every problem is reported at once, each with its key path
(``gpus[2].memory_total_mib``), what was expected and the key's line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import cattrs

import settings
from agent.discovery.model import GpuInfo, Inventory
from agent.discovery.pci import normalize_bus_id
from settings import ConfigError, KeyPath, dotted

__all__ = ["InventoryFileError", "load_static", "parse_static"]


class InventoryFileError(Exception):
    """A static inventory file that cannot be used; ``problems`` has one line per mistake."""

    def __init__(self, path: Path | str, problems: list[str] | tuple[str, ...]) -> None:
        self.path = Path(path)
        self.problems = tuple(problems)
        lines = "\n".join(f"  {problem}" for problem in self.problems)
        super().__init__(f"{self.path}: invalid static inventory:\n{lines}")


# The file's own shape, separate from GpuInfo: the file spells compute capability "9.0" and has no
# place for the live numbers (memory used, utilization) a GpuInfo also carries.
@attrs.frozen
class _StaticGpu:
    index: int
    uuid: str
    name: str
    compute_capability: tuple[int, int]
    memory_total_mib: int
    pci_bus_id: str = ""
    nvlink_peers: list[int] = attrs.Factory(list)


@attrs.frozen
class _StaticFile:
    gpus: list[_StaticGpu]
    driver_version: str = ""
    cuda_version: str = ""
    cpu_count: int = 0
    memory_total_mib: int = 0


def _compute_capability(value: Any, _: type) -> tuple[int, int]:
    # A bare float (9.0) is refused: 12.10 and 12.1 would be the same float.
    if isinstance(value, str):
        major, dot, minor = value.strip().partition(".")
        if dot and major.isdigit() and minor.isdigit():
            return (int(major), int(minor))
    raise ValueError(f'expected a string "major.minor" such as "9.0", got {value!r}')


def _converter() -> cattrs.Converter:
    """settings' strict converter (the one every config file is structured with: no coercion, no
    unknown keys, a list is a list), plus the file's one type of its own, the capability."""
    converter = settings.converter()
    converter.register_structure_hook_func(lambda t: t == tuple[int, int], _compute_capability)
    return converter


def _problem(path: KeyPath, message: str, lines: dict[KeyPath, int]) -> str:
    """One line: the key, what is wrong with it and the key's line (or its table's)."""
    line = settings.nearest_line(lines, path)
    return f"{dotted(path) or '(top level)'}: {message}{f' (line {line})' if line else ''}"


def _check(file: _StaticFile) -> list[tuple[KeyPath, str]]:
    """What types cannot say: unique indices, peers that exist, non-negative sizes."""
    problems: list[tuple[KeyPath, str]] = []
    indices = [gpu.index for gpu in file.gpus]
    for position, gpu in enumerate(file.gpus):
        where: KeyPath = ("gpus", position)
        if gpu.index < 0:
            problems.append(((*where, "index"), f"expected a non-negative integer, got {gpu.index}"))
        if indices.count(gpu.index) > 1:
            problems.append(((*where, "index"), f"GPU index {gpu.index} is listed more than once"))
        if not gpu.uuid.strip():
            problems.append(((*where, "uuid"), "expected a non-empty string"))
        if gpu.memory_total_mib < 0:
            problems.append(
                ((*where, "memory_total_mib"), f"expected a non-negative integer, got {gpu.memory_total_mib}")
            )
        for peer in gpu.nvlink_peers:
            if peer == gpu.index:
                problems.append(((*where, "nvlink_peers"), f"GPU {gpu.index} cannot be its own peer"))
            elif peer not in indices:
                problems.append(((*where, "nvlink_peers"), f"no GPU has index {peer}"))
    for key in ("cpu_count", "memory_total_mib"):
        if getattr(file, key) < 0:
            problems.append(((key,), f"expected a non-negative integer, got {getattr(file, key)}"))
    return problems


def parse_static(text: str, path: Path | str = "<static inventory>") -> Inventory:
    """An :class:`Inventory` from the TOML text of a static file; ``path`` only names it in errors.

    The result has ``source="static"``; ``cpu_count`` and ``memory_total_mib`` are 0 unless the file
    sets them (the caller fills in what the host reports). Raises :class:`InventoryFileError`, with
    every problem at once, each naming its key and line, in the order of the file.
    """
    try:
        data = settings.parse(text, str(path))
    except ConfigError as exc:
        raise InventoryFileError(path, [f"not valid TOML: {exc.__cause__}"]) from None
    try:
        file: _StaticFile = _converter().structure(data, _StaticFile)
        found = _check(file)
    except (cattrs.BaseValidationError, ValueError) as exc:
        found = list(settings.problems(exc))
    if found:
        lines = settings.key_lines(text)
        found.sort(key=lambda problem: settings.nearest_line(lines, problem[0]) or 0)
        raise InventoryFileError(path, [_problem(key, message, lines) for key, message in found])
    gpus = tuple(
        GpuInfo(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            compute_capability=gpu.compute_capability,
            memory_total_mib=gpu.memory_total_mib,
            pci_bus_id=normalize_bus_id(gpu.pci_bus_id) if gpu.pci_bus_id else "",
            nvlink_peers=tuple(sorted(set(gpu.nvlink_peers))),
        )
        for gpu in sorted(file.gpus, key=lambda gpu: gpu.index)
    )
    return Inventory(
        gpus=gpus,
        driver_version=file.driver_version,
        cuda_version=file.cuda_version,
        cpu_count=file.cpu_count,
        memory_total_mib=file.memory_total_mib,
        source="static",
    )


def load_static(path: Path) -> Inventory:
    """Read and parse a static inventory file. Raises :class:`InventoryFileError`, naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InventoryFileError(path, [f"cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise InventoryFileError(path, [f"not UTF-8 text: {exc}"]) from None
    return parse_static(text, path)
