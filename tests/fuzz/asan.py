"""Malformed input against the native pump under AddressSanitizer and UndefinedBehaviorSanitizer:
``python -m tests.fuzz.asan`` (``nox -s fuzz``).

It builds ``router/_pump.c`` with ``-fsanitize=address,undefined`` into a temporary directory (the
tree's own build is left alone), then runs, in a child Python with libasan preloaded (the
interpreter is not built with it), the differential test against the Python scanner
(tests/test_framing_differential.py, ``LLMGW_FUZZ_EXAMPLES`` examples each), the live-thread fuzz
(tests/fuzz/test_pump_fuzz.py, ``LLMGW_FUZZ_CASES`` cases) and the pump's own tests
(tests/test_relay.py, native only). Any sanitizer report fails the run (``halt_on_error``); the
whole run is bounded by ``--timeout``. Linux with gcc or clang only, as the pump itself."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g", "-O1"]


def build(out: Path, cc: str) -> Path:
    """The sanitized extension, named as the import system expects."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = out / f"_pump{suffix}"
    include = sysconfig.get_paths()["include"]
    cmd = [cc, "-shared", "-fPIC", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers"]
    subprocess.run(
        [*cmd, *FLAGS, f"-I{include}", str(ROOT / "router" / "_pump.c"), "-o", str(target)], check=True
    )
    return target


def runtime(cc: str, name: str) -> str:
    path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout
    path = path.strip()
    if not os.path.isabs(path):
        raise SystemExit(
            f"{cc} does not know where {name} is ({path!r}): install the compiler's sanitizer runtime"
        )
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000, help="live-thread fuzz cases per job kind")
    parser.add_argument("--examples", type=int, default=3000, help="hypothesis examples per property")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("the native relay pump is Linux-only (epoll, eventfd)")
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("no C compiler: set CC or install gcc")
    with tempfile.TemporaryDirectory(prefix="llmgw-asan-") as tmp:
        so = build(Path(tmp), cc)
        env = dict(
            os.environ,
            LLMGW_PUMP_SO=str(so),
            LLMGW_RELAY="native",
            LLMGW_FUZZ_CASES=str(args.cases),
            LLMGW_FUZZ_EXAMPLES=str(args.examples),
            LD_PRELOAD=runtime(cc, "libasan.so") + " " + runtime(cc, "libubsan.so"),
            # The interpreter's own allocations are not ours to judge (leaks at exit are normal).
            ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1",
            UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
            PYTHONMALLOC="malloc",
        )
        tests = ["tests/test_framing_differential.py", "tests/fuzz/test_pump_fuzz.py", "tests/test_relay.py"]
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.fuzz.asan_plugin",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
        ]
        try:
            done = subprocess.run([*cmd, *tests, *args.pytest_args], cwd=ROOT, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"fuzz: over {args.timeout:g} s; lower --cases or --examples", file=sys.stderr)
            return 1
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
