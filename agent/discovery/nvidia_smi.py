"""GPU discovery through the ``nvidia-smi`` command, for nodes where NVML cannot be loaded from Python.

That happens in containers that mount the nvidia-smi binary but not ``libnvidia-ml.so.1`` where the
agent's interpreter looks for it, and on hosts with unusual library paths. The parsers are pure
functions on the text nvidia-smi prints, so they are tested on recorded outputs; :func:`run` is the
only thing that forks, always with a timeout (a wedged driver makes nvidia-smi hang for minutes), and
turns every failure into :class:`NvidiaSmiUnavailable` with a reason a person can read.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from collections.abc import Sequence

import attrs

from agent.discovery.model import GpuInfo, GpuUsage, Inventory
from agent.discovery.pci import normalize_bus_id

__all__ = [
    "QUERY_FIELDS",
    "USAGE_FIELDS",
    "NvidiaSmiParseError",
    "NvidiaSmiUnavailable",
    "discover_nvidia_smi",
    "parse_cuda_version",
    "parse_query_gpu",
    "parse_topology",
    "parse_usage",
    "run",
    "usage",
]

#: What discovery asks ``--query-gpu`` for, in this order.
QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "compute_cap",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "pci.bus_id",
    "driver_version",
)
#: What a heartbeat asks for.
USAGE_FIELDS: tuple[str, ...] = ("index", "memory.used", "utilization.gpu")

DEFAULT_TIMEOUT_S = 10.0

# nvidia-smi's ways of saying "no value": the field exists but this GPU or driver has none.
_NO_VALUE = frozenset({"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", ""})
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_NVLINK = re.compile(r"^NV\d+$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Columns of `topo -m` that follow the device columns; their headers contain spaces.
# Split on whitespace, "CPU Affinity" and "GPU NUMA ID" start with a bare "CPU" / "GPU" / "NUMA".
_TRAILING_HEADERS = frozenset({"CPU", "NUMA", "Affinity", "GPU"})


class NvidiaSmiUnavailable(Exception):
    """nvidia-smi could not be used; ``reason`` says why (not installed, timed out, driver down)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"nvidia-smi: {reason}")
        self.reason = reason


class NvidiaSmiParseError(ValueError):
    """nvidia-smi printed something the parser does not understand; the message says where."""


@attrs.frozen
class QueryResult:
    """What ``--query-gpu`` told us: the GPUs (without NVLink peers, which need ``topo -m``) and the
    driver version, which nvidia-smi repeats on every row."""

    gpus: tuple[GpuInfo, ...]
    driver_version: str


