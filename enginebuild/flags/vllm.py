"""vLLM's ``vllm serve`` options, from vLLM's own parser.

How: by running vLLM's own code, not by re-implementing it. vLLM builds most of its options at
import time from its config dataclasses (``EngineArgs.add_cli_args`` calls ``get_kwargs`` /
``_compute_kwargs``, which turn each field's type hint into argparse keywords: ``Literal`` into
choices, ``bool`` into ``BooleanOptionalAction``, ``X | None`` into ``optional_type``, dataclasses
into JSON), then adds the server's own (``make_arg_parser`` in the OpenAI entry point) and the CLI
sub-command's (``ServeSubcommand.subparser_init``). Those rules change between releases (0.18 and
0.33 differ), so re-implementing them from the syntax tree would drift; building the real parser
cannot. The child interpreter imports vLLM's pure-Python source from the wheel with torch, CUDA
kernels and every other dependency stubbed (:mod:`enginebuild.flags.stubs`; pydantic is real, since
the config dataclasses are pydantic's), pins the platform to CUDA (our fleet's) so device-dependent
defaults resolve, calls ``ServeSubcommand().subparser_init`` on a ``FlexibleArgumentParser`` and
reads the actions. Nothing imports torch and nothing needs a GPU.

One rule lives outside argparse: ``--quantization`` is typed ``QuantizationMethods | str`` (argparse
shows the methods as a metavar and takes any string), and ``ModelConfig`` then refuses a name not
in ``QUANTIZATION_METHODS`` and one in ``DEPRECATED_QUANTIZATION_METHODS`` unless
``--allow-deprecated-quantization`` is given. The file records those two lists, read from the same
module, as the option's ``choices`` and ``deprecated_choices``.

Source: the wheel, not the sdist: ``pip download`` of vLLM's sdist must build its metadata, which
needs torch; the wheel holds the same Python files (only they are unpacked; its compiled kernels
are named so the stubs can stand in for them).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from enginebuild.flags import core

ENGINE = "vllm"
PROGRAM = "vllm serve"
#: What ``nox -s flags`` regenerates.
VERSIONS = ("0.18.0", "0.33.0")

#: vLLM's x86-64 wheels move between manylinux tags from release to release.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(17, 41))

#: Lists the extension modules of the unpacked wheel (their .so files are left out).
_COMPILED = "llmgw-compiled-modules.txt"
_DEPRECATED = "is deprecated and needs --allow-deprecated-quantization"


def fetch(version: str, workdir: Path) -> tuple[Path, str]:
    """Download vLLM's wheel at version and unpack its Python source; (source dir, description)."""
    wheel = core.pip_download(f"vllm=={version}", workdir / "download", wheel_platforms=PLATFORMS)
    src = workdir / "src"
    core.unpack(wheel, src, keep=lambda n: n.endswith(".py") or n.endswith(".dist-info/METADATA"))
    compiled = extension_modules(core.archive_names(wheel))
    (src / _COMPILED).write_text("\n".join(compiled) + "\n", encoding="utf-8")
    return src, f"{wheel.name} from the package index"


def extension_modules(names: list[str]) -> list[str]:
    """Python extension modules among a wheel's member names (``vllm/_C.abi3.so`` is ``vllm._C``);
    shared libraries outside the package tree (``vllm.libs/libfoo.so.1``) are not modules."""
    found = set()
    for name in names:
        m = re.fullmatch(r"((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*)(?:\.[\w-]+)?\.so", name)
        if m:
            found.add(m.group(1).replace("/", "."))
    return sorted(found)


def extract(source_dir: Path, version: str) -> dict[str, Any]:
    """The format-1 document for the vLLM source in source_dir (run in a child interpreter)."""
    result = source_dir / "llmgw-parser.json"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from enginebuild.flags import vllm; vllm.probe(sys.argv[1], sys.argv[2])",
            str(source_dir),
            str(result),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise core.ExtractError(f"vllm {version}: building vLLM's parser failed:\n{tail}")
    found = json.loads(result.read_text(encoding="utf-8"))
    if found["version"] != version:
        raise core.ExtractError(f"vllm {version}: the unpacked source says it is {found['version']}")
    return core.document(
        engine=ENGINE,
        version=version,
        program=PROGRAM,
        source=(
            "vllm serve's parser built by vLLM's own ServeSubcommand.subparser_init "
            "(vllm/entrypoints/cli/serve.py, vllm/entrypoints/openai/cli_args.py, vllm/engine/arg_utils.py) "
            "with its dependencies stubbed; --quantization choices from "
            "vllm/model_executor/layers/quantization/__init__.py"
        ),
        positionals=found["positionals"],
        options=found["options"],
    )


