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


def node_id_problem(node_id: str) -> str:
    """Why ``node_id`` is not a valid node id, in words naming it (escaped); empty when it is valid."""
    if not node_id:
        return "node_id is empty; it must be " + NODE_ID_RULE
    if NODE_ID.fullmatch(node_id) is None:
        shown = node_id if len(node_id) <= 64 else node_id[:64] + "..."
        return f"node_id {shown!r} ({len(node_id)} characters) is not valid; it must be {NODE_ID_RULE}"
    return ""


def shard_id_problem(shard_id: str) -> str:
    """Why ``shard_id`` is not a valid shard id, in words naming it; empty when it is valid."""
    if not shard_id:
        return "shard_id is empty; it must be " + SHARD_ID_RULE
    if SHARD_ID.fullmatch(shard_id) is None:
        shown = shard_id if len(shard_id) <= 64 else shard_id[:64] + "..."
        return f"shard_id {shown!r} is not valid; it must be {SHARD_ID_RULE}"
    return ""


__all__ = ["NODE_ID", "NODE_ID_RULE", "SHARD_ID", "SHARD_ID_RULE", "node_id_problem", "shard_id_problem"]
