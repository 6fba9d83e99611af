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
come from another module's runtime registry (the tool-call and reasoning parsers up to 0.5.10)
cannot be evaluated this way and are recorded as "any string" (``choices: null``): the check is then
permissive for those two options, never wrong. (0.5.23 reads them from dependency-free name lists,
``parser/reasoning_parser_names.py`` and ``function_call/parser_names.py``, which the literal scan
reaches.)

Options whose action is SGLang's ``DeprecatedAction`` (it raises as soon as the flag is given) are
left out of the file, so a check reports them as unknown, which is what the engine does to them.

Two layouts. Up to 0.5.10 every option is an ``add_argument`` call in ``add_cli_args`` itself. From
0.5.23 (``sglang/srt/arg_groups/`` present) the options are declared as annotated msgspec Structs in
``sglang.srt.arg_groups.fields`` (choice lists in ``arg_groups/choices.py``, custom actions in
``arg_groups/argparse_actions.py``), merged by ``collect_input_fields`` into one ``msgspec.defstruct``
and turned into ``add_argument`` calls by ``arg_groups.arg_utils.add_cli_args_from_dataclass``, which
reads each field's annotation (``Literal`` choices, ``List`` nargs, ``bool`` switches). Those modules
(:data:`REAL_MODULES`, pure Python over the standard library and msgspec) are loaded for real from
the unpacked release, and msgspec is the installed one (:data:`REAL_PACKAGES`, which ``nox -s flags``
installs); the rest of SGLang and every other dependency is stubbed as before. A function of a
stubbed module (``json_list_type``, ``human_readable_int``) is a *truthy* stub, because the new code
picks a field's converter with ``arg.type_parser or <type from the annotation>``.
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

#: What ``nox -s flags`` regenerates: the release the adapter was first written against, the last
#: one that declares its options in ``server_args.py`` itself, and 0.5.23 (issue 15; wheel only,
#: options in ``sglang.srt.arg_groups``).
VERSIONS = ("0.5.4", "0.5.10.post1", "0.5.23")
PROGRAM = "python -m sglang.launch_server"
SERVER_ARGS = Path("sglang/srt/server_args.py")
#: Present from 0.5.23: the options are declared in this package instead of in ``server_args.py``.
ARG_GROUPS = Path("sglang/srt/arg_groups")

#: SGLang's own modules run for real in the arg_groups layout (a name covers its submodules): what
#: ``add_cli_args`` needs to build the parser, each importing only the standard library, msgspec
#: and one another. ``cuda_graph_config`` holds ``Backend.ALL`` (a class attribute, out of reach of
#: the literal scan), ``kv_canary.consts`` the ``RealKvHashMode`` enum behind --kv-canary-real-data.
#: The resolution hooks beside them in ``arg_groups`` (overrides, validation ...) run after parsing
#: and import half of SGLang: stubbed.
REAL_MODULES = (
    "sglang.srt.arg_groups.arg_utils",
    "sglang.srt.arg_groups.argparse_actions",
    "sglang.srt.arg_groups.choices",
    "sglang.srt.arg_groups.field_order",
    "sglang.srt.arg_groups.fields",
    "sglang.srt.model_executor.cuda_graph_config",
    "sglang.kernels.ops.kv_canary.consts",
)

#: Installed third-party packages imported for real in the arg_groups layout: msgspec's Structs
#: carry the field declarations and ``msgspec.defstruct`` builds ``ServerArgs``.
REAL_PACKAGES = frozenset({"msgspec"})

#: SGLang's own argparse ``type=`` helpers (``sglang/srt/utils/common.py``, and from 0.5.23
#: ``model_executor/cuda_graph_config.py``), by name, and the data-file type each parses.
_HELPER_TYPES = {"json_list_type": "json", "nullable_str": "str", "parse_cuda_graph_config_arg": "json"}


class _Stub:
    """An inert placeholder for anything imported from a stubbed module: callable, indexable,
    iterable (empty), falsy, and named after what it stands for."""

    def __init__(self, name: str, truthy: bool = False) -> None:
        self._stub_name = name
        self._truthy = truthy

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
        # A function stands in as true (``type_parser or str`` keeps it); any other value as false.
        return self._truthy

    def __add__(self, other: object) -> _Stub:
        return self

    __radd__ = __add__
    __or__ = __add__
    __ror__ = __add__

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)


