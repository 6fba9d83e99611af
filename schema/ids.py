"""Identifier rules both ends check: a shard id the control plane sends and the agent files under.

The agent names a shard's record (``shards/ID.json``) and log (``logs/ID.log``) after its id, so the
map from id to file name must be one to one and must never leave the directory: ids are 1 to 128
characters of letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit (so neither
``.``, ``..`` nor a hidden file). With that alphabet the id *is* the file name, with no escaping that
could fold two ids (``llama/r0`` and ``llama_r0``) into one file.
"""

from __future__ import annotations

import re

#: The shard id alphabet and length (see the module docstring).
SHARD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SHARD_ID_RULE = "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"


#: The node id alphabet and length: a node id names files (the agent's state, a credential) and is
#: written into every log line about the node, so it is as plain as a shard id: no path separators,
#: spaces, newlines or escape sequences that could forge a log line or a terminal's state.
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NODE_ID_RULE = SHARD_ID_RULE


def _id_problem(field: str, value: str, pattern: re.Pattern[str], rule: str, *, counted: bool) -> str:
    """Why ``value`` is not a valid ``field``, naming it escaped and cut at 64 characters (with
    its length when ``counted``: a node id arrives from an unauthenticated peer, and a long one is
    shown cut); empty when it is valid."""
    if not value:
        return f"{field} is empty; it must be {rule}"
    if pattern.fullmatch(value) is None:
        shown = value if len(value) <= 64 else value[:64] + "..."
        length = f" ({len(value)} characters)" if counted else ""
        return f"{field} {shown!r}{length} is not valid; it must be {rule}"
    return ""


def node_id_problem(node_id: str) -> str:
    """Why ``node_id`` is not a valid node id, in words naming it (escaped); empty when it is valid."""
    return _id_problem("node_id", node_id, NODE_ID, NODE_ID_RULE, counted=True)


def shard_id_problem(shard_id: str) -> str:
    """Why ``shard_id`` is not a valid shard id, in words naming it; empty when it is valid."""
    return _id_problem("shard_id", shard_id, SHARD_ID, SHARD_ID_RULE, counted=False)


__all__ = ["NODE_ID", "NODE_ID_RULE", "SHARD_ID", "SHARD_ID_RULE", "node_id_problem", "shard_id_problem"]