def _row_values(text: str, fields: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """CSV rows as {field: value}, with their line numbers for error messages."""
    rows: list[tuple[int, dict[str, str]]] = []
    reader = csv.reader(text.splitlines(), skipinitialspace=True)
    for row in reader:
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(fields):
            raise NvidiaSmiParseError(
                f"line {reader.line_num}: expected {len(fields)} fields ({', '.join(fields)}), "
                f"got {len(row)}: {','.join(row)!r}"
            )
        rows.append((reader.line_num, {name: cell.strip() for name, cell in zip(fields, row, strict=True)}))
    return rows


def _int(value: str, field: str, line: int, *, required: bool) -> int:
    if value in _NO_VALUE:
        if required:
            raise NvidiaSmiParseError(f"line {line}: {field} is {value or 'empty'}, a number is needed")
        return 0
    try:
        # memory and utilization are integers with nounits, but be lenient with "81559.0".
        return int(float(value))
    except ValueError:
        raise NvidiaSmiParseError(f"line {line}: {field} is {value!r}, expected a number") from None


def _bus_id(value: str) -> str:
    return "" if value in _NO_VALUE else normalize_bus_id(value)


def _capability(value: str, line: int) -> tuple[int, int]:
    """compute_cap is "9.0"; drivers older than 510 have no such field, and some GPUs say [N/A].

    (0, 0) means unknown: engines that need a minimum capability will refuse such a GPU with a
    reason rather than guess.
    """
    if value in _NO_VALUE:
        return (0, 0)
    major, dot, minor = value.partition(".")
    if not dot or not major.isdigit() or not minor.isdigit():
        raise NvidiaSmiParseError(f"line {line}: compute_cap is {value!r}, expected major.minor like 9.0")
    return (int(major), int(minor))


def parse_query_gpu(text: str, fields: Sequence[str] = QUERY_FIELDS) -> QueryResult:
    """Parse ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits``.

    ``fields`` must be the list that was asked for: discovery drops ``compute_cap`` for old drivers,
    and the columns shift accordingly. Values nvidia-smi cannot give ("[N/A]", "[Not Supported]")
    become 0 or empty, except index and uuid, without which a GPU cannot be addressed.
    """
    gpus: list[GpuInfo] = []
    driver_versions: list[str] = []
    for line, values in _row_values(text, fields):
        uuid = values.get("uuid", "")
        if uuid in _NO_VALUE:
            raise NvidiaSmiParseError(f"line {line}: uuid is {uuid or 'empty'}")
        name = values.get("name", "")
        driver = values.get("driver_version", "")
        if driver not in _NO_VALUE:
            driver_versions.append(driver)
        gpus.append(
            GpuInfo(
                index=_int(values.get("index", ""), "index", line, required=True),
                uuid=uuid,
                name="" if name in _NO_VALUE else name,
                compute_capability=_capability(values.get("compute_cap", "[N/A]"), line),
                memory_total_mib=_int(values.get("memory.total", ""), "memory.total", line, required=False),
                memory_used_mib=_int(values.get("memory.used", ""), "memory.used", line, required=False),
                pci_bus_id=_bus_id(values.get("pci.bus_id", "")),
                utilization_percent=_int(
                    values.get("utilization.gpu", ""), "utilization.gpu", line, required=False
                ),
            )
        )
    return QueryResult(gpus=tuple(gpus), driver_version=driver_versions[0] if driver_versions else "")


def parse_usage(text: str, fields: Sequence[str] = USAGE_FIELDS) -> tuple[GpuUsage, ...]:
    """Parse the heartbeat query (``index,memory.used,utilization.gpu``)."""
    return tuple(
        GpuUsage(
            index=_int(values.get("index", ""), "index", line, required=True),
            memory_used_mib=_int(values.get("memory.used", ""), "memory.used", line, required=False),
            utilization_percent=_int(
                values.get("utilization.gpu", ""), "utilization.gpu", line, required=False
            ),
        )
        for line, values in _row_values(text, fields)
    )


def _split_topology_line(line: str) -> list[str]:
    """Cells of one ``topo -m`` line, whether copied with tabs or with runs of spaces."""
    return line.split()


def _device_columns(header: list[str]) -> list[str]:
    """The header's device labels (GPU0.., NIC0.., mlx5_0..), dropping the affinity columns after them."""
    columns: list[str] = []
    for label in header:
        if label in _TRAILING_HEADERS:
            break
        columns.append(label)
    return columns


def parse_topology(text: str) -> dict[int, tuple[int, ...]]:
    """NVLink peers per GPU index from ``nvidia-smi topo -m``.

    A cell ``NV<n>`` (n bonded links) marks the two GPUs as NVLink peers; everything else (``X``,
    ``SYS``, ``NODE``, ``PHB``, ``PXB``, ``PIX``) is a PCIe path and no peer. NIC rows and columns,
    the CPU/NUMA affinity columns and the legend are ignored. Every GPU row present gets an entry,
    empty when it has no peers.
    """
    columns: list[str] | None = None
    peers: dict[int, tuple[int, ...]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _ANSI.sub("", raw)
        cells = _split_topology_line(line)
        if not cells:
            continue
        if cells[0] in ("Legend:", "Legend"):
            break  # the legend, and the "NIC Legend" newer drivers print after it
        if columns is None:
            if _GPU_LABEL.match(cells[0]):
                columns = _device_columns(cells)
            continue
        row = _GPU_LABEL.match(cells[0])
        if row is None:
            continue  # a NIC row, or something newer drivers print that we have no use for
        values = cells[1:]
        if len(values) < len(columns):
            raise NvidiaSmiParseError(
                f"topo line {number}: {cells[0]} has {len(values)} cells, the header names {len(columns)} devices"
            )
        found: list[int] = []
        for label, value in zip(columns, values, strict=False):
            column = _GPU_LABEL.match(label)
            if column is not None and _NVLINK.match(value):
                found.append(int(column.group(1)))
        peers[int(row.group(1))] = tuple(sorted(found))
    if columns is None:
        raise NvidiaSmiParseError("topo: no header line with GPU columns")
    return peers


_CUDA_VERSION = re.compile(r"CUDA Version\s*:?\s*(\d+\.\d+)")


def parse_cuda_version(text: str) -> str:
    """The CUDA version from ``nvidia-smi --version`` (or the banner of plain ``nvidia-smi``); "" if absent."""
    match = _CUDA_VERSION.search(text)
    return match.group(1) if match else ""


def run(args: Sequence[str], *, executable: str = "nvidia-smi", timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Run nvidia-smi and return its stdout; every failure becomes :class:`NvidiaSmiUnavailable`.

    nvidia-smi prints its own errors ("couldn't communicate with the NVIDIA driver") on stdout, so
    the reason quotes whichever stream has text.
    """
    path = shutil.which(executable)
    if path is None:
        raise NvidiaSmiUnavailable("not on PATH" if executable == "nvidia-smi" else f"{executable} not found")
    try:
        proc = subprocess.run(
            [path, *args], capture_output=True, text=True, timeout=timeout_s, check=False, errors="replace"
        )
    except subprocess.TimeoutExpired:
        raise NvidiaSmiUnavailable(f"{' '.join(args)} did not finish within {timeout_s:g} s") from None
    except OSError as exc:
        raise NvidiaSmiUnavailable(f"cannot run {path}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        detail = f": {said[0].strip()}" if said else ""
        raise NvidiaSmiUnavailable(f"{' '.join(args)} exited with status {proc.returncode}{detail}")
    return proc.stdout


def _query_args(fields: Sequence[str]) -> list[str]:
    return [f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def _query_gpus(executable: str, timeout_s: float) -> tuple[QueryResult, list[str]]:
    """Query with compute_cap, and again without it for drivers that predate the field (< 510)."""
    try:
        return parse_query_gpu(run(_query_args(QUERY_FIELDS), executable=executable, timeout_s=timeout_s)), []
    except NvidiaSmiUnavailable as exc:
        if "compute_cap" not in exc.reason:
            raise
    fields = [field for field in QUERY_FIELDS if field != "compute_cap"]
    text = run(_query_args(fields), executable=executable, timeout_s=timeout_s)
    return parse_query_gpu(text, fields), [
        "nvidia-smi: driver has no compute_cap field; compute capability unknown"
    ]


def discover_nvidia_smi(*, executable: str = "nvidia-smi", timeout_s: float = DEFAULT_TIMEOUT_S) -> Inventory:
    """GPUs from ``--query-gpu``, NVLink peers from ``topo -m``, CUDA version from ``--version``.

    Only the GPU query is essential: if the topology or version cannot be read the inventory still
    stands, without peers or CUDA version, and says so in ``warnings``. Raises
    :class:`NvidiaSmiUnavailable` when the GPUs themselves cannot be listed.
    """
    try:
        query, warnings = _query_gpus(executable, timeout_s)
    except NvidiaSmiParseError as exc:
        raise NvidiaSmiUnavailable(f"cannot parse --query-gpu output: {exc}") from None
    gpus = query.gpus
    if len(gpus) > 1:
        try:
            peers = parse_topology(run(["topo", "-m"], executable=executable, timeout_s=timeout_s))
        except (NvidiaSmiUnavailable, NvidiaSmiParseError) as exc:
            warnings.append(f"nvidia-smi: NVLink topology unknown: {exc}")
        else:
            gpus = tuple(attrs.evolve(gpu, nvlink_peers=peers.get(gpu.index, ())) for gpu in gpus)
    try:
        cuda = parse_cuda_version(run(["--version"], executable=executable, timeout_s=timeout_s))
    except NvidiaSmiUnavailable:
        # `--version` is newer than some drivers still in service; the CUDA version is a nicety.
        cuda = ""
    return Inventory(
        gpus=gpus,
        driver_version=query.driver_version,
        cuda_version=cuda,
        source="nvidia-smi",
        warnings=tuple(warnings),
    )


def usage(*, executable: str = "nvidia-smi", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[GpuUsage, ...]:
    """Memory used and utilization per GPU, for heartbeats on nodes without NVML (one fork each)."""
    try:
        return parse_usage(run(_query_args(USAGE_FIELDS), executable=executable, timeout_s=timeout_s))
    except NvidiaSmiParseError as exc:
        raise NvidiaSmiUnavailable(f"cannot parse --query-gpu output: {exc}") from None
