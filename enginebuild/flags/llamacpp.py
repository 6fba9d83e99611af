"""llama.cpp's ``llama-server`` options, from the ``--help`` of the binary ``nox -s engines`` builds.

How: llama.cpp declares every option in C++ (``common/arg.cpp``: ``common_arg({"-c", "--ctx-size"},
"N", ...)``) and prints them all, per example, in ``--help``: each entry starts at column 0 with
its spellings separated by commas, then the value hint when it takes one (``N``, ``FNAME``,
``{none,layer,row,tensor}``, ``[on|off|auto]``, ``<0|1>``), then the description. Parsing that
output reads the parser the binary really has (the build's own options, nothing guessed from a
source tree of another version). Value hints become: ``{a,b}``, ``[a|b]`` and ``<a|b>`` choices;
anything else (``N``, ``FNAME``...) a string, because llama.cpp's numeric options also take words
(``-ngl auto``/``all``), so a stricter type would refuse what the engine accepts. An entry with no
hint is a switch; its ``--no-`` spelling, when printed, is listed with it.

The file is named by the build number ``llama-server --version`` prints (``version: 0.5.0-dev
(build 1, commit 0c1e570)`` -> ``b1``), the same key the agent's version detection reports.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from enginebuild import llamacpp as build
from enginebuild.flags import core

ENGINE = "llamacpp"

#: What ``nox -s flags`` regenerates: the build ``nox -s engines`` makes (llama-cpp-python
#: 0.3.36's vendored tree has no git history, so its build number is 1).
VERSIONS = ("b1",)
PROGRAM = "llama-server"

_CHOICES = re.compile(r"^[{\[<]([^}\]>]*)[}\]>]$")
_VERSION = re.compile(r"\(build (\d+), commit ([0-9a-f]+)\)")


def version_of(version_output: str) -> str:
    """``bNNNN`` from ``llama-server --version`` output; raises ValueError naming the text."""
    m = _VERSION.search(version_output)
    if m is None:
        raise ValueError(
            f"llama-server --version printed no '(build N, commit H)': {version_output[-300:]!r}"
        )
    return f"b{m.group(1)}"


def _choices(hint: str) -> list[str] | None:
    m = _CHOICES.match(hint)
    if m is None:
        return None
    values = [v for v in re.split(r"[,|]", m.group(1)) if v]
    if not values or any(not re.fullmatch(r"[\w.+-]+", v) for v in values):
        return None
    return values


def _dest(flags: list[str]) -> str:
    named = [f for f in flags if f.startswith("--") and not f.startswith("--no-")]
    longest = max(named, key=len, default=flags[0])
    return longest.lstrip("-").replace("-", "_")


def extract_help(text: str) -> list[dict[str, Any]]:
    """Every option in ``llama-server --help`` output, in the data-file format, sorted."""
    options: dict[str, dict[str, Any]] = {}
    for raw in text.splitlines():
        if not raw.startswith("-") or raw.startswith("-----"):
            continue
        line = re.sub(r",\s+", ", ", raw.rstrip())
        head = re.split(r"\s{2,}", line, maxsplit=1)[0]
        flags: list[str] = []
        hint = ""
        for token in head.split(", "):
            flag, _, rest = token.partition(" ")
            if not flag.startswith("-"):
                break
            flags.append(flag)
            if rest:
                hint = rest.strip()
                break
        if not flags:
            continue
        switch = not hint
        entry: dict[str, Any] = {
            "flags": flags,
            "dest": _dest(flags),
            "takes_value": not switch,
            "type": "bool" if switch else "str",
            "nargs": None,
            "choices": None if switch else _choices(hint),
            "deprecated_choices": {},
        }
        # The same option can be printed under two examples' sections; keep the first.
        options.setdefault(flags[0], entry)
    return sorted(options.values(), key=lambda o: str(o["flags"][0]))


def document(help_text: str, version: str, server_version: str) -> dict[str, Any]:
    """The format-1 document from ``--help`` output, for build ``version`` (``bNNNN``)."""
    return core.document(
        engine=ENGINE,
        version=version,
        program=PROGRAM,
        source=f"llama-server --help ({server_version})",
        positionals=[],
        options=extract_help(help_text),
    )


def run_server(server: Path, arg: str) -> str:
    """``llama-server ARG`` output (stdout and stderr: it prints ``--version`` to stderr)."""
    done = subprocess.run([str(server), arg], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise core.ExtractError(
            f"{server} {arg} exited {done.returncode}: {(done.stdout + done.stderr)[-500:]}"
        )
    return done.stdout + done.stderr


def fetch(version: str, workdir: Path) -> tuple[Path, str]:
    """The ``llama-server`` that ``nox -s engines`` built (nothing is downloaded here: building is
    that session's job); (the binary, where it is)."""
    server = build.server_path()
    if server is None:
        raise core.ExtractError("no llama-server built; run `nox -s engines` first")
    return server, "built by nox -s engines"


def extract(source_dir: Path, version: str) -> dict[str, Any]:
    """The document for the ``llama-server`` binary at ``source_dir``; ``version`` (``bNNNN``)
    must be the build the binary reports."""
    reported = run_server(source_dir, "--version")
    found = version_of(reported)
    if version and version != found:
        raise core.ExtractError(
            f"{source_dir} is llama.cpp {found}, not {version}: ask for {found}, or build {version}"
        )
    line = next((ln for ln in reported.splitlines() if ln.startswith("version:")), reported.strip())
    return document(run_server(source_dir, "--help"), found, line.removeprefix("version:").strip())
