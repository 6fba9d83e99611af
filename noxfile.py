"""Project tasks: ``nox -s tests | lint | typecheck | proto | bench``.

Each session builds its own virtual environment from pyproject.toml, so what passes here passes on a
fresh machine with only Python 3.11 and the package registries.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PACKAGES = ["schema", "agent", "control"]
CHECKED = [*PACKAGES, "demo", "bench"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole test suite, with real processes and real peers."""
    session.install("-e", ".[test,dev]")
    session.run("pytest", *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The README's demo: the system end to end on loopback, no GPU needed."""
    session.install("-e", ".[demo]")
    session.run("python", "-m", "demo", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", *CHECKED, "tests", "noxfile.py")
    session.run("ruff", "format", "--check", *CHECKED, "tests", "noxfile.py")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[test,dev]")
    session.run("mypy", *CHECKED)


@nox.session(python="3.11")
def proto(session: nox.Session) -> None:
    """Regenerate schema/gen from schema/llmgw/v1/*.proto (commit the result)."""
    session.install("-e", ".[dev]")
    session.run("python", "-m", "schema.protogen")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks that print ratios against a peer measured in the same run."""
    session.install("-e", ".[test,dev]")
    session.run("python", "-m", "bench.wire", *session.posargs)
    session.run("python", "-m", "bench.agent")
    # LiteLLM's proxy, the router's peer; pinned: a benchmark's peer must not move under it.
    session.install("litellm[proxy]==1.106.12")
    session.run("python", "-m", "bench.router")
    session.run("python", "-m", "bench.control")
