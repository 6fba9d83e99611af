"""``python -m enginebuild.flags ENGINE VERSION``: an engine version's command-line options, read
from the engine's own released code, written to ``agent/engines/flags/<engine>-<version>.json``.

The adapters and the ``sim`` engine check command lines against these files
(``agent.engines.flagsets``), so what they accept is what the engine accepts, not what someone
read in its source once. ``nox -s flags`` regenerates every committed file; CI downloads nothing
and only checks the committed files' format (``tests/test_flagsets.py``).

One module per engine, each an :class:`Extractor`: ``VERSIONS`` (what ``nox -s flags``
regenerates), ``fetch(version, workdir) -> (source_dir, description)`` (download the pinned
package without its dependencies, unpack the source) and ``extract(source_dir, version) -> dict``
(the format-1 document, built with :func:`enginebuild.flags.core.document`). A new engine is a
module here, named by its descriptor's ``extractor`` (``enginedefs``): :data:`EXTRACTORS` is
derived from the descriptors.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import enginedefs


class Extractor(Protocol):
    @property
    def VERSIONS(self) -> tuple[str, ...]: ...

    def fetch(self, version: str, workdir: Path) -> tuple[Path, str]: ...

    def extract(self, source_dir: Path, version: str) -> dict[str, Any]: ...


#: Every engine with flag files of its own, and the module that writes them.
EXTRACTORS: Mapping[str, Extractor] = {
    d.name: cast(Extractor, importlib.import_module(d.extractor))
    for d in enginedefs.DESCRIPTORS
    if d.extractor
}
