"""TensorRT-LLM's ``trtllm-serve serve`` options, from the click decorators of its source.

How: ``tensorrt_llm/commands/serve.py`` declares the command with ``@click.command("serve")``,
``@click.argument`` and ``@click.option`` decorators on ``def serve``. The module imports torch and
the CUDA runtime at import time, so it cannot be loaded here; the decorators are plain literal calls,
so this walks them with ``ast`` and applies click's own rules: names starting with ``-`` are flags,
a bare identifier is the destination (else click derives it from the longest flag), ``is_flag=True``
is a switch, ``type=int|float|str`` maps as is, ``click.Choice([...])`` and TensorRT-LLM's
``ChoiceWithAlias([...], {alias: value})`` give choices (aliases included, since click accepts
them), ``click.Path`` is a string, ``multiple=True`` a repeatable option. A choice list that is
computed at run time from another module's registry (``severity_map.keys()``,
``ReasoningParserFactory.parsers.keys()``) is recorded as "any string" (``choices: null``) unless
it is a literal dict in the same file: permissive, never wrong.

Source: ``fetch`` downloads the release's wheel without dependencies and unpacks only
``serve.py``; the wheels are published on NVIDIA's package index, which pip reaches when the machine
is configured for it (the sdist on PyPI is a ``wheel-stub`` that fetches the same wheel). Where it is
not, ``LLMGW_TRTLLM_SOURCE`` names a source tree of the release (a checkout of its tag: the folder
holding ``tensorrt_llm/``) to read instead.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

from enginebuild.flags import core

ENGINE = "trtllm"

#: What ``nox -s flags`` regenerates: the newest release.
VERSIONS = ("1.2.1",)

#: A source tree to read instead of downloading the wheel.
SOURCE_ENV = "LLMGW_TRTLLM_SOURCE"

#: Platforms the release publishes wheels for; any one has the same Python files.
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_28_aarch64", "linux_x86_64", "linux_aarch64")
PROGRAM = "trtllm-serve serve"
SERVE = Path("tensorrt_llm/commands/serve.py")
COMMAND = "serve"

_TYPES = {"int": "int", "float": "float", "str": "str", "bool": "bool"}


def _call_name(node: ast.expr) -> str:
    """``click.option`` -> "option"; ``ChoiceWithAlias`` -> "ChoiceWithAlias"."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _literal_dicts(tree: ast.Module) -> dict[str, dict[str, object]]:
    found: dict[str, dict[str, object]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, dict):
                found[node.targets[0].id] = value
    return found