def _unwrap(converter: Any) -> Any:
    """vLLM wraps converters in closures (``optional_type(int)``, ``parse_type(json.loads)``);
    the innermost callable decides the value type."""
    seen = 0
    while callable(converter) and getattr(converter, "__closure__", None) and seen < 5:
        inner = [c.cell_contents for c in converter.__closure__ if callable(c.cell_contents)]
        if not inner:
            break
        converter = inner[0]
        seen += 1
    return converter


def _type_name(action: argparse.Action) -> str:
    converter = _unwrap(action.type)
    name = getattr(converter, "__name__", "")
    if converter is None or converter is str or name == "union_dict_and_str":
        return "str"
    if converter is int:
        return "int"
    if converter is float:
        return "float"
    if converter is json.loads or name in ("parse_dataclass", "loads"):
        return "json"
    if name.startswith("human_readable_int"):
        # "25.6k", "1M", "auto" and "-1" are vLLM's too: a plain int check would refuse them.
        return "str"
    if converter is bool:
        return "bool"
    # Anything else normalises a string (``--moe-backend``: ``lambda s: s.lower()...``): any string
    # passes the type step, and choices, when the option has them, still apply.
    print(
        f"note: {'/'.join(action.option_strings)}: converter {name or converter!r} recorded as str",
        file=sys.stderr,
    )
    return "str"


def _fake_versions(source_dir: Path) -> dict[str, str]:
    """Package versions vLLM's import-time checks ask for (``is_torch_equal_or_newer``): the ones
    its wheel pins (``torch==2.10.0``) or its lower bounds."""
    versions: dict[str, str] = {}
    for meta in source_dir.glob("*.dist-info/METADATA"):
        for line in meta.read_text(encoding="utf-8").splitlines():
            m = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)[^;]*?(?:==|>=)\s*([0-9][0-9A-Za-z.]*)", line)
            if m and "extra ==" not in line:
                versions.setdefault(m.group(1).lower().replace("-", "_"), m.group(2))
    return versions


def _infer_schema(fn: Any, *args: Any, **kwargs: Any) -> str:
    """torch.library.infer_schema's shape, enough for vLLM 0.33's IR ops, which parse it at import:
    one Tensor out per activation (parameters named ``x...``, vLLM's convention)."""
    import inspect

    params = list(inspect.signature(fn).parameters)
    outputs = max(1, sum(1 for p in params if p.startswith("x")))
    returns = ", ".join(["Tensor"] * outputs)
    return f"({', '.join('Tensor ' + p for p in params)}) -> " + (f"({returns})" if outputs > 1 else returns)


def probe(source_dir: str, result: str) -> None:
    """In the child: build vLLM's serve parser under stubs and write what it holds as JSON to
    result (vLLM's logger writes to stdout)."""
    from enginebuild.flags import stubs

    compiled = (Path(source_dir) / _COMPILED).read_text(encoding="utf-8").split()
    stubbed = stubs.install(
        source_dir,
        "vllm",
        compiled=compiled,
        versions=_fake_versions(Path(source_dir)),
        shims={"torch.library.infer_schema": _infer_schema},
    )
    import vllm.platforms  # type: ignore[import-not-found]
    from vllm.platforms.cuda import CudaPlatform  # type: ignore[import-not-found]
    from vllm.platforms.interface import DeviceCapability  # type: ignore[import-not-found]

    class Hopper(CudaPlatform):  # type: ignore[misc]
        """An H100 as the platform: defaults that depend on the device resolve as on our fleet."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 * 2**30

        @classmethod
        def device_count(cls) -> int:
            return 1

    vllm.platforms._current_platform = Hopper()
    from vllm import _version
    from vllm.entrypoints.cli.serve import ServeSubcommand  # type: ignore[import-not-found]
    from vllm.model_executor.layers import quantization  # type: ignore[import-not-found]
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

    top = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand().subparser_init(top.add_subparsers())
    positionals, options = core.options_from_parser(serve, _type_name)
    methods = list(quantization.QUANTIZATION_METHODS)
    deprecated = [m for m in getattr(quantization, "DEPRECATED_QUANTIZATION_METHODS", []) if m in methods]
    for option in options:
        if option["dest"] == "quantization":
            option["choices"] = methods
            option["deprecated_choices"] = {m: _DEPRECATED for m in deprecated}
    for option in options:
        if stubs.is_stub(option):
            raise core.ExtractError(f"{option['flags']}: a stubbed dependency leaked into {option}")
    with open(result, "w", encoding="utf-8") as out:
        json.dump(
            {
                "version": _version.version,
                "positionals": positionals,
                "options": options,
                "stubbed": sorted(stubbed),
            },
            out,
        )
