"""SGLang's ``python -m sglang.launch_server`` options, from SGLang's own parser.

How: SGLang builds its whole command line in one function, ``ServerArgs.add_cli_args(parser)``
(``sglang/srt/server_args.py``), and parses with a plain ``argparse.ArgumentParser``
(``prepare_server_args``). We *run* that function on a fresh parser and read argparse's own
actions back, rather than walking the source with ``ast``: the calls carry argparse semantics
(aliases, ``store_true``, ``nargs``, custom actions, choice lists concatenated at run time) that an
``ast`` walk would have to re-implement, and running it gives exactly the parser SGLang gives its
users. ``server_args.py`` imports torch, transformers and most of SGLang at module level, so it is
loaded with every import outside the standard library replaced by a stub module; a stub exposes
the literal constants of the real module's source (``SUPPORTED_LORA_TARGET_MODULES`` ...), so
choice lists built from them are real; anything else is an inert placeholder. Choice lists that
come from another module's runtime registry (the tool-call and reasoning parsers) cannot be
evaluated this way and are recorded as "any string" (``choices: null``): the check is then
permissive for those two options, never wrong.

Options whose action is SGLang's ``DeprecatedAction`` (it raises as soon as the flag is given) are
left out of the file, so a check reports them as unknown, which is what the engine does to them.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from enginebuild.flags import core

ENGINE = "sglang"

#: What ``nox -s flags`` regenerates: the release the adapter was first written against and the
#: newest on the package index when this was written (0.5.23, named in issue 15, is not published).
VERSIONS = ("0.5.4", "0.5.10.post1")
PROGRAM = "python -m sglang.launch_server"
SERVER_ARGS = Path("sglang/srt/server_args.py")

#: SGLang's own argparse ``type=`` helpers (``sglang/srt/utils/common.py``), by name, and the
#: data-file type each parses.
_HELPER_TYPES = {"json_list_type": "json", "nullable_str": "str"}


class _Stub:
    """An inert placeholder for anything imported from a stubbed module: callable, indexable,
    iterable (empty), falsy, and named after what it stands for."""

    def __init__(self, name: str) -> None:
        self._stub_name = name

    def __getattr__(self, attr: str) -> _Stub:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._stub_name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return _Stub(f"{self._stub_name}()")

    def __getitem__(self, key: object) -> _Stub:
        return _Stub(f"{self._stub_name}[]")

    def __iter__(self) -> Iterator[object]:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __add__(self, other: object) -> _Stub:
        return self

    __radd__ = __add__
    __or__ = __add__
    __ror__ = __add__

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)


def _literal_constants(path: Path, root: Path, seen: set[Path]) -> dict[str, object]:
    """Module-level ``NAME = <literal>`` assignments of a source file, following its
    ``from X import *`` re-exports inside ``root`` (how ``sglang.srt.utils`` exposes ``common``)."""
    if path in seen or not path.is_file():
        return {}
    seen.add(path)
    found: dict[str, object] = {}
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) and node.module:
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                target = base.joinpath(*node.module.split("."))
            else:
                target = root.joinpath(*node.module.split("."))
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                found.update(_literal_constants(candidate, root, seen))
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return found


class _StubModule(types.ModuleType):
    def __init__(self, name: str, constants: dict[str, object]) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__dict__.update(constants)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import outside the standard library with a stub module."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in sys.stdlib_module_names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        target = self.root.joinpath(*spec.name.split("."))
        constants: dict[str, object] = {}
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            constants.update(_literal_constants(candidate, self.root, set()))
        return _StubModule(spec.name, constants)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def build_parser(source_dir: Path) -> argparse.ArgumentParser:
    """SGLang's own parser: ``ServerArgs.add_cli_args`` run on a fresh ``ArgumentParser``, with
    ``server_args.py`` loaded from ``source_dir`` (the unpacked sdist's package root, the folder
    holding ``sglang/``) and its non-stdlib imports stubbed for the duration of the load."""
    path = source_dir / SERVER_ARGS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not found; SOURCE_DIR must hold the sglang package (sglang/srt/...)"
        )
    finder = _StubFinder(source_dir)
    saved = dict(sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        # Drop any real (installed) copies so the stubs answer, then restore everything after.
        for name in list(sys.modules):
            if name.split(".")[0] not in sys.stdlib_module_names and name != "__main__":
                del sys.modules[name]
        spec = importlib.util.spec_from_file_location("_llmgw_sglang_server_args", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        parser = argparse.ArgumentParser(prog=PROGRAM)
        module.ServerArgs.add_cli_args(parser)
        return parser
    finally:
        sys.meta_path.remove(finder)
        sys.modules.clear()
        sys.modules.update(saved)


def _type_name(action: argparse.Action) -> str:
    kind = action.type
    if kind is None:
        return "bool" if action.nargs == 0 else "str"
    if kind in (int, float, str):
        return kind.__name__
    if kind is json.loads:
        return "json"
    name = getattr(kind, "_stub_name", None) or getattr(kind, "__name__", "")
    return _HELPER_TYPES.get(str(name).rsplit(".", 1)[-1], "str")


def _choices(action: argparse.Action) -> list[str] | None:
    choices = action.choices
    if choices is None or isinstance(choices, _Stub):
        return None
    # A set (SGLang's SAMPLING_BACKEND_CHOICES is one) has no order of its own: sorted, so the
    # file does not change with the process's string hash seed.
    values = (
        sorted(str(c) for c in choices) if isinstance(choices, set | frozenset) else [str(c) for c in choices]
    )
    # A list built from a stub (``list(Registry.keys())``) comes out empty: "unknown", not "none".
    return values or None


def _nargs(action: argparse.Action) -> str | None:
    if action.nargs in ("?", "+", "*"):
        return str(action.nargs)
    if isinstance(action.nargs, int) and action.nargs > 1:
        return "+"
    return None


def options_of(parser: argparse.ArgumentParser) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(options, positionals) in the data-file format, from argparse's own actions."""
    options: list[dict[str, Any]] = []
    positionals: list[dict[str, Any]] = []
    for action in parser._actions:
        if type(action).__name__ == "DeprecatedAction":
            continue
        if not action.option_strings:
            positionals.append({"name": action.dest, "nargs": _nargs(action)})
            continue
        switch = action.nargs == 0
        options.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "takes_value": not switch,
                "type": "bool" if switch else _type_name(action),
                "nargs": None if switch else _nargs(action),
                "choices": None if switch else _choices(action),
                "deprecated_choices": {},
            }
        )
    return options, positionals


def fetch(version: str, workdir: Path) -> tuple[Path, str]:
    """The sdist of SGLang ``version`` (pure Python, no dependencies), its ``.py`` files unpacked;
    (the folder holding ``sglang/``, what was fetched)."""
    archive = core.pip_download(f"sglang=={version}", workdir / "download")
    dest = workdir / "src"
    core.unpack(archive, dest, keep=lambda name: name.endswith(".py") and "sglang/" in name)
    roots = sorted(p.parent.parent.parent for p in dest.glob(f"**/{SERVER_ARGS}"))
    if len(roots) != 1:
        raise core.ExtractError(f"{archive.name}: expected one {SERVER_ARGS}, found {len(roots)}")
    return roots[0], f"{archive.name} from PyPI"


def extract(source_dir: Path, version: str) -> dict[str, Any]:
    """The format-1 document for SGLang ``version`` from its unpacked source at ``source_dir``."""
    options, positionals = options_of(build_parser(source_dir))
    return core.document(
        engine=ENGINE,
        version=version,
        program=PROGRAM,
        source=f"{SERVER_ARGS}: ServerArgs.add_cli_args run on argparse, imports outside the standard library stubbed",
        positionals=positionals,
        options=options,
    )