def _choice_values(node: ast.expr, dicts: dict[str, dict[str, object]]) -> list[str] | None:
    """A literal list/tuple, or ``NAME.keys()`` of a literal dict in the file; else None."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        value = None
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "keys"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in dicts
    ):
        return [str(k) for k in dicts[node.func.value.id]]
    return None


def _type_of(node: ast.expr | None, dicts: dict[str, dict[str, object]]) -> tuple[str, list[str] | None]:
    """(data-file type, choices) for a click ``type=`` argument."""
    if node is None:
        return "str", None
    if isinstance(node, ast.Name) and node.id in _TYPES:
        return _TYPES[node.id], None
    if isinstance(node, ast.Call):
        name = _call_name(node.func)
        if name in ("Choice", "ChoiceWithAlias") and node.args:
            choices = _choice_values(node.args[0], dicts)
            if choices is not None and name == "ChoiceWithAlias" and len(node.args) > 1:
                try:
                    aliases = ast.literal_eval(node.args[1])
                except ValueError:
                    aliases = {}
                choices = [*choices, *(str(a) for a in aliases)]
            return "str", choices
        if name == "IntRange":
            return "int", None
        if name == "FloatRange":
            return "float", None
    return "str", None


def _dest(names: list[str], flags: list[str]) -> str:
    if names:
        return names[0]
    longest = max(flags, key=lambda f: len(f.lstrip("-")))
    return longest.lstrip("-").replace("-", "_").lower()


def extract_source(
    text: str, filename: str = str(SERVE)
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(options, positionals) of the ``serve`` click command in ``text``."""
    tree = ast.parse(text, filename=filename)
    dicts = _literal_dicts(tree)
    func = next(
        (
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            and any(
                isinstance(d, ast.Call)
                and _call_name(d.func) == "command"
                and d.args
                and isinstance(d.args[0], ast.Constant)
                and d.args[0].value == COMMAND
                for d in node.decorator_list
            )
        ),
        None,
    )
    if func is None:
        raise ValueError(f"{filename}: no @click.command({COMMAND!r}) function found")
    options: list[dict[str, Any]] = []
    positionals: list[dict[str, Any]] = []
    # Decorators apply bottom-up, but click lists parameters top-down: keep source order.
    for deco in func.decorator_list:
        if not isinstance(deco, ast.Call):
            continue
        kind = _call_name(deco.func)
        strings = [a.value for a in deco.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        kwargs = {k.arg: k.value for k in deco.keywords if k.arg}
        if kind == "argument":
            nargs = kwargs.get("nargs")
            n = ast.literal_eval(nargs) if nargs is not None else 1
            positionals.append({"name": strings[0], "nargs": "*" if n == -1 else None})
            continue
        if kind != "option":
            continue
        flags = [s for s in strings if s.startswith("-")]
        names = [s for s in strings if not s.startswith("-")]
        is_flag = False
        if "is_flag" in kwargs:
            is_flag = bool(ast.literal_eval(kwargs["is_flag"]))
        if is_flag:
            kind_name, choices = "bool", None
        else:
            kind_name, choices = _type_of(kwargs.get("type"), dicts)
        options.append(
            {
                "flags": flags,
                "dest": _dest(names, flags),
                "takes_value": not is_flag,
                "type": kind_name,
                "nargs": None,
                "choices": choices,
                "deprecated_choices": {},
            }
        )
    # click adds --help to every command (it prints the usage and exits 0).
    options.append(
        {
            "flags": ["--help"],
            "dest": "help",
            "takes_value": False,
            "type": "bool",
            "nargs": None,
            "choices": None,
            "deprecated_choices": {},
        }
    )
    return options, positionals


def fetch(version: str, workdir: Path) -> tuple[Path, str]:
    """(the folder holding ``tensorrt_llm/``, what was read): ``$LLMGW_TRTLLM_SOURCE`` when set,
    else ``serve.py`` out of the release's wheel."""
    given = os.environ.get(SOURCE_ENV, "")
    if given:
        root = Path(given).expanduser()
        if not (root / SERVE).is_file():
            raise core.ExtractError(
                f"{SOURCE_ENV}={given}: no {SERVE} there; name the folder holding tensorrt_llm/"
            )
        return root, f"{SOURCE_ENV}={given}"
    try:
        wheel = core.pip_download(
            f"tensorrt-llm=={version}", workdir / "download", wheel_platforms=WHEEL_PLATFORMS
        )
    except core.ExtractError as exc:
        raise core.ExtractError(
            f"{exc}\nTensorRT-LLM wheels come from NVIDIA's package index (configure pip for it), "
            f"or set {SOURCE_ENV} to a source tree of the v{version} tag"
        ) from None
    dest = workdir / "src"
    core.unpack(wheel, dest, keep=lambda name: name == str(SERVE))
    return dest, f"{wheel.name}"


def extract(source_dir: Path, version: str) -> dict[str, Any]:
    """The format-1 document for ``trtllm-serve`` ``version`` from a source tree at ``source_dir``
    (the folder holding ``tensorrt_llm/``)."""
    path = source_dir / SERVE
    if not path.is_file():
        raise core.ExtractError(f"{path}: not found; the source tree must hold {SERVE}")
    options, positionals = extract_source(path.read_text(encoding="utf-8"), str(path))
    return core.document(
        engine=ENGINE,
        version=version,
        program=PROGRAM,
        source=f"{SERVE}: the click decorators of `serve`, read with ast",
        positionals=positionals,
        options=options,
    )
