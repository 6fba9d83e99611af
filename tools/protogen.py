"""Regenerate the committed Python messages from ``schema/llmgw/v1/*.proto``.

The generated code is committed so that installing llmgw needs neither protoc nor the betterproto2
compiler; ``nox -s proto`` runs this module (``python -m tools.protogen``), and a test runs it into a scratch folder and fails when the
committed copy differs (a stale contract is worse than none).

Messages only: the transport is ours (h2 and trio), so no client or server stubs are generated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schema"
PROTO_FILES = sorted(str(p) for p in (SCHEMA_DIR / "llmgw").rglob("*.proto"))
GENERATED_DIR = SCHEMA_DIR / "gen"


def generate(out_dir: Path) -> None:
    """Run protoc with the betterproto2 plugin, writing the package tree into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # protoc finds its plugin on PATH; the plugin is installed beside this interpreter.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{SCHEMA_DIR}",
        f"--python_betterproto2_out={out_dir}",
        "--python_betterproto2_opt=client_generation=none,server_generation=none",
        *PROTO_FILES,
    ]
    # The plugin skips writing a package __init__.py that already exists relative to its working
    # directory, so it runs in the (empty) output folder to produce the same files every time.
    proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"protoc failed ({proc.returncode}): {proc.stderr.strip()}")


def generated_files(root: Path) -> dict[str, bytes]:
    """Every generated file under ``root`` by relative path (caches excluded)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        if args.check:
            if generated_files(fresh) != generated_files(GENERATED_DIR):
                print(
                    "schema/gen is stale: run `nox -s proto` (python -m tools.protogen) and commit the result",
                    file=sys.stderr,
                )
                return 1
            return 0
        shutil.rmtree(GENERATED_DIR, ignore_errors=True)
        shutil.copytree(fresh, GENERATED_DIR)
        GENERATED_DIR.chmod(0o755)
    print(f"wrote {GENERATED_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
