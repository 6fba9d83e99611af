"""The one renderer of ``ctl``'s columns, and kubectl's ages.

Every table ``ctl`` prints goes through ``table``: a header, columns left-aligned, trailing spaces
cut. The kubectl-like verbs (``get``, ``describe``) put three spaces between columns, as kubectl
does; the verbs that predate them (``nodes``, ``replicas``) two, so their output does not move
under scripts that read it (``OLD_GAP``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: Spaces between columns: kubectl's, and the older verbs'.
GAP = 3
OLD_GAP = 2


def table(rows: Sequence[Sequence[str]], header: Sequence[str], gap: int = GAP) -> str:
    """A header and rows, each column as wide as its widest cell, ``gap`` spaces apart."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    space = " " * gap
    lines = [
        space.join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in [header, *rows]
    ]
    return "\n".join(lines)


def indented(text: str, by: str = "  ") -> list[str]:
    """``text``'s lines, each indented (a table inside ``describe``'s sections)."""
    return [by + line for line in text.splitlines()]


def age(seconds: float) -> str:
    """kubectl's ages: 45s, 12m, 3h, 2d."""
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 2 * 3600:
        return f"{s // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


#: The columns of an engine's load (``load_cells``), as ``get replicas -o wide`` heads them.
LOAD_HEADER = ("RUNNING", "WAITING", "KV%", "HIT%", "TOK/S")


def _number(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def load_cells(load: Mapping[str, Any] | None) -> list[str]:
    """An API ``load`` document as the ``LOAD_HEADER`` cells: '-' for a figure the engine does not
    publish (or no load at all), and a stale sample as 'stale' with no figures (old numbers are
    never shown as current)."""
    if not load:
        return ["-"] * len(LOAD_HEADER)
    if load["stale"]:
        return ["stale"] + ["-"] * (len(LOAD_HEADER) - 1)
    return [
        _number(load["running"]),
        _number(load["waiting"]),
        _number(load["kv_usage"], 100),
        _number(load["hit_rate"], 100),
        _number(load["tokens_per_second"], digits=1),
    ]


def load_words(load: Mapping[str, Any] | None) -> str:
    """An API ``load`` document in words, for ``describe``: 'running 3, waiting 0, KV 41%, hit 80%,
    52.0 tok/s (1.2s old)', or why there is none."""
    if not load:
        return "no load reported"
    if load["stale"]:
        why = f": {load['error']}" if load.get("error") else ""
        return f"load stale ({load['age_s']:g}s old){why}"
    cells = dict(zip(LOAD_HEADER, load_cells(load), strict=True))
    words = (
        f"running {cells['RUNNING']}, waiting {cells['WAITING']}, KV {cells['KV%']}%, "
        f"hit {cells['HIT%']}%, {cells['TOK/S']} tok/s ({load['age_s']:g}s old)"
    )
    return words + (f"; {load['error']}" if load.get("error") else "")


__all__ = ["GAP", "LOAD_HEADER", "OLD_GAP", "age", "indented", "load_cells", "load_words", "table"]
