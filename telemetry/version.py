"""llmgw's version, as every process reports it (``--version``, the ``*_info`` metrics)."""

from __future__ import annotations

import importlib.metadata


def version() -> str:
    """The installed package's version (what ``pip`` installed); "unknown" in a checkout that was
    never installed, where there is no metadata to read."""
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
