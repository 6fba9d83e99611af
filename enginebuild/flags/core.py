"""What every engine's extractor shares: fetching a pinned package, unpacking it, turning an
argparse parser into format-1 options, and writing the data file.

The data file's format is defined once, by the loader (``agent.engines.flagsets.parse_document``);
:func:`document` builds a file and runs it through that same check before anything is written, so
the tool can never write a file the agent would refuse to load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from agent.engines import flagsets

#: Where the committed files live (the loader reads the same folder).
DATA_DIR = flagsets.DATA_DIR


class ExtractError(RuntimeError):
    """The tool cannot produce a file; the message says which engine, version and step."""


def produced_by(engine: str, version: str) -> str:
    """The command that regenerates a file; the staleness test checks it against the file name."""
    return f"python -m enginebuild.flags {engine} {version}"


def pip_download(
    requirement: str,
    dest: Path,
    *,
    wheel_platforms: Sequence[str] = (),
    python_version: str = "3.12",
) -> Path:
    """Download one distribution of requirement, without its dependencies, into dest; its path.

    With ``wheel_platforms`` it is a wheel for one of those platform tags (pip needs to build
    nothing for a wheel); without, the sdist (``--no-binary :all:``), which pip can fetch only when
    the sdist's metadata builds without the package's heavy build dependencies (vLLM's needs torch,
    so vLLM is read from its wheel, whose Python files are the same source).
    """
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--dest", str(dest)]
    if wheel_platforms:
        cmd += ["--only-binary", ":all:", "--python-version", python_version, "--implementation", "cp"]
        for platform in wheel_platforms:
            cmd += ["--platform", platform]
    else:
        cmd += ["--no-binary", ":all:"]
    cmd.append(requirement)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise ExtractError(f"pip download {requirement} failed (exit {done.returncode}):\n{tail}")
    new = sorted(set(dest.iterdir()) - before) or sorted(dest.iterdir())
    if len(new) != 1:
        raise ExtractError(f"pip download {requirement}: expected one file in {dest}, found {len(new)}")
    return new[0]


def _safe(name: str, archive: Path) -> str:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise ExtractError(f"{archive.name}: refusing member {name!r} outside the unpack folder")
    return name


def archive_names(archive: Path) -> list[str]:
    """Every member name of a wheel, zip or tarball."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            return z.namelist()
    with tarfile.open(archive) as t:
        return t.getnames()


def unpack(archive: Path, dest: Path, keep: Callable[[str], bool]) -> list[str]:
    """Unpack the members of archive whose names keep accepts into dest; their names.

    An extractor reads source files only, so it keeps those (vLLM's wheel is 400 MB of kernels
    around 30 MB of Python)."""
    dest.mkdir(parents=True, exist_ok=True)
    kept: list[str] = []
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if keep(name) and not name.endswith("/"):
                    z.extract(_safe(name, archive), dest)
                    kept.append(name)
        return kept
    with tarfile.open(archive) as t:
        members = [m for m in t.getmembers() if m.isfile() and keep(_safe(m.name, archive))]
        t.extractall(dest, members=members, filter="data")
        return [m.name for m in members]


def _json_value(value: Any, where: str) -> Any:
    if value is None:
        # ``Literal[..., None]``: the engine's converter turns the word None into None.
        return "None"
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ExtractError(f"{where}: choice {value!r} is not a JSON string or number")
    return value


def _nargs(action: argparse.Action) -> str | None:
    nargs = action.nargs
    if nargs is None or nargs == 0:
        return None
    if nargs in ("?", "+", "*"):
        return str(nargs)
    raise ExtractError(
        f"option {'/'.join(action.option_strings) or action.dest}: nargs {nargs!r} has no format-1 form"
    )


def options_from_parser(
    parser: argparse.ArgumentParser,
    type_name: Callable[[argparse.Action], str],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(positionals, options) of parser in format 1, read from its actions as argparse will use them.

    ``type_name`` maps an action that takes a value to one of ``str int float bool json`` (each
    engine wraps its converters its own way). A switch (``nargs == 0``: store_true, store_const,
    BooleanOptionalAction, help) is ``bool`` with ``takes_value`` false; argparse already lists both
    spellings of a BooleanOptionalAction in its option strings.
    """
    positionals: list[dict[str, Any]] = []
    options: list[dict[str, Any]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            raise ExtractError(f"{parser.prog}: a sub-command parser has no format-1 form")
        if not action.option_strings:
            positionals.append({"name": action.dest, "nargs": _nargs(action)})
            continue
        where = "/".join(action.option_strings)
        takes_value = action.nargs != 0
        kind = type_name(action) if takes_value else "bool"
        if kind not in flagsets.TYPES:
            raise ExtractError(f"{where}: type {kind!r} is not one of {', '.join(flagsets.TYPES)}")
        choices = None
        if action.choices is not None and takes_value:
            choices = list(dict.fromkeys(_json_value(c, where) for c in action.choices))
        options.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "takes_value": takes_value,
                "type": kind,
                "nargs": _nargs(action) if takes_value else None,
                "choices": choices,
                "deprecated_choices": {},
            }
        )
    return positionals, options


def document(
    *,
    engine: str,
    version: str,
    program: str,
    source: str,
    positionals: Iterable[dict[str, Any]],
    options: Iterable[dict[str, Any]],
) -> dict[str, Any]:
    """A format-1 document, options sorted by first flag, checked by the loader's own rules."""
    doc: dict[str, Any] = {
        "format": flagsets.FORMAT,
        "engine": engine,
        "version": version,
        "program": program,
        "produced_by": produced_by(engine, version),
        "source": source,
        "positionals": list(positionals),
        "options": sorted(options, key=lambda o: str(o["flags"][0])),
    }
    try:
        flagsets.parse_document(doc, f"{engine}-{version} (as extracted)")
    except flagsets.FlagSetError as exc:
        raise ExtractError(str(exc)) from None
    return doc


def render(doc: dict[str, Any]) -> str:
    """The committed text: indented and key-sorted so a new version's diff reads option by option."""
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def write(doc: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / flagsets.file_name(str(doc["engine"]), str(doc["version"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(render(doc), encoding="utf-8")
    return path
