"""llama.cpp's ``llama-server``, built from the pinned llama-cpp-python sdist, and where it lives.

Why this source: the llama-cpp-python sdist on PyPI vendors llama.cpp's whole tree (server included,
``vendor/llama.cpp/tools/server``) together with tokenizer-only GGUF files (``models/``), so one
``pip download`` from the package registry gives both the engine's source and a real tokenizer,
with no other download. ``VERSION`` pins it; the llama.cpp commit it vendors is the one the
``llamacpp`` adapter's flags were checked against (``llama-server --help``, ``common/arg.cpp``).

Layout of the cache (``$XDG_CACHE_HOME/llmgw/llama.cpp/<VERSION>/``, default ``~/.cache``)::

    download/llama_cpp_python-<VERSION>.tar.gz   the sdist as pip downloaded it
    src/llama_cpp_python-<VERSION>/              its extracted tree (the vocab files live here)
    build/bin/llama-server                       the engine (links build/bin/*.so by rpath)
    build.log                                    cmake's whole output, for a failed build
    build.json                                   the stamp, written last: version, flags, time
    models/tiny-llama-*.gguf                     written by ``enginebuild.tinymodel``

The stamp is what makes the cache trustworthy: a build killed halfway leaves no stamp, so the next
run builds again (cmake picks up where it stopped), and a stamp whose version or flags differ from
ours is a stale build. A new pin lands in its own directory, so an old one is simply unused.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import attrs

from enginebuild import tinymodel

#: The llama-cpp-python release whose vendored llama.cpp we build (``pip index versions`` lists them).
VERSION = "0.3.36"

#: CPU-only and portable: ``GGML_NATIVE=OFF`` builds for a baseline x86-64 (with runtime-selected
#: AVX2 variants) instead of this machine's exact CPU, so a cache copied to another runner still
#: runs; no tests, examples or other tools, which would triple the build time; no libcurl, which
#: only serves model downloads from the network that we never use.
CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)
TARGET = "llama-server"

#: What a person is told before the first build starts: it is long, and they should know why.
BUILD_TIME_HINT = "about 15 minutes on 2 cores"

Say = Callable[[str], None]


class BuildError(Exception):
    """The engine could not be fetched or built; the message says which step and what to do."""


@attrs.frozen
class Cache:
    """Where one pinned version's source, build and model live."""

    root: Path
    version: str = VERSION

    @property
    def sdist(self) -> Path:
        return self.root / "download" / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def source(self) -> Path:
        """llama.cpp's own tree, inside the extracted sdist."""
        return self.root / "src" / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def server(self) -> Path:
        return self.build_dir / "bin" / TARGET

    @property
    def stamp(self) -> Path:
        return self.root / "build.json"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    @property
    def vocab(self) -> Path:
        """The tokenizer-only llama (SentencePiece, 32,000 tokens) GGUF that ships in the tree."""
        return self.source / "models" / "ggml-vocab-llama-spm.gguf"

    @property
    def models(self) -> Path:
        return self.root / "models"


