"""The one renderer of ``ctl``'s columns, and kubectl's ages.

Every table ``ctl`` prints goes through ``table``: a header, columns left-aligned, trailing spaces
cut. The kubectl-like verbs (``get``, ``describe``) put three spaces between columns, as kubectl
does; the verbs that predate them (``nodes``, ``replicas``) two, so their output does not move
under scripts that read it (``OLD_GAP``).
"""

from __future__ import annotations

from collections.abc import Sequence

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


__all__ = ["GAP", "OLD_GAP", "age", "indented", "table"]
