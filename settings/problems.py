"""Configuration errors as values a person can act on: the one :class:`ConfigError`, the
:class:`FieldProblem` a validator raises with the key it is about, and the walk that turns a
cattrs error tree into one ``(key path, message)`` per leaf.

Every process words its lines itself (where its values come from differs: the agent's and the
router's from flags, variables and a file, the control plane's from a file only), but all of
them find the key of a problem the same way, here."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import cattrs
from cattrs.errors import AttributeValidationNote, ForbiddenExtraKeysError
from cattrs.v import format_exception

#: A key's place in a config: ``("models", 1, "gpus", "count")`` is ``models[1].gpus.count``.
KeyPath = tuple[str | int, ...]

_BARE_KEY = r"[A-Za-z0-9_-]+"


class ConfigError(Exception):
    """A configuration a person must fix; the message names the key, where its value came from
    (a flag, a variable, or a file and line) and what was expected. Every llmgw process prints it
    as is and exits with status 2. One problem is one line; several are one line each under a
    heading (:func:`config_error`)."""


class FieldProblem(ValueError):
    """A rule one key breaks, raised by a validator with the key's path relative to its class.

    cattrs attributes an exception from ``__init__`` (where attrs runs validators) to the whole
    class, which would report ``lost_after = -8.0`` at the ``[liveness]`` header, or a flag's
    value with no source at all; carrying the path lets the error name the key's own line, flag
    or variable."""

    def __init__(self, path: str | KeyPath, message: str) -> None:
        super().__init__(message)
        self.path: KeyPath = (path,) if isinstance(path, str) else tuple(path)

    @property
    def key(self) -> str:
        """The top-level key the problem is about."""
        return str(self.path[0]) if self.path else ""


def dotted(path: KeyPath) -> str:
    """``("models", 1, "gpus", "count")`` -> ``models[1].gpus.count`` (a key that is not bare
    TOML, such as ``"llama.cpp"``, in quotes)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part if re.fullmatch(_BARE_KEY, part) else f'"{part}"'
            out += f".{name}" if out else name
    return out


def explain(err: BaseException, type_: Any) -> str:
    """What one leaf of a cattrs error says: a validator's or hook's own words, else cattrs'
    ("invalid value for type, expected float"), which say more than Python's ``float()``."""
    if (
        isinstance(err, ValueError)
        and str(err)
        and not str(err).startswith(("could not convert", "invalid literal"))
    ):
        return str(err)
    if typing.get_origin(type_) is Literal:
        return f"expected one of {', '.join(map(str, typing.get_args(type_)))}"
    return format_exception(err, type_)


def problems(exc: BaseException, path: KeyPath = (), type_: Any = None) -> Iterator[tuple[KeyPath, str]]:
    """Each leaf of a cattrs error tree (or a lone exception) with the key path it belongs to.
    A leaf raised by the class as a whole (a rule across keys, not a :class:`FieldProblem`) has
    the class's path; its words name the keys."""
    if isinstance(exc, ForbiddenExtraKeysError):
        for extra in sorted(exc.extra_fields):
            yield (*path, extra), "unknown key"
    elif isinstance(exc, cattrs.ClassValidationError | cattrs.IterableValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            step = note.name if isinstance(note, AttributeValidationNote) else note.index
            yield from problems(sub, (*path, step), note.type)
        for sub in without:
            yield from problems(sub, path)
    elif isinstance(exc, FieldProblem):
        yield (*path, *exc.path), str(exc)
    elif isinstance(exc, KeyError) and not isinstance(exc, cattrs.BaseValidationError):
        yield path, "required field missing"
    else:
        yield path, explain(exc, type_)


def config_error(lines: Sequence[str], what: str) -> ConfigError:
    """One problem as its line; several as one line each under ``N problems in WHAT:``."""
    if len(lines) == 1:
        return ConfigError(lines[0])
    return ConfigError("\n  ".join([f"{len(lines)} problems in {what}:", *lines]))
