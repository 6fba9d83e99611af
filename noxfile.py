"""Project tasks: ``nox -s tests | chaos | e2e | engines | flags | lint | typecheck | fuzz | proto | bench``.

Each session builds its own virtual environment from pyproject.toml, so what passes here passes on a
fresh machine with only Python 3.11 and the package registries.
"""

from __future__ import annotations

import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PACKAGES = [
    "schema",
    "transport",
    "telemetry",
    "settings",
    "statefile",
    "enginedefs",
    "agent",
    "control",
    "router",
]
CHECKED = [*PACKAGES, "demo", "bench", "enginebuild", "tools"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole test suite, with real processes and real peers."""
    session.install("-e", ".[test,dev]")
    # The fault tests are their own session (below); given explicit arguments, run what they name.
    session.run("pytest", *(session.posargs or ["-m", "not chaos"]))


@nox.session(python="3.11")
def chaos(session: nox.Session) -> None:
    """Fault tests with real processes: kill -9 at varied instants, SIGSTOP/SIGCONT of agents and
    engines, black-holed streams, engines that hang. Each checks its invariant (one engine per
    slot, no failed request, the state timeline), is bounded in time and ends what it started."""
    session.install("-e", ".[test,dev]")
    session.run("pytest", "-m", "chaos", *session.posargs)


def _build_engines(session: nox.Session) -> None:
    """Build llama-server and write the tiny model into the cache (a no-op when both are there).

    cmake comes from PyPI when the machine has none, so a fresh runner needs only a C++ compiler.
    """
    session.install("-e", ".[engines]")
    if shutil.which("cmake") is None:
        session.install("cmake")
    session.run("python", "-m", "enginebuild")


@nox.session(python="3.11")
def engines(session: nox.Session) -> None:
    """llama.cpp's llama-server from the pinned llama-cpp-python sdist, into ~/.cache/llmgw/llama.cpp/
    (about 15 minutes on 2 cores the first time, reused after), and the tiny test model."""
    _build_engines(session)


@nox.session(python="3.11")
def e2e(session: nox.Session) -> None:
    """The real engine end to end: llama-server through agent, control plane and router.

    Builds the engine first when the cache is empty; here the test may not skip for want of it.
    """
    session.install("-e", ".[test,engines]")
    _build_engines(session)
    session.run("pytest", "tests/test_e2e_llamacpp.py", *session.posargs, env={"LLMGW_E2E_REQUIRED": "1"})


@nox.session(python="3.11")
def flags(session: nox.Session) -> None:
    """Rewrite every committed engine flag file (agent/engines/flags/) from the pinned engine
    packages' own code: downloads each package without its dependencies (vLLM's wheel is ~400 MB),
    imports nothing heavy, needs no GPU. ``nox -s flags -- vllm 0.18.0`` writes one file."""
    # pydantic is real in the extractor's child process: vLLM's and SGLang's config dataclasses
    # are pydantic's, and their defaults run while the parsers are built. msgspec is real for
    # SGLang >= 0.5.23, whose options are msgspec Structs in sglang.srt.arg_groups.
    session.install("-e", ".", "pydantic>=2.12", "msgspec>=0.19")
    session.run("python", "-m", "enginebuild.flags", *(session.posargs or ["--all"]))


@nox.session(python="3.11")
def kvevents(session: nox.Session) -> None:
    """Rewrite tests/fixtures/vllm_kv_events/ (vLLM's KV event classes, which a test decodes the sim's
    events with) from the pinned vLLM wheels; ``nox -s kvevents -- --wheels DIR`` reuses wheels
    already downloaded (each is ~400 MB)."""
    session.install("-e", ".")
    session.run("python", "-m", "enginebuild.kvevents", *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The README's demo: the system end to end on loopback, no GPU needed.

    ``nox -s demo -- --engine llamacpp`` runs it on real llama.cpp engines instead of ``sim``.
    """
    session.install("-e", ".[demo]")
    if any("llamacpp" in arg for arg in session.posargs):
        _build_engines(session)
    session.run("python", "-m", "demo", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", *CHECKED, "tests", "noxfile.py")
    session.run("ruff", "format", "--check", *CHECKED, "tests", "noxfile.py")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[test,dev,engines]")
    session.run("mypy", *CHECKED)


@nox.session(python="3.11")
def fuzz(session: nox.Session) -> None:
    """The native relay pump built with AddressSanitizer and UndefinedBehaviorSanitizer, fed
    malformed engine bytes: the differential test against the Python scanner, thousands of random
    bodies through its thread, and its own tests (tests/fuzz/asan.py; Linux with gcc or clang).
    Bounded by ``--timeout`` (900 s by default); ``nox -s fuzz -- --cases 500`` for a short run."""
    session.install("-e", ".[test,dev]")
    session.run("python", "-m", "tests.fuzz.asan", *session.posargs)


@nox.session(python="3.11")
def proto(session: nox.Session) -> None:
    """Regenerate schema/gen from schema/llmgw/v1/*.proto (commit the result)."""
    session.install("-e", ".[dev]")
    session.run("python", "-m", "tools.protogen")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks that print ratios against a peer measured in the same run.

    ``nox -s bench -- --quick`` runs each at a tiny size (seconds each; CI runs it so that a benchmark
    that no longer works fails there), the router's against one peer, vllm-router, only. Other
    arguments go to bench.wire.
    """
    quick = "--quick" in session.posargs
    session.install("-e", ".[test,dev]")
    session.run("python", "-m", "bench.wire", *session.posargs)
    session.run("python", "-m", "bench.agent", *(["--quick"] if quick else []))
    # The router's peers (LiteLLM's proxy, the vLLM project's and SGLang's Rust routers), pinned: a
    # benchmark's peer must not move under it. bench/router.py's PINS names the same versions.
    # --quick compares with vllm-router alone: one wheel, installed in seconds (LiteLLM's proxy
    # brings a hundred packages); bench/router.py's QUICK_SKIPS skips the other two.
    if quick:
        session.install("vllm-router==0.1.17")
    else:
        session.install("litellm[proxy]==1.106.12", "vllm-router==0.1.17", "sglang-router==0.3.2")
    session.run("python", "-m", "bench.router", *(["--quick"] if quick else []))
    session.run("python", "-m", "bench.control", *(["--quick"] if quick else []))