def _module_facts(path: Path, root: Path, seen: set[Path]) -> tuple[dict[str, object], set[str]]:
    """Module-level ``NAME = <literal>`` assignments and ``def`` names of a source file, following
    its ``from X import *`` re-exports inside ``root`` (how ``sglang.srt.utils`` exposes ``common``)."""
    if path in seen or not path.is_file():
        return {}, set()
    seen.add(path)
    found: dict[str, object] = {}
    functions: set[str] = set()
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
                more, funcs = _module_facts(candidate, root, seen)
                found.update(more)
                functions |= funcs
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.add(node.name)
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return found, functions


class _StubModule(types.ModuleType):
    def __init__(self, name: str, constants: dict[str, object], functions: set[str]) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__dict__.update(constants)
        self._stub_functions = functions

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}", truthy=attr in self._stub_functions)


def _is_real(fullname: str, real: Sequence[str]) -> bool:
    return any(fullname == name or fullname.startswith(name + ".") for name in real)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import outside the standard library with a stub module, except the modules of
    ``real`` (loaded from their source under ``root``) and the installed :data:`REAL_PACKAGES`."""

    def __init__(self, root: Path, real: Sequence[str] = ()) -> None:
        self.root = root
        self.real = tuple(real)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".")[0]
        if top in sys.stdlib_module_names or (self.real and top in REAL_PACKAGES):
            return None
        if _is_real(fullname, self.real):
            base = self.root.joinpath(*fullname.split("."))
            if (base / "__init__.py").is_file():
                return importlib.util.spec_from_file_location(
                    fullname, base / "__init__.py", submodule_search_locations=[str(base)]
                )
            if base.with_suffix(".py").is_file():
                return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        target = self.root.joinpath(*spec.name.split("."))
        constants: dict[str, object] = {}
        functions: set[str] = set()
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            more, funcs = _module_facts(candidate, self.root, set())
            constants.update(more)
            functions |= funcs
        return _StubModule(spec.name, constants, functions)

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
    real = REAL_MODULES if (source_dir / ARG_GROUPS).is_dir() else ()
    finder = _StubFinder(source_dir, real)
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
        try:
            spec.loader.exec_module(module)
        except ModuleNotFoundError as exc:
            if exc.name in REAL_PACKAGES:
                raise core.ExtractError(
                    f"{path}: SGLang's arg_groups need {exc.name} installed in this environment "
                    f"(nox -s flags installs it; or pip install {exc.name})"
                ) from exc
            raise
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


#: Platform tags a wheel-only release is fetched for (pure Python files inside, whatever the tag).
WHEEL_PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(17, 41))


def fetch(version: str, workdir: Path) -> tuple[Path, str]:
    """The sdist of SGLang ``version`` (pure Python, no dependencies), or its wheel when it has no
    sdist, its ``.py`` files unpacked; (the folder holding ``sglang/``, what was fetched)."""
    try:
        archive = core.pip_download(f"sglang=={version}", workdir / "download")
    except core.ExtractError:
        # Newer releases ship wheels only; their .py files are the same source.
        archive = core.pip_download(
            f"sglang=={version}", workdir / "download", wheel_platforms=WHEEL_PLATFORMS, python_version="3.11"
        )
    dest = workdir / "src"
    core.unpack(archive, dest, keep=lambda name: name.endswith(".py") and "sglang/" in name)
    roots = sorted(p.parent.parent.parent for p in dest.glob(f"**/{SERVER_ARGS}"))
    if len(roots) != 1:
        raise core.ExtractError(f"{archive.name}: expected one {SERVER_ARGS}, found {len(roots)}")
    return roots[0], f"{archive.name} from PyPI"


def extract(source_dir: Path, version: str) -> dict[str, Any]:
    """The format-1 document for SGLang ``version`` from its unpacked source at ``source_dir``."""
    options, positionals = options_of(build_parser(source_dir))
    if (source_dir / ARG_GROUPS).is_dir():
        source = (
            f"{SERVER_ARGS}, {ARG_GROUPS}/: ServerArgs.add_cli_args run on argparse, with "
            f"{', '.join(REAL_MODULES)} and {', '.join(sorted(REAL_PACKAGES))} real, "
            "other imports outside the standard library stubbed"
        )
    else:
        source = f"{SERVER_ARGS}: ServerArgs.add_cli_args run on argparse, imports outside the standard library stubbed"
    return core.document(
        engine=ENGINE,
        version=version,
        program=PROGRAM,
        source=source,
        positionals=positionals,
        options=options,
    )
