"""Engine flag sets: every command-line option an engine version accepts, from its own code.

The adapters once encoded each engine's flags by hand, and nothing checked them against the engine:
a wrong choice crashed the shard on the node. Now ``python -m enginebuild.flags ENGINE VERSION``
reads the option definitions out of the engine's released package and writes
``agent/engines/flags/<engine>-<version>.json``; this module loads those files, picks the one for
the version a node runs (:func:`for_version`), and checks an argv against it
(:meth:`FlagSet.check_argv`) in the engine's own words, so a command line the engine would refuse
is refused before launch. The ``sim`` engine builds its parser from the same files.

Format 1 (one definition, here; the tool runs every file it writes through :func:`parse_document`)::

    {"format": 1, "engine": "vllm", "version": "0.18.0", "program": "vllm serve",
     "produced_by": "python -m enginebuild.flags vllm 0.18.0", "source": "...",
     "positionals": [{"name": "model_tag", "nargs": "?"}],
     "options": [{"flags": ["--quantization", "-q"], "dest": "quantization", "takes_value": true,
                  "type": "str", "nargs": null, "choices": ["awq", ...],
                  "deprecated_choices": {"fbgemm_fp8": "is deprecated and needs --allow-deprecated-quantization"}}]}

``type`` is one of :data:`TYPES` (``json``: the engine parses a JSON value); ``takes_value`` false
is a switch, with both spellings of a ``--x/--no-x`` pair in ``flags``; ``nargs`` is null, "?",
"+" or "*"; ``choices`` null means any value of the type. A deprecated choice's message names the
flag that enables it (``--allow-deprecated-quantization``); without that flag it is a problem.

The files are package data, read once per process (cached): about 100 kB of JSON each.
"""

from __future__ import annotations

import functools
import json
import math
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from packaging.version import InvalidVersion, Version

import enginedefs

#: The format this module reads and the tool writes.
FORMAT = 1

#: Value types an option can have.
TYPES = ("str", "int", "float", "bool", "json")


#: The committed files (package data: ``agent = ["engines/flags/*.json"]``).
DATA_DIR = Path(__file__).resolve().parent / "flags"

_NARGS = (None, "?", "+", "*")
_DOC_KEYS = frozenset(
    {"format", "engine", "version", "program", "produced_by", "source", "positionals", "options"}
)
_OPTION_KEYS = frozenset({"flags", "dest", "takes_value", "type", "nargs", "choices", "deprecated_choices"})
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_FLAG_IN_TEXT = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")
_LLAMACPP_BUILD = re.compile(r"^b(\d+)$")


class FlagSetError(ValueError):
    """A flag file that does not load, or an engine with no files; names the file and the key."""


Choice = str | int | float


@attrs.frozen
class Positional:
    name: str
    nargs: str | None


@attrs.frozen
class Option:
    """One option as the engine declares it."""

    flags: tuple[str, ...]
    dest: str
    takes_value: bool
    type: str
    nargs: str | None
    choices: tuple[Choice, ...] | None
    deprecated_choices: Mapping[str, str]

    @property
    def name(self) -> str:
        """How argparse names the option in its errors: ``--quantization/-q``."""
        return "/".join(self.flags)


