"""``python -m enginebuild``: build llama-server and write the tiny model into the cache, if missing.

``nox -s engines`` runs this. ``--check`` builds nothing and exits 1 when something is missing,
which is how a script asks "would the end-to-end test run here?" in milliseconds.
"""

from __future__ import annotations

import argparse
import sys

from enginebuild import llamacpp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default 2)")
    parser.add_argument("--check", action="store_true", help="report only; exit 1 when not built")
    args = parser.parse_args()
    cache = llamacpp.cache()
    if args.check:
        built = llamacpp.installed(cache)
        if built is None:
            print(f"not built: {cache.root} has no complete build of llama-cpp-python {cache.version}")
            return 1
    else:
        try:
            built = llamacpp.ensure(cache, jobs=args.jobs, say=lambda s: print(f"engines | {s}", flush=True))
        except llamacpp.BuildError as exc:
            print(f"engines | {exc}", file=sys.stderr)
            return 1
    print(f"llama-server: {built.server}")
    print(f"model: {built.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
