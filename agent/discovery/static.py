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

The file is structured with cattrs, strictly: a wrong type is not coerced (``memory_total_mib =
"80"`` is an error, not 80) and an unknown key is an error, because a typo in a hand-written file
silently becoming a default is how a node ends up advertising GPUs it does not have. Every problem is
reported at once, each with its key path (``gpus[2].memory_total_mib``) and what was expected.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn
from cattrs.v import format_exception as cattrs_format_exception
from cattrs.v import transform_error

from agent.discovery.model import GpuInfo, Inventory
from agent.discovery.pci import normalize_bus_id

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


class _Expected(ValueError):
    """A value of the wrong kind; the message says what was expected and what was found."""


def _describe(value: object) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array"}
    kind = kinds.get(type(value), "a table" if isinstance(value, dict) else type(value).__name__)
    shown = repr(value)
    return f"{kind} ({shown if len(shown) <= 40 else shown[:37] + '...'})"


def _strict_int(value: Any, _: type) -> int:
    # bool is an int in Python, and `true` where a number belongs is a mistake.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Expected(f"expected an integer, got {_describe(value)}")


def _strict_str(value: Any, _: type) -> str:
    if isinstance(value, str):
        return value
    raise _Expected(f"expected a string, got {_describe(value)}")


def _compute_capability(value: Any, _: type) -> tuple[int, int]:
    # A bare float (9.0) is refused: 12.10 and 12.1 would be the same float.
    if isinstance(value, str):
        major, dot, minor = value.strip().partition(".")
        if dot and major.isdigit() and minor.isdigit():
            return (int(major), int(minor))
    raise _Expected(f'expected a string "major.minor" such as "9.0", got {_describe(value)}')


def _strict_list(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    # cattrs would iterate a string into characters; a TOML array is a list and nothing else.
    structure = list_structure_factory(type_, converter)

    def hook(value: Any, target: Any) -> Any:
        if not isinstance(value, list):
            raise _Expected(f"expected an array, got {_describe(value)}")
        return structure(value, target)

    return hook


def _strict_table(type_: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    structure = make_dict_structure_fn(type_, converter, _cattrs_forbid_extra_keys=True)

    def hook(value: Any, target: Any) -> Any:
        if not isinstance(value, dict):
            raise _Expected(f"expected a table, got {_describe(value)}")
        return structure(value, target)

    return hook


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(detailed_validation=True, forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook_func(lambda t: t == tuple[int, int], _compute_capability)
    converter.register_structure_hook_factory(lambda t: getattr(t, "__origin__", None) is list, _strict_list)
    converter.register_structure_hook_factory(attrs.has, _strict_table)
    return converter


def _format_exception(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, _Expected):
        return str(exc)
    if isinstance(exc, KeyError):
        return "required key missing"
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown key(s): {', '.join(sorted(exc.extra_fields))}"
    return cattrs_format_exception(exc, type_)


def _problems(exc: Exception) -> list[str]:
    """cattrs errors as ``key.path: what was expected`` lines."""
    problems = []
    for message in transform_error(exc, path="", format_exception=_format_exception):
        text, _, where = message.rpartition(" @ ")
        key = where.removeprefix(".") or "(top level)"
        problems.append(f"{key}: {text}")
    return problems


def _check(file: _StaticFile) -> list[str]:
    """What types cannot say: unique indices, peers that exist, non-negative sizes."""
    problems: list[str] = []
    indices = [gpu.index for gpu in file.gpus]
    for position, gpu in enumerate(file.gpus):
        where = f"gpus[{position}]"
        if gpu.index < 0:
            problems.append(f"{where}.index: expected a non-negative integer, got {gpu.index}")
        if indices.count(gpu.index) > 1:
            problems.append(f"{where}.index: GPU index {gpu.index} is listed more than once")
        if not gpu.uuid.strip():
            problems.append(f"{where}.uuid: expected a non-empty string")
        if gpu.memory_total_mib < 0:
            problems.append(
                f"{where}.memory_total_mib: expected a non-negative integer, got {gpu.memory_total_mib}"
            )
        for peer in gpu.nvlink_peers:
            if peer == gpu.index:
                problems.append(f"{where}.nvlink_peers: GPU {gpu.index} cannot be its own peer")
            elif peer not in indices:
                problems.append(f"{where}.nvlink_peers: no GPU has index {peer}")
    for key in ("cpu_count", "memory_total_mib"):
        if getattr(file, key) < 0:
            problems.append(f"{key}: expected a non-negative integer, got {getattr(file, key)}")
    return problems


def parse_static(text: str, path: Path | str = "<static inventory>") -> Inventory:
    """An :class:`Inventory` from the TOML text of a static file; ``path`` only names it in errors.

    The result has ``source="static"``; ``cpu_count`` and ``memory_total_mib`` are 0 unless the file
    sets them (the caller fills in what the host reports). Raises :class:`InventoryFileError`.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InventoryFileError(path, [f"not valid TOML: {exc}"]) from None
    try:
        file = _converter().structure(data, _StaticFile)
    except (cattrs.ClassValidationError, cattrs.IterableValidationError) as exc:
        raise InventoryFileError(path, _problems(exc)) from None
    problems = _check(file)
    if problems:
        raise InventoryFileError(path, problems)
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
