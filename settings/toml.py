"""TOML config files: read with :mod:`tomllib`, and the line of every key found in the text, so
that an error names ``llmgw.toml line 7`` rather than only the file (tomllib keeps no positions)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from settings.problems import ConfigError, KeyPath

_BARE_KEY = r"[A-Za-z0-9_-]+"
_ONE_KEY = rf"(?:{_BARE_KEY}|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_DOTTED_KEY = rf"{_ONE_KEY}(?:[ \t]*\.[ \t]*{_ONE_KEY})*"
_TABLE_HEADER = re.compile(rf"[ \t]*(\[\[?)[ \t]*({_DOTTED_KEY})[ \t]*\]\]?[ \t]*(?:#.*)?")
_KEY_VALUE = re.compile(rf"[ \t]*({_DOTTED_KEY})[ \t]*=")


def read_text(path: Path) -> str:
    """The config file's text, or a ConfigError that names the file and why it cannot be read."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{path}: cannot read the config file: {reason}") from exc


def parse(text: str, source: str) -> dict[str, Any]:
    """TOML text as plain data, or a ConfigError naming ``source`` and tomllib's line and column."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc


def _key_parts(dotted: str) -> list[str]:
    parts = []
    for part in re.findall(_ONE_KEY, dotted):
        if part[:1] == '"':
            part = tomllib.loads(f"k = {part}")["k"]
        elif part[:1] == "'":
            part = part[1:-1]
        parts.append(part)
    return parts


def key_lines(text: str) -> dict[KeyPath, int]:
    """The line of every table header and key in TOML text, by key path (array-of-table entries
    counted, ``[models.gpus]`` under the latest ``[[models]]``). Best effort by design: the text
    has already parsed, so this only needs to find lines, and a key it misses falls back to its
    table's line. Keys inside inline tables resolve to the line of the key holding the table."""
    lines: dict[KeyPath, int] = {}
    arrays: dict[KeyPath, int] = {}  # array-of-tables path -> index of its latest entry
    table: KeyPath = ()
    closing = ""  # the quotes that end the multi-line string being skipped
    for number, raw in enumerate(text.splitlines(), 1):
        if closing:
            if raw.count(closing) % 2:
                closing = ""
            continue
        header = _TABLE_HEADER.fullmatch(raw)
        if header:
            parts = _key_parts(header.group(2))
            path: KeyPath = ()
            for i, part in enumerate(parts):
                path = (*path, part)
                if path in arrays and (header.group(1) == "[" or i < len(parts) - 1):
                    path = (*path, arrays[path])
            if header.group(1) == "[[":
                arrays[path] = arrays.get(path, -1) + 1
                path = (*path, arrays[path])
            table = path
            lines.setdefault(table, number)
            continue
        assignment = _KEY_VALUE.match(raw)
        if assignment:
            lines.setdefault((*table, *_key_parts(assignment.group(1))), number)
            rest = raw[assignment.end() :]
            closing = next((q for q in ('"""', "'''") if rest.count(q) % 2), "")
    return lines


def nearest_line(lines: dict[KeyPath, int], path: KeyPath) -> int | None:
    """The key's own line, else the line of the nearest enclosing table or key that is written,
    else the first line written under the key (``[[fabrics]]``, ``a.b = 1`` for ``a``)."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    under = [line for key, line in lines.items() if key[: len(path)] == path]
    return min(under) if under and path else None


def line_of(text: str, *path: str | int, exact: bool = False) -> int | None:
    """The line of the key at ``path`` in TOML text (or of its nearest written parent, unless
    ``exact``), for problems found after parsing, such as an unwritable ``state_dir``; None when
    it is not written (``exact``: also when it is written only inside an inline table)."""
    lines = key_lines(text)
    return lines.get(path) if exact else nearest_line(lines, path)
