"""``python -m enginebuild.kvevents [VERSION ...] [--wheels DIR] [--out DIR]``: vLLM's KV event
classes, copied out of the pinned vLLM wheels, for the test that decodes the sim's KV events.

The sim encodes vLLM's KV events by hand (msgpack; agent/engines/sim/kvevents.py). What proves the
bytes right is vLLM's own definitions: this tool opens each pinned wheel (the versions
``enginebuild.flags.vllm`` pins; the wheel is downloaded without dependencies, as the flag
extractor does, or taken from ``--wheels DIR`` if a ``vllm-VERSION-*.whl`` is there), reads
``vllm/distributed/kv_events.py`` from it, and keeps, with Python's ``ast``, exactly the msgspec
Struct classes and constants of the event format (``EventBatch``, ``KVCacheEvent``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``, ``MEDIUM_*``), unchanged, under a header
naming the wheel and file. ``ExternalBlockHash`` (imported there from vLLM's kv_cache_utils) is
defined as vLLM defines it, ``bytes | int``. The result imports only msgspec, so a test can load
it without vLLM: ``tests/fixtures/vllm_kv_events/vllm_<version>.py``.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
import zipfile
from pathlib import Path

from enginebuild.flags import core
from enginebuild.flags import vllm as vllm_flags

SOURCE = "vllm/distributed/kv_events.py"
KEEP_CLASSES = (
    "EventBatch",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEventBatch",
)
OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_kv_events"


def module_name(version: str) -> str:
    return "vllm_" + version.replace(".", "_")


def definitions(source: str) -> str:
    """The event format's classes and MEDIUM_* constants from kv_events.py's source, in order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    kept: list[str] = []
    found: set[str] = set()
    for node in tree.body:
        name = None
        if isinstance(node, ast.ClassDef) and node.name in KEEP_CLASSES:
            name = node.name
        elif isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("MEDIUM_") for t in node.targets
        ):
            name = "MEDIUM"
        if name is None:
            continue
        found.add(name)
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        assert node.end_lineno is not None
        kept.append("\n".join(lines[start - 1 : node.end_lineno]))
    missing = [c for c in KEEP_CLASSES if c not in found]
    if missing:
        raise core.ExtractError(f"{SOURCE} has no {', '.join(missing)}: the event format moved")
    return "\n\n\n".join(kept) + "\n"


def render(version: str, wheel_name: str, source: str) -> str:
    header = (
        f'"""vLLM {version}\'s KV event classes, as published on the wire.\n\n'
        f"Copied unchanged from {SOURCE} in {wheel_name} by `python -m enginebuild.kvevents "
        f"{version}` (generated; do not edit). ExternalBlockHash is vLLM's alias from "
        'vllm/v1/core/kv_cache_utils.py.\n"""\n\n'
        "# ruff: noqa\n# mypy: ignore-errors\n"
        "from typing import Any\n\nimport msgspec\n\nExternalBlockHash = bytes | int\n\n\n"
    )
    return header + definitions(source)


def _wheel(version: str, wheels: Path | None, tmp: Path) -> Path:
    if wheels is not None:
        found = sorted(wheels.glob(f"**/vllm-{version}-*.whl"))
        if found:
            return found[0]
    return core.pip_download(f"vllm=={version}", tmp, wheel_platforms=vllm_flags.PLATFORMS)


def produce(version: str, out: Path, wheels: Path | None) -> Path:
    with tempfile.TemporaryDirectory(prefix=f"llmgw-kvevents-{version}-") as tmp:
        wheel = _wheel(version, wheels, Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            source = z.read(SOURCE).decode()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{module_name(version)}.py"
    path.write_text(render(version, wheel.name, source), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m enginebuild.kvevents", description="Copy vLLM's KV event classes out of its wheels."
    )
    parser.add_argument("versions", nargs="*", help=f"default: {', '.join(vllm_flags.VERSIONS)}")
    parser.add_argument("--wheels", type=Path, help="a folder holding already downloaded vLLM wheels")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder (default {OUT_DIR})")
    args = parser.parse_args(argv)
    failed = 0
    for version in args.versions or vllm_flags.VERSIONS:
        try:
            path = produce(version, args.out, args.wheels)
        except (core.ExtractError, KeyError, OSError) as exc:
            print(f"kvevents | vllm {version}: {exc}", file=sys.stderr, flush=True)
            failed += 1
            continue
        print(f"kvevents | vllm {version}: wrote {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
