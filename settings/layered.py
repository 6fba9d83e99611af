"""The layered loader: flags > environment > TOML file > defaults, into one frozen attrs class.

A process describes its settings once (a :class:`Spec`: its attrs class, one :class:`Setting`
per field, its variable prefix and default file) and gets from here its ``--help``, its three
layers and the structured config. Every layer is read into plain values first and merged key by
key, and every key remembers where its value came from (``--state-dir``, ``LLMGW_AGENT_STATE_DIR``,
``/etc/llmgw/agent.toml line 7``, and for a table's entries the entry's own line), so a bad value
stops the process at start with a line naming the key, that source and what was expected: an
operator fixing a fleet's config should never have to guess which of three places holds the typo.
Unknown keys are errors, with the closest known key as a hint, never ignored.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs

from settings import toml
from settings.convert import converter
from settings.problems import ConfigError, KeyPath, config_error, dotted, problems

#: A process's wording of one problem about a key: (key path, what is wrong, key -> where its value
#: came from) -> the line it prints.
Describe = Callable[[KeyPath, str, Mapping[str, str]], str]


def key_first(path: KeyPath, message: str, sources: Mapping[str, str]) -> str:
    """The usual wording: ``response_timeout (from router.toml line 4): must be ...``."""
    source = source_of(path, sources)
    return f"{dotted(path)} ({f'from {source}' if source else 'by default'}): {message}"


@attrs.frozen(kw_only=True)
class Setting:
    """How one field of a config class is given from outside, and what ``--help`` says of it."""

    #: ``--help``'s words; the variable and the default are added from the spec and the field.
    help: str
    #: The flag; empty: ``--`` and the key with '-' for '_'.
    flag: str = ""
    #: ``--help``'s placeholder for the value; empty: the key in capitals.
    metavar: str = ""
    #: A flag's or variable's text -> the raw value (ValueError saying what was expected); None:
    #: the text itself, for the converter to take.
    parse: Callable[[str], Any] | None = None
    #: A list: the flag repeats, the variable is comma-separated (with ``parse``, its parser).
    repeat: bool = False
    #: A switch: the flag takes no value and sets true.
    switch: bool = False
    #: A secret: its value is never repeated in an error.
    secret: bool = False
    #: The default in words, for a default computed at start or better said than printed.
    default: str = ""


@attrs.frozen(kw_only=True)
class Spec:
    """One process's settings: which class, which names, which words."""

    config: type[Any]
    settings: Mapping[str, Setting]
    #: ``LLMGW_AGENT_``: a field's variable is this and the key in capitals; ``...CONFIG`` names
    #: the file.
    env_prefix: str
    #: Read when present and neither ``--config`` nor the ``...CONFIG`` variable names a file.
    default_file: Path
    prog: str
    description: str
    epilog: str
    #: What ``--version`` prints (called when the parser is built: it may read package metadata).
    version: Callable[[], str]
    describe: Describe = key_first
    #: How a key left at its default is said where a rule across keys names it.
    unset: str = "by default"
    #: The heading of several problems: "N problems in {what}:".
    what: str
    #: Numbers in the merged values may still be text (the flags' and variables' words go to the
    #: converter as they are: ``converter(text=True)``).
    text: bool = False
    #: Variables every llmgw process reads (``LLMGW_LOG_FORMAT``), below this process's own: key
    #: -> variable.
    shared_env: Mapping[str, str] = attrs.field(factory=dict)

    def keys(self) -> list[str]:
        return [a.name for a in attrs.fields(self.config)]

    def flag(self, key: str) -> str:
        return self.settings[key].flag or "--" + key.replace("_", "-")

    def variable(self, key: str) -> str:
        return self.env_prefix + key.upper()

    def default_text(self, key: str) -> str:
        """A field's default as an operator would write it in a flag."""
        words = self.settings[key].default
        if words:
            return words
        default: Any = attrs.fields_dict(self.config)[key].default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        if default is None or default == "" or default == () or default == {}:
            return "none"
        if isinstance(default, bool):
            return str(default).lower()
        if isinstance(default, float) and default.is_integer():
            return str(int(default))
        return str(default)

    def help(self, key: str) -> str:
        """``--help``'s line for one setting: what it is, its variable and its default."""
        return f"{self.settings[key].help} (env {self.variable(key)}; default {self.default_text(key)})"


