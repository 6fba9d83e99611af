"""``python -m enginebuild.flags ENGINE VERSION [--out DIR]`` writes one engine version's flag file;
``python -m enginebuild.flags --all`` (what ``nox -s flags`` runs) rewrites every pinned one.

Each run downloads the pinned package into a temporary folder, removed afterwards, and reads its
source; nothing is installed and nothing is imported into this process.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from enginebuild.flags import EXTRACTORS, core


def produce(engine: str, version: str, out: Path) -> Path:
    extractor = EXTRACTORS[engine]
    with tempfile.TemporaryDirectory(prefix=f"llmgw-flags-{engine}-{version}-") as tmp:
        source_dir, fetched = extractor.fetch(version, Path(tmp))
        doc = extractor.extract(source_dir, version)
    doc["source"] = f"{engine}-{version} ({fetched}): {doc['source']}"
    doc = core.document(
        engine=doc["engine"],
        version=doc["version"],
        program=doc["program"],
        source=doc["source"],
        positionals=doc["positionals"],
        options=doc["options"],
    )
    return core.write(doc, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m enginebuild.flags",
        description="Write engine flag files from the engines' own released code.",
    )
    parser.add_argument("engine", nargs="?", choices=sorted(EXTRACTORS))
    parser.add_argument("version", nargs="?")
    parser.add_argument("--all", action="store_true", help="every pinned version of every engine")
    parser.add_argument("--out", type=Path, default=core.DATA_DIR, help=f"folder (default {core.DATA_DIR})")
    args = parser.parse_args(argv)
    if args.all == bool(args.engine):
        parser.error("give ENGINE VERSION, or --all")
    if args.engine and not args.version:
        parser.error(
            f"give the {args.engine} version (pinned: {', '.join(EXTRACTORS[args.engine].VERSIONS)})"
        )
    jobs = (
        [(e, v) for e, x in sorted(EXTRACTORS.items()) for v in x.VERSIONS]
        if args.all
        else [(args.engine, args.version)]
    )
    failed = 0
    for engine, version in jobs:
        print(f"flags | {engine} {version}: fetching and reading its source", flush=True)
        try:
            path = produce(engine, version, args.out)
        except core.ExtractError as exc:
            print(f"flags | {engine} {version}: {exc}", file=sys.stderr, flush=True)
            failed += 1
            continue
        print(f"flags | {engine} {version}: wrote {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
