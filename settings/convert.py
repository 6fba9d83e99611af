"""Values into their field's type: the cattrs converter every config is structured with, and the
parsers of the text a flag or an environment variable gives.

The converter is strict (``replicas = "3"`` in a file is refused, not read as 3: a file has types,
and a quoted number is a mistake worth naming) except where a process asks for ``text=True``: the
agent structures its flags' and variables' text with it, so numbers may be written as text there.
A list must be a list: a string is never taken as the list of its characters, and a table
(an attrs class) must be a table."""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory, list_structure_factory
from cattrs.gen import make_dict_structure_fn

#: The words ``true``/``false`` and their usual spellings, as flags and variables write them.
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def converter(*, text: bool = False) -> cattrs.Converter:
    """A cattrs converter that refuses unknown keys and values of the wrong type with "expected
    ..., got ..."; ``text``: ints and floats may also come as text (``float("soon")`` fails with
    cattrs' words, "invalid value for type, expected float")."""
    conv = cattrs.Converter(forbid_extra_keys=True)

    def strict(kind: type, test: Callable[[Any], bool], what: str, make: Callable[[Any], Any]) -> None:
        def hook(value: Any, _: type) -> Any:
            if not test(value):
                raise ValueError(f"expected {what}, got {value!r}")
            return make(value)

        conv.register_structure_hook(kind, hook)

    def integral(value: Any) -> bool:
        if isinstance(value, bool):
            return False
        if text and isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) or (text and isinstance(value, str))

    def numeric(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, int | float | (str if text else float))

    strict(str, lambda v: isinstance(v, str), "a string", str)
    strict(int, integral, "an integer", int)
    strict(float, numeric, "a number", float)
    strict(bool, lambda v: isinstance(v, bool), "true or false", bool)
    strict(Path, lambda v: isinstance(v, Path) or (isinstance(v, str) and bool(v)), "a file path", Path)

    def is_list(type_: Any) -> bool:
        origin, args = typing.get_origin(type_), typing.get_args(type_)
        return origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis)

    def list_factory(type_: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
        inner = (
            list_structure_factory if typing.get_origin(type_) is list else homogenous_tuple_structure_factory
        )(type_, conv)

        def hook(value: Any, t: Any) -> Any:
            if not isinstance(value, list | tuple):
                raise ValueError(f"expected a list, got {value!r}")
            return inner(value, t)

        return hook

    conv.register_structure_hook_factory(is_list, list_factory)

    def table_factory(type_: Any, conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
        # cattrs' own hook would index a number and report "expected <ClassName>", a name from
        # the code rather than from the file.
        inner = make_dict_structure_fn(type_, conv)

        def hook(value: Any, t: Any) -> Any:
            if not isinstance(value, Mapping):
                raise ValueError(f"expected a table, got {value!r}")
            return inner(value, t)

        return hook

    conv.register_structure_hook_factory(attrs.has, table_factory)
    return conv


# -- text: what a flag or an environment variable gives ------------------------------------------


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, in any case)."""
    try:
        return _BOOL_WORDS[text.strip().lower()]
    except KeyError:
        raise ValueError(f"expected true or false, got {text!r}") from None


def parse_int(text: str) -> int:
    """A whole number of digits (no sign: every integer setting counts something)."""
    if not re.fullmatch(r"\s*[0-9]+\s*", text):
        raise ValueError(f"expected a whole number, got {text!r}")
    return int(text)


def parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def parse_path(text: str) -> Path:
    if not text:
        raise ValueError(f"expected a file path, got {text!r}")
    return Path(text)


def parse_list(text: str) -> tuple[str, ...]:
    """``a,b`` -> ("a", "b"): a list setting's variable (its flag repeats instead)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def text_parser(type_text: str) -> Callable[[str], Any] | None:
    """The parser of a field's text by its annotation as written (``from __future__ import
    annotations`` keeps annotations as text); None: the text is the value."""
    return {
        "bool": parse_bool,
        "int": parse_int,
        "float": parse_float,
        "Path | None": parse_path,
        "Path": parse_path,
        "tuple[str, ...]": parse_list,
    }.get(type_text)
