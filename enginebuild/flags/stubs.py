"""Import an engine's own Python package with its heavy dependencies replaced by inert stubs.

An engine's command line is defined by its own code (vLLM derives most of its options from config
dataclasses at import time), and the only faithful way to know it is to run that code. Running it
for real would need torch, CUDA and a few gigabytes of dependencies; none of them decides what an
option is called, what it takes or which choices it has. So the extractor runs the engine's code
in a child interpreter where every import outside a short allow-list (the standard library, the
engine's own pure-Python source, pydantic, which its config dataclasses are built on, and
typing/packaging helpers) is a stub: a module whose every attribute is ``Stub``, a class that can
be called, subclassed, subscripted, iterated (empty), compared and used as a decorator.

A stub can leak into what we record (a ``choices`` list computed from a stubbed library); the
caller checks every value it records with :func:`is_stub` and refuses to write such a file, so a
leak is an error at extraction time, never a wrong data file.

Only this child process is ever touched: :func:`install` changes ``sys.meta_path`` and
``sys.path`` for good, which is why the extractors run it through ``python -m``.
"""

from __future__ import annotations

import abc
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import tempfile
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

#: Real packages the engines' option code needs to behave (pydantic builds vLLM's config
#: dataclasses; their defaults and validators run while the parser is built).
REAL = frozenset(
    {
        "pydantic",
        "pydantic_core",
        "typing_extensions",
        "annotated_types",
        "typing_inspection",
        "packaging",
    }
)

#: Dependencies whose standard-library counterpart does what the engines ask of them at import
#: time (vLLM compiles and matches its patterns with ``regex``; a stub would match nothing).
ALIASES = {"regex": "re"}


def _stub_attribute(name: str) -> Any:
    """Any attribute of a stub (an instance, the class, a module) is the stub, except the dunder
    names: Python's own protocols (copy, pickle, ``__wrapped__`` probes) must see them absent."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return Stub


class _Base:
    """What a class deriving from a stub inherits: accepts any keyword at subclassing (msgspec's
    ``Struct, omit_defaults=True``), any constructor arguments, and answers every attribute."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return _stub_attribute(name)


class _StubMeta(abc.ABCMeta):
    """Makes the class ``Stub`` itself behave as any value a stubbed module could hand out."""

    def __getattr__(cls, name: str) -> Any:
        return _stub_attribute(name)

    def __getitem__(cls, item: Any) -> Any:
        return Stub

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # Used as a bare decorator (``@torch.compile``): hand back what it decorates.
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return Stub

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False

    def __len__(cls) -> int:
        return 0

    def __int__(cls) -> int:
        return 0

    def __index__(cls) -> int:
        return 0

    def __float__(cls) -> float:
        return 0.0

    def __contains__(cls, item: Any) -> bool:
        return False

    def __enter__(cls) -> Any:
        return Stub

    def __exit__(cls, *args: Any) -> Literal[False]:
        return False

    def __str__(cls) -> str:
        return "stub"

    def __fspath__(cls) -> str:
        return "/nonexistent-stub"

    def __lt__(cls, other: Any) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(cls) -> int:
        return id(cls)

    def __eq__(cls, other: object) -> bool:
        return cls is other


def _any(*args: Any, **kwargs: Any) -> Any:
    return Stub


for _name in (
    "add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow and rand "
    "or ror xor rxor neg pos invert matmul rmatmul lshift rlshift rshift rrshift"
).split():
    setattr(_StubMeta, f"__{_name}__", _any)


class Stub(_Base, metaclass=_StubMeta):
    """Every attribute of every stubbed module."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # A field typed with a stubbed class (``torch.dtype``) validates anything.
        from pydantic_core import core_schema

        return core_schema.any_schema()


def is_stub(value: Any) -> bool:
    """Whether a stub hides anywhere in value (a list, tuple, dict or a plain value)."""
    if isinstance(value, type) and issubclass(value, _Base):
        return True
    if isinstance(value, _Base):
        return True
    if isinstance(value, Mapping):
        return any(is_stub(k) or is_stub(v) for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return any(is_stub(v) for v in value)
    return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return _stub_attribute(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on sys.meta_path: stubs every module that is not the standard library, the engine's
    own source or REAL; last resort for the engine's compiled extensions (absent from the tree)."""

    def __init__(self, own: str, compiled: frozenset[str], shims: Mapping[str, Any]) -> None:
        self.own = own
        self.compiled = compiled
        self.shims = shims
        self.stubbed: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top in sys.stdlib_module_names or top in REAL:
            return None
        if top == self.own and fullname not in self.compiled:
            return None
        self.stubbed.add(top if top != self.own else fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__file__ = f"/nonexistent-stub/{spec.name.replace('.', '/')}/__init__.py"
        for dotted, value in self.shims.items():
            owner, _, attr = dotted.rpartition(".")
            if owner == spec.name:
                setattr(module, attr, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(
    source_dir: str,
    own: str,
    *,
    compiled: Iterable[str] = (),
    versions: Mapping[str, str] | None = None,
    shims: Mapping[str, Any] | None = None,
) -> set[str]:
    """Put source_dir first on sys.path and stub everything else; returns the live set of stubbed
    top-level names (for the data file's notes).

    ``compiled``: the engine's extension modules (``vllm._C``), stubbed since only their Python
    siblings were unpacked. ``versions``: package metadata to fake (``{"torch": "2.10.0"}``) for
    code that asks ``importlib.metadata.version`` at import time. ``shims``: attributes of
    stubbed modules that must be real values (``{"torch.library.infer_schema": f}``), for import-time
    code that parses what a stub would return.
    """
    sys.path.insert(0, source_dir)
    for name, stand_in in ALIASES.items():
        sys.modules.setdefault(name, importlib.import_module(stand_in))
    finder = _Finder(own, frozenset(compiled), dict(shims or {}))
    sys.meta_path.insert(0, finder)
    if versions:
        fake = tempfile.mkdtemp(prefix="llmgw-flags-dists-")
        for name, version in versions.items():
            info = os.path.join(fake, f"{name}-{version}.dist-info")
            os.makedirs(info)
            with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
                f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        sys.path.append(fake)
    return finder.stubbed