def cache(version: str = VERSION, base: Path | None = None) -> Cache:
    """The cache for ``version`` under ``base`` (default ``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    if base is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Cache(root=base / "llmgw" / "llama.cpp" / version, version=version)


def _stamp_matches(c: Cache) -> bool:
    try:
        stamp = json.loads(c.stamp.read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stamp.get("version") == c.version
        and stamp.get("cmake_flags") == list(CMAKE_FLAGS)
    )


def server_path(c: Cache | None = None) -> Path | None:
    """The built ``llama-server``, or None when this version was never built completely."""
    c = c or cache()
    if _stamp_matches(c) and os.access(c.server, os.X_OK):
        return c.server
    return None


@attrs.frozen
class Built:
    """What a test or the demo runs: the engine binary and the tiny model it loads."""

    server: Path
    model: Path


def installed(c: Cache | None = None) -> Built | None:
    """The built server and the written model, or None when either is missing (nothing is built)."""
    c = c or cache()
    server = server_path(c)
    model = tinymodel.model_path(c.models)
    if server is None or not model.exists():
        return None
    return Built(server=server, model=model)


def ensure(c: Cache | None = None, *, jobs: int | None = None, say: Say = print) -> Built:
    """Build the server and write the model, each only when missing; needs the ``gguf`` package
    (the ``engines`` extra) only when the model is written."""
    c = c or cache()
    server = build(c, jobs=jobs, say=say)
    model = tinymodel.model_path(c.models)
    if not model.exists():
        say(f"writing the tiny model {model.name}")
        with _locked(c.root / ".lock"):
            model = tinymodel.ensure(c.vocab, c.models)
    return Built(server=server, model=model)


def build(c: Cache | None = None, *, jobs: int | None = None, say: Say = print) -> Path:
    """Fetch the sdist and build ``llama-server`` unless a complete build of this version exists.

    Safe to call from several processes at once (a test and the demo, two nox sessions): they
    serialise on a lock file and the second finds the first one's stamp. ``jobs`` defaults to
    ``$LLMGW_BUILD_JOBS`` or 2: the build is compile-bound and on a shared 2-core runner more jobs
    only add memory pressure.
    """
    c = c or cache()
    c.root.mkdir(parents=True, exist_ok=True)
    with _locked(c.root / ".lock"):
        done = server_path(c)
        if done is not None:
            return done
        jobs = jobs or int(os.environ.get("LLMGW_BUILD_JOBS") or 2)
        cmake = _need_tool("cmake", "pip install cmake (nox -s engines does it for you)")
        _need_compiler()
        started = time.monotonic()
        _fetch(c, say)
        _extract(c, say)
        say(f"building {TARGET} from llama-cpp-python {c.version} with -j{jobs} ({BUILD_TIME_HINT})")
        with open(c.log, "w", encoding="utf-8") as log:
            _run(
                [cmake, "-S", str(c.source), "-B", str(c.build_dir), *CMAKE_FLAGS],
                log,
                c,
                "cmake configure",
                say,
            )
            _run(
                [cmake, "--build", str(c.build_dir), "--target", TARGET, f"-j{jobs}"],
                log,
                c,
                "cmake build",
                say,
            )
        if not os.access(c.server, os.X_OK):
            raise BuildError(f"cmake finished but {c.server} is not there; see {c.log}")
        version = _server_version(c.server)
        seconds = round(time.monotonic() - started)
        _write_atomic(
            c.stamp,
            json.dumps(
                {
                    "version": c.version,
                    "cmake_flags": list(CMAKE_FLAGS),
                    "server_version": version,
                    "build_seconds": seconds,
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                },
                indent=2,
            ),
        )
        say(f"built {c.server} ({version}) in {seconds // 60} min {seconds % 60} s")
        return c.server


# ---------------------------------------------------------------------------------------------
# Steps


def _fetch(c: Cache, say: Say) -> None:
    """``pip download`` the sdist: the registry's own client, so its mirrors and certificates apply."""
    if c.sdist.exists():
        return
    say(f"downloading the llama-cpp-python {c.version} sdist (about 75 MB)")
    c.sdist.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--dest",
        str(c.sdist.parent),
        f"llama-cpp-python=={c.version}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0 or not c.sdist.exists():
        output = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise BuildError(
            f"pip could not download llama-cpp-python=={c.version} (exit {done.returncode}):\n  "
            + "\n  ".join(output)
        )


def _extract(c: Cache, say: Say) -> None:
    """Unpack into a staging directory, then rename: a half-extracted tree is never mistaken for one."""
    if c.vocab.exists():
        return
    say(f"extracting {c.sdist.name}")
    final = c.root / "src"
    staging = c.root / "src.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(c.sdist) as archive:
        archive.extractall(staging, filter="data")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    if not c.vocab.exists():
        raise BuildError(
            f"{c.sdist.name} has no {c.vocab.relative_to(c.root)}: not the expected sdist layout"
        )


_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


def _run(argv: list[str], log: TextIO, c: Cache, step: str, say: Say) -> None:
    """Run one cmake step with its output in ``build.log``, saying every 10% of progress."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    last = -10
    tail: list[str] = []
    for line in proc.stdout:
        log.write(line)
        tail = [*tail[-29:], line.rstrip()]
        m = _PROGRESS.match(line)
        if m and int(m.group(1)) >= last + 10:
            last = int(m.group(1)) // 10 * 10
            say(f"{step}: {m.group(1)}%")
    code = proc.wait()
    if code != 0:
        raise BuildError(
            f"{step} failed (exit {code}); full output in {c.log}; last lines:\n  " + "\n  ".join(tail)
        )


def _server_version(server: Path) -> str:
    """``llama-server --version`` (it prints to stderr): proves the binary and its libraries load."""
    try:
        done = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{server} does not run: {exc}") from exc
    text = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        raise BuildError(f"{server} --version exited {done.returncode}: {text[-500:]}")
    m = re.search(r"^version: (.+)$", text, re.MULTILINE)  # "version: 0.5.0-dev (build 1, commit 0c1e570)"
    return m.group(1).strip() if m else text.splitlines()[-1] if text else "unknown"


def _need_tool(name: str, hint: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"{name} not found on PATH: {hint}")
    return path


def _need_compiler() -> None:
    """cmake's own error for a missing compiler is a page long; this one says what to install."""
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        raise BuildError("no C++ compiler found (c++, g++ or clang++): install one, e.g. apt-get install g++")
    if not (shutil.which("make") or shutil.which("ninja") or os.environ.get("CMAKE_GENERATOR")):
        raise BuildError("neither make nor ninja found: install one, e.g. apt-get install make")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(text)
    tmp.replace(path)


__all__ = [
    "BUILD_TIME_HINT",
    "CMAKE_FLAGS",
    "VERSION",
    "BuildError",
    "Built",
    "Cache",
    "build",
    "cache",
    "ensure",
    "installed",
    "server_path",
]