@attrs.frozen
class FlagSet:
    """One engine version's command line."""

    engine: str
    version: str
    program: str
    produced_by: str
    source: str
    positionals: tuple[Positional, ...]
    options: tuple[Option, ...]
    by_flag: Mapping[str, Option] = attrs.field(repr=False, eq=False)

    @property
    def label(self) -> str:
        """``vLLM 0.18.0``: how a message names the engine a command line was checked against."""
        return f"{enginedefs.label(self.engine)} {self.version}"

    def option(self, flag: str) -> Option | None:
        """The option spelled flag (any of its spellings, ``--no-x`` included), or None."""
        return self.by_flag.get(flag)

    def normalize(self, argv: Sequence[str]) -> list[str]:
        """argv as the engine's parser sees it after its own spelling rules, before argparse.

        vLLM's ``FlexibleArgumentParser`` takes ``--max_model_len`` for ``--max-model-len``: in
        every ``--`` argument it turns underscores into dashes up to the first ``.`` or ``=``. The
        other engines use argparse (or click) as is."""
        if self.engine != "vllm":
            return list(argv)
        out = []
        for token in argv:
            if token.startswith("--"):
                key, eq, value = token.partition("=")
                name, dot, rest = key[2:].partition(".")
                token = f"--{name.replace('_', '-')}{dot}{rest}{eq}{value}"
            out.append(token)
        return out

    def check_argv(self, argv: Sequence[str]) -> list[str]:
        """Every reason the engine would refuse argv, in its words, prefixed with :attr:`label`.

        argv is what follows the program (``vllm serve``): positionals and options. The rules are
        argparse's, as the engines use it, after the engine's own spellings (:meth:`normalize`):
        flags match exactly (no abbreviations), ``--x=v`` is
        one value, a token starting with ``-`` is a flag unless it is a negative number, ``--``
        ends the options; then each value's type, its choices, and deprecated choices without
        the flag their message names.
        """
        return [f"{self.label}: {p}" for p in _check(self, self.normalize(argv))]


def _is_flag(token: str) -> bool:
    return token.startswith("-") and token != "-" and " " not in token and not _NEGATIVE_NUMBER.match(token)


def _convert(option: Option, value: str) -> tuple[Choice | None, str | None]:
    """(converted value, problem): argparse's type step."""
    try:
        if option.type == "int":
            return int(value), None
        if option.type == "float":
            return float(value), None
        if option.type == "json":
            json.loads(value)
            return value, None
    except ValueError:
        return None, f"argument {option.name}: invalid {option.type} value: {value!r}"
    return value, None


def _check_value(fs: FlagSet, option: Option, value: str, enabled: set[str]) -> list[str]:
    converted, problem = _convert(option, value)
    if problem:
        return [problem]
    if (
        option.choices is not None
        and converted not in option.choices
        and value not in map(str, option.choices)
    ):
        listed = ", ".join(repr(c) for c in option.choices)
        return [f"argument {option.name}: invalid choice: {value!r} (choose from {listed})"]
    message = option.deprecated_choices.get(value)
    if message is not None:
        needs = _FLAG_IN_TEXT.findall(message)
        if not needs or not any(flag in enabled for flag in needs):
            return [f"{option.flags[0]} {value} {message}"]
    return []


def _enabled_switches(fs: FlagSet, argv: list[str]) -> set[str]:
    """Switches that are on at the end of argv (``--x`` then ``--no-x`` is off, as argparse has it)."""
    on: dict[str, bool] = {}
    for token in argv:
        if token == "--":
            break
        option = fs.by_flag.get(token)
        if option is None or option.takes_value:
            continue
        positive = option.flags[0]
        on[positive] = not (token.startswith("--no-") and token != positive)
    return {flag for flag, value in on.items() if value}