@attrs.frozen
class Layered:
    """Merged raw values and where each came from: by key, and a file's table entries also by
    their dotted key (``engines.vllm``), so a bad entry is reported at its own line."""

    values: dict[str, Any]
    sources: dict[str, str]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line with status 2, like every other start-up mistake:
    a usage text of some twenty lines would bury the one that says what is wrong."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def build_parser(spec: Spec) -> argparse.ArgumentParser:
    """``--version``, ``--config`` and one flag per setting, each with its help line."""
    missing = [k for k in spec.keys() if k not in spec.settings or not spec.settings[k].help]
    if missing:
        raise RuntimeError(f"{spec.config.__module__}: no help for the setting(s) {', '.join(missing)}")
    parser = OneLineParser(prog=spec.prog, description=spec.description, epilog=spec.epilog)
    parser.add_argument("--version", action="version", version=spec.version())
    parser.add_argument(
        "--config",
        type=Path,
        help=f"TOML config file (env {spec.env_prefix}CONFIG; default {spec.default_file} when present)",
    )
    for key in spec.keys():
        setting = spec.settings[key]
        text = spec.help(key).replace("%", "%%")
        metavar = setting.metavar or key.upper()
        if setting.repeat:
            parser.add_argument(spec.flag(key), dest=key, action="append", metavar=metavar, help=text)
        elif setting.switch:
            parser.add_argument(spec.flag(key), dest=key, action="store_const", const=True, help=text)
        else:
            parser.add_argument(spec.flag(key), dest=key, default=None, metavar=metavar, help=text)
    return parser


