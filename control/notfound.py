"""The one message for a name the control plane does not know: what was asked for, and what exists.

Every verb that takes a model (``ctl get models NAME``, ``describe``, ``why``, ``scale``, ``delete``,
``rollout status``) and every API route that looks one up says it the same way, so a typo is
corrected from the answer alone (``no model 'chta' in the catalog; models: chat, embed``); nodes
likewise. Imported by the catalog, the admin API and ``ctl`` (stdlib only: ctl starts fast).
"""

from __future__ import annotations

from collections.abc import Iterable

#: Names listed at most: a fleet of 2,000 nodes would otherwise make one error line of 20 KB.
MAX_NAMED = 30
#: How much of the unknown name is echoed (it comes from a URL or a command line).
MAX_ECHOED = 100


def unknown(kind: str, name: str, known: Iterable[str], where: str = "") -> str:
    """``no KIND 'NAME'WHERE; KINDs: a, b, c`` (sorted, at most ``MAX_NAMED``, then how many more;
    ``none`` when there are none)."""
    names = sorted(known)
    shown = ", ".join(names[:MAX_NAMED]) or "none"
    if len(names) > MAX_NAMED:
        shown += f" and {len(names) - MAX_NAMED} more"
    return f"no {kind} {name[:MAX_ECHOED]!r}{where}; {kind}s: {shown}"


def unknown_model(name: str, known: Iterable[str]) -> str:
    """A model the catalog does not hold (``no model 'x' in the catalog; models: ...``)."""
    return unknown("model", name, known, " in the catalog")


def unknown_node(name: str, known: Iterable[str]) -> str:
    """A node the fleet does not know (``no node 'x'; nodes: ...``)."""
    return unknown("node", name, known)


__all__ = ["MAX_NAMED", "unknown", "unknown_model", "unknown_node"]