def _check(fs: FlagSet, argv: list[str]) -> list[str]:
    problems: list[str] = []
    unrecognized: list[str] = []
    positionals: list[str] = []
    enabled = _enabled_switches(fs, argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            positionals.extend(argv[i:])
            break
        if not _is_flag(token):
            positionals.append(token)
            continue
        flag, eq, explicit = token.partition("=")
        option = fs.by_flag.get(flag)
        if option is None:
            unrecognized.append(token)
            continue
        if not option.takes_value:
            if eq:
                problems.append(f"argument {option.name}: ignored explicit argument {explicit!r}")
            continue
        values: list[str] = []
        if eq:
            values.append(explicit)
        elif option.nargs in ("+", "*"):
            while i < len(argv) and not _is_flag(argv[i]) and argv[i] != "--":
                values.append(argv[i])
                i += 1
        elif i < len(argv) and not _is_flag(argv[i]) and argv[i] != "--":
            values.append(argv[i])
            i += 1
        if not values and option.nargs is None:
            problems.append(f"argument {option.name}: expected one argument")
        elif not values and option.nargs == "+":
            problems.append(f"argument {option.name}: expected at least one argument")
        for value in values:
            problems.extend(_check_value(fs, option, value, enabled))
    capacity = sum(1 if p.nargs in (None, "?") else math.inf for p in fs.positionals)
    missing = [p.name for p in fs.positionals[len(positionals) :] if p.nargs in (None, "+")]
    if missing:
        problems.append(f"the following arguments are required: {', '.join(missing)}")
    if len(positionals) > capacity:
        unrecognized.extend(positionals[int(capacity) :])
    if unrecognized:
        problems.append(f"unrecognized arguments: {' '.join(unrecognized)}")
    return problems


def produced_by(engine: str, version: str) -> str:
    """The command that writes (and rewrites) an engine version's file."""
    return f"python -m enginebuild.flags {engine} {version}"


def file_name(engine: str, version: str) -> str:
    return f"{engine}-{version}.json"


def version_key(version: str) -> tuple[int, Any] | None:
    """A sort key for an engine version: PEP 440 where it parses, llama.cpp's ``bNNNN`` by its
    number; None for anything else (an unknown version)."""
    build = _LLAMACPP_BUILD.match(version.strip())
    if build:
        return (0, int(build.group(1)))
    try:
        return (1, Version(version))
    except InvalidVersion:
        return None


def _need(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise FlagSetError(f"{where}: {message}; regenerate it with `nox -s flags`")


def _parse_option(raw: Any, where: str) -> Option:
    _need(isinstance(raw, dict), where, "an option is not an object")
    _need(set(raw) == _OPTION_KEYS, where, f"option keys {sorted(raw)} are not {sorted(_OPTION_KEYS)}")
    flags = raw["flags"]
    _need(
        isinstance(flags, list)
        and bool(flags)
        and all(isinstance(f, str) and f.startswith("-") for f in flags),
        where,
        f"option flags {flags!r} are not a non-empty list of strings starting with '-'",
    )
    name = "/".join(flags)
    _need(
        isinstance(raw["dest"], str) and bool(raw["dest"]), where, f"{name}: dest is not a non-empty string"
    )
    _need(isinstance(raw["takes_value"], bool), where, f"{name}: takes_value is not true or false")
    _need(raw["type"] in TYPES, where, f"{name}: type {raw['type']!r} is not one of {', '.join(TYPES)}")
    _need(raw["nargs"] in _NARGS, where, f"{name}: nargs {raw['nargs']!r} is not null, '?', '+' or '*'")
    _need(raw["takes_value"] or raw["nargs"] is None, where, f"{name}: a switch has nargs null")
    choices = raw["choices"]
    if choices is not None:
        _need(
            isinstance(choices, list)
            and bool(choices)
            and all(isinstance(c, str | int | float) and not isinstance(c, bool) for c in choices),
            where,
            f"{name}: choices are neither null nor a non-empty list of strings and numbers",
        )
    deprecated = raw["deprecated_choices"]
    _need(
        isinstance(deprecated, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in deprecated.items()),
        where,
        f"{name}: deprecated_choices is not an object of strings",
    )
    if choices is not None:
        unknown = sorted(set(deprecated) - {str(c) for c in choices})
        _need(not unknown, where, f"{name}: deprecated choices {unknown} are not among its choices")
    return Option(
        flags=tuple(flags),
        dest=raw["dest"],
        takes_value=raw["takes_value"],
        type=raw["type"],
        nargs=raw["nargs"],
        choices=None if choices is None else tuple(choices),
        deprecated_choices=types.MappingProxyType(dict(deprecated)),
    )


def parse_document(doc: Any, where: str) -> FlagSet:
    """A FlagSet from a decoded format-1 document, or FlagSetError naming where and the key."""
    _need(isinstance(doc, dict), where, "the document is not a JSON object")
    _need(set(doc) == _DOC_KEYS, where, f"top-level keys {sorted(doc)} are not {sorted(_DOC_KEYS)}")
    _need(
        doc["format"] == FORMAT and not isinstance(doc["format"], bool),
        where,
        f"format {doc['format']!r} is not {FORMAT}",
    )
    engine, version = doc["engine"], doc["version"]
    _need(
        engine in enginedefs.FLAG_ENGINES,
        where,
        f"engine {engine!r} is not one of {', '.join(enginedefs.FLAG_ENGINES)}",
    )
    _need(
        isinstance(version, str) and version_key(version) is not None,
        where,
        f"version {version!r} does not parse",
    )
    for key in ("program", "source"):
        _need(isinstance(doc[key], str) and bool(doc[key]), where, f"{key} is not a non-empty string")
    _need(
        doc["produced_by"] == produced_by(engine, version),
        where,
        f"produced_by {doc['produced_by']!r} is not {produced_by(engine, version)!r}",
    )
    raw_positionals = doc["positionals"]
    _need(isinstance(raw_positionals, list), where, "positionals is not a list")
    positionals = []
    for p in raw_positionals:
        _need(
            isinstance(p, dict)
            and set(p) == {"name", "nargs"}
            and isinstance(p["name"], str)
            and p["nargs"] in _NARGS,
            where,
            f"positional {p!r} is not {{name, nargs}}",
        )
        positionals.append(Positional(name=p["name"], nargs=p["nargs"]))
    _need(isinstance(doc["options"], list), where, "options is not a list")
    options = tuple(_parse_option(raw, where) for raw in doc["options"])
    firsts = [o.flags[0] for o in options]
    _need(firsts == sorted(firsts), where, "options are not sorted by their first flag")
    by_flag: dict[str, Option] = {}
    for option in options:
        for flag in option.flags:
            _need(flag not in by_flag, where, f"flag {flag} belongs to two options")
            by_flag[flag] = option
    return FlagSet(
        engine=engine,
        version=version,
        program=doc["program"],
        produced_by=doc["produced_by"],
        source=doc["source"],
        positionals=tuple(positionals),
        options=options,
        by_flag=types.MappingProxyType(by_flag),
    )


@functools.lru_cache(maxsize=64)
def load(path: Path) -> FlagSet:
    """The flag set in path; its name must be ``<engine>-<version>.json`` for the engine and
    version it holds (so :func:`for_version` can choose by name without reading every file)."""
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise FlagSetError(f"{where}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise FlagSetError(f"{where}: not JSON: {exc}; regenerate it with `nox -s flags`") from None
    fs = parse_document(doc, where)
    _need(
        Path(path).name == file_name(fs.engine, fs.version),
        where,
        f"holds {fs.label}, so its name must be {file_name(fs.engine, fs.version)}",
    )
    return fs


@functools.lru_cache(maxsize=16)
def _versions(engine: str, data_dir: Path) -> tuple[str, ...]:
    found = []
    for path in data_dir.glob(f"{engine}-*.json"):
        version = path.name[len(engine) + 1 : -len(".json")]
        key = version_key(version)
        if key is not None:
            found.append((key, version))
    found.sort()
    return tuple(v for _, v in found)


def available(engine: str, data_dir: Path = DATA_DIR) -> list[str]:
    """The versions of engine with a flag file, oldest first."""
    return list(_versions(engine, data_dir))


def for_version(engine: str, version: str, data_dir: Path = DATA_DIR) -> FlagSet:
    """The flag set to build and check a command line for ``engine`` at an installed ``version``.

    The newest file whose version is <= version (an engine keeps its options from one release to
    the next far more often than it changes them); the oldest file when the version is unknown
    (""), does not parse, or is older than every file. Never an error for a version without its
    own file; an error only when the engine has no file at all (a packaging mistake).
    """
    versions = _versions(engine, data_dir)
    if not versions:
        raise FlagSetError(
            f"no flag files for engine {engine!r} in {data_dir}; write one with "
            f"`python -m enginebuild.flags {engine} VERSION`"
        )
    chosen = versions[0]
    installed = version_key(version)
    if installed is not None:
        for candidate in versions:
            key = version_key(candidate)
            if key is not None and key[0] == installed[0] and key <= installed:
                chosen = candidate
    return load(data_dir / file_name(engine, chosen))