def _hint(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _text_value(spec: Spec, key: str, text: str, source: str) -> Any:
    setting = spec.settings[key]
    if setting.parse is None:
        return text
    try:
        return setting.parse(text)
    except ValueError as exc:
        message = str(exc)
        if setting.secret:
            message = message.partition(", got ")[0] + ", got (hidden)"
        raise ConfigError(f"{key} (from {source}): {message}") from None


def from_file(spec: Spec, path: Path) -> Layered:
    """The file's keys, each with its line (and a table's entries with theirs)."""
    text = toml.read_text(path)
    data = toml.parse(text, str(path))
    lines = toml.key_lines(text)
    sources: dict[str, str] = {}
    for key, value in data.items():
        line = toml.nearest_line(lines, (key,))
        sources[key] = f"{path} line {line}" if line else str(path)
        if isinstance(value, dict):
            for sub in value:
                sub_line = lines.get((key, sub))
                if sub_line:
                    sources[dotted((key, sub))] = f"{path} line {sub_line}"
    return Layered(dict(data), sources)


def from_env(spec: Spec, environ: Mapping[str, str]) -> Layered:
    """The process's own variables (``LLMGW_AGENT_*``); one it has no setting for is an error."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    known = spec.keys()
    for name, text in environ.items():
        if not name.startswith(spec.env_prefix) or name == spec.env_prefix + "CONFIG":
            continue
        key = name[len(spec.env_prefix) :].lower()
        if key not in known:
            raise ConfigError(
                f"{name}: unknown setting {key!r} (from the environment); {_hint(key, known)}"
                f"known: {', '.join(known)}"
            )
        setting = spec.settings[key]
        if setting.repeat and setting.parse is None:
            values[key] = tuple(p.strip() for p in text.split(",") if p.strip())
        else:
            values[key] = _text_value(spec, key, text, name)
        sources[key] = name
    return Layered(values, sources)


def from_shared_env(spec: Spec, environ: Mapping[str, str]) -> Layered:
    """Variables every llmgw process reads (one unit file or container setting for all three);
    the process's own variables and its flags win over them."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, name in spec.shared_env.items():
        text = environ.get(name, "")
        if text.strip():
            values[key] = _text_value(spec, key, text, name)
            sources[key] = name
    return Layered(values, sources)


def from_flags(spec: Spec, ns: argparse.Namespace) -> Layered:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in spec.keys():
        given = getattr(ns, key, None)
        if given is None:
            continue
        setting = spec.settings[key]
        if setting.repeat:
            values[key] = tuple(given)
        elif setting.switch:
            values[key] = True
        else:
            values[key] = _text_value(spec, key, given, spec.flag(key))
        sources[key] = spec.flag(key)
    return Layered(values, sources)


def merge(*layers: Layered) -> Layered:
    """Later layers win, key by key; a key replaced whole takes its entries' sources with it."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer in layers:
        for key in layer.values:
            sources = {k: v for k, v in sources.items() if not k.startswith(f"{key}.")}
        values.update(layer.values)
        sources.update(layer.sources)
    return Layered(values, sources)


def config_path(spec: Spec, ns: argparse.Namespace, environ: Mapping[str, str]) -> Path | None:
    """``--config``, else the ``...CONFIG`` variable, else the default file when it exists."""
    named = environ.get(spec.env_prefix + "CONFIG")
    path: Path | None = ns.config or (Path(named) if named else None)
    if path is None and spec.default_file.exists():
        path = spec.default_file
    return path


def layers(spec: Spec, ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Layered:
    """The file, the shared variables, the process's variables and the flags, merged."""
    environ = os.environ if environ is None else environ
    path = config_path(spec, ns, environ)
    file_layer = from_file(spec, path) if path else Layered({}, {})
    return merge(file_layer, from_shared_env(spec, environ), from_env(spec, environ), from_flags(spec, ns))


def source_of(path: KeyPath, sources: Mapping[str, str]) -> str | None:
    """The most precise place a key's value came from: its entry's own line, else its key's."""
    if not path:
        return None
    return sources.get(dotted(path)) or sources.get(str(path[0]))


def cite(text: str, sources: Mapping[str, str], keys: list[str], *, default: str) -> str:
    """A rule across keys (``reconnect_base (50) must not exceed reconnect_max (30)``) with where
    each key it names came from; ``default`` words a key left at its default."""
    named = [k for k in keys if re.search(rf"\b{k}\b", text)]
    where = "; ".join(f"{k} from {sources[k]}" if k in sources else f"{k} {default}" for k in named)
    return f"{text} ({where})" if where else text


def structure(spec: Spec, layered: Layered) -> Any:
    """The config from merged values; every problem is a line naming the key and its source, and
    all of them are one :class:`ConfigError`."""
    known = spec.keys()
    unknown = sorted(set(layered.values) - set(known))
    if unknown:
        raise config_error(
            [
                f"{k} ({f'from {layered.sources[k]}' if k in layered.sources else 'config'}): unknown "
                f"setting; {_hint(k, known)}known: {', '.join(known)}"
                for k in unknown
            ],
            spec.what,
        )
    try:
        return converter(text=spec.text).structure(layered.values, spec.config)
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        lines = []
        for path, message in problems(exc):
            key = str(path[0]) if path else ""
            if not path:  # a rule across keys: its words name them
                lines.append(cite(message, layered.sources, known, default=spec.unset))
                continue
            if key in spec.settings and message == "required field missing":
                lines.append(
                    f"{key}: required, and not set (give {spec.flag(key)}, {spec.variable(key)} or "
                    f"{key} = ... in the file)"
                )
                continue
            if key in spec.settings and spec.settings[key].secret and ", got " in message:
                message = message.partition(", got ")[0] + ", got (hidden)"
            lines.append(spec.describe(path, message, layered.sources))
        raise config_error(lines, spec.what) from exc
