"""Engine flag files: the committed files against the tool's format, the loader's choices and
checks, and the issue's facts about vLLM 0.18.0 and 0.33.0.

CI downloads no engine, so a file cannot be regenerated here; what can go stale is its format
(a file written by an older tool, or edited by hand), which is what these tests pin: each file is
exactly what ``enginebuild.flags.core.render`` writes for its content, the loader accepts it, and
its ``produced_by`` is the command that rewrites it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.engines import flagsets
from enginebuild.flags import EXTRACTORS, core
from enginebuild.flags import vllm as vllm_extractor

FILES = sorted(flagsets.DATA_DIR.glob("*.json"))
REPO = Path(__file__).resolve().parent.parent


def test_there_are_files_for_both_vllm_versions() -> None:
    assert {"0.18.0", "0.33.0"} <= set(flagsets.available("vllm"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_committed_file_is_what_the_tool_writes(path: Path) -> None:
    """Format, key order, indentation, sorted options, produced_by against the name: a file the
    current tool would write byte for byte, and one the loader reads."""
    text = path.read_text(encoding="utf-8")
    doc = json.loads(text)
    assert text == core.render(doc), f"{path.name} is not in the tool's canonical form; run nox -s flags"
    assert doc["format"] == flagsets.FORMAT
    engine, _, version = path.stem.partition("-")
    assert (doc["engine"], doc["version"]) == (engine, version)
    assert doc["produced_by"] == f"python -m enginebuild.flags {engine} {version}"
    assert engine in EXTRACTORS, f"no extractor registered for {engine} (enginebuild/flags/__init__.py)"
    firsts = [o["flags"][0] for o in doc["options"]]
    assert firsts == sorted(firsts)
    for option in doc["options"]:
        assert option["type"] in flagsets.TYPES
        assert option["nargs"] in (None, "?", "+", "*")
    fs = flagsets.load(path)
    assert len(fs.options) == len(doc["options"]) > 0
    assert flagsets.for_version(engine, version) == fs


@pytest.mark.parametrize("engine", sorted(EXTRACTORS))
def test_every_pinned_version_has_its_file(engine: str) -> None:
    """``nox -s flags`` regenerates the pinned versions; each must be committed."""
    for version in EXTRACTORS[engine].VERSIONS:
        assert (flagsets.DATA_DIR / flagsets.file_name(engine, version)).is_file(), (engine, version)


# The facts, as the committed vLLM files must hold them.


def _quantization(version: str) -> flagsets.Option:
    option = flagsets.for_version("vllm", version).option("--quantization")
    assert option is not None and option.choices is not None
    assert option.flags == ("--quantization", "-q")
    return option


def test_vllm_0_18_0_quantization_facts() -> None:
    q = _quantization("0.18.0")
    assert "modelopt_mxfp8" in q.choices  # type: ignore[operator]
    for deprecated in ("fbgemm_fp8", "fp_quant", "experts_int8", "petit_nvfp4"):
        assert deprecated in q.choices  # type: ignore[operator]
        assert "--allow-deprecated-quantization" in q.deprecated_choices[deprecated]
    assert "awq" not in q.deprecated_choices
    fs = flagsets.for_version("vllm", "0.18.0")
    switch = fs.option("--allow-deprecated-quantization")
    assert switch is not None and not switch.takes_value
    assert "--no-allow-deprecated-quantization" in switch.flags


def test_vllm_0_33_0_dropped_methods() -> None:
    q = _quantization("0.33.0")
    for gone in ("gguf", "bitsandbytes", "petit_nvfp4", "cpu_awq"):
        assert gone not in q.choices  # type: ignore[operator]
    assert set(q.choices) - set(_quantization("0.18.0").choices)  # type: ignore[arg-type]  # new methods


def test_vllm_options_the_adapter_and_sim_rely_on() -> None:
    fs = flagsets.for_version("vllm", "0.18.0")
    timeout = fs.option("--shutdown-timeout")
    assert timeout is not None and timeout.type == "int"
    api_key = fs.option("--api-key")
    assert api_key is not None and api_key.takes_value
    assert fs.option("-tp") is fs.option("--tensor-parallel-size")
    assert fs.option("--port") is not None and fs.option("--port").type == "int"  # type: ignore[union-attr]
    assert [p.name for p in fs.positionals] == ["model_tag"]
    assert fs.option("--bogus") is None


def test_sglang_0_5_23_quantization_facts() -> None:
    """0.5.23 declares its options in ``sglang.srt.arg_groups`` (msgspec Structs, choice lists in
    ``arg_groups/choices.py``): the file is read from that layout, has auto-round and has dropped
    qoq, which 0.5.10.post1 still takes; the options the adapter writes are all there."""
    new, old = flagsets.for_version("sglang", "0.5.23"), flagsets.for_version("sglang", "0.5.10.post1")
    assert new.version == "0.5.23"
    q, q_old = new.option("--quantization"), old.option("--quantization")
    assert q is not None and q.choices is not None and q_old is not None and q_old.choices is not None
    assert {"auto-round", "auto-round-int8"} <= set(q.choices)
    assert "qoq" not in q.choices and "qoq" in q_old.choices
    # Literal-typed fields (their choices come from the annotation), aliases from Arg(aliases=...).
    assert new.option("--tensor-parallel-size") is new.option("--tp-size")
    backend = new.option("--cuda-graph-backend-decode")
    assert backend is not None and backend.choices == ("full", "breakable", "disabled")
    # Converters from stubbed modules survive ``type_parser or <annotation's type>``: --context-length
    # is ``Optional[int]`` parsed by human_readable_int ("32k"), --forward-hooks by json_list_type.
    assert new.option("--context-length").type == "str"  # type: ignore[union-attr]
    assert new.option("--forward-hooks").type == "json"  # type: ignore[union-attr]
    for flag in ("--model-path", "--served-model-name", "--host", "--port", "--pp-size", "--api-key"):
        assert new.option(flag) is not None, flag


# Choosing a file for an installed version.


@pytest.mark.parametrize(
    ("installed", "chosen"),
    [
        ("0.18.0", "0.18.0"),
        ("0.18.1", "0.18.0"),
        ("0.20.2", "0.18.0"),
        ("0.33.0", "0.33.0"),
        ("0.40.0", "0.33.0"),
        ("0.17.1", "0.18.0"),  # older than every file: the oldest
        ("", "0.18.0"),  # unknown
        ("not a version", "0.18.0"),
        ("0.33.0+cu128", "0.33.0"),
    ],
)
def test_for_version_picks_the_newest_file_not_newer(installed: str, chosen: str) -> None:
    assert flagsets.for_version("vllm", installed).version == chosen


def _write(data_dir: Path, engine: str, version: str) -> None:
    doc = core.document(
        engine=engine,
        version=version,
        program="llama-server",
        source="test",
        positionals=[],
        options=[_opt("--port", "int")],
    )
    core.write(doc, data_dir)


def _opt(flag: str, kind: str, **extra: object) -> dict[str, object]:
    option: dict[str, object] = {
        "flags": [flag],
        "dest": flag.lstrip("-").replace("-", "_"),
        "takes_value": kind != "bool",
        "type": kind,
        "nargs": None,
        "choices": None,
        "deprecated_choices": {},
    }
    option.update(extra)
    return option


def test_llamacpp_builds_compare_by_number(tmp_path: Path) -> None:
    for build in ("b999", "b6432", "b10000"):
        _write(tmp_path, "llamacpp", build)
    assert flagsets.available("llamacpp", tmp_path) == ["b999", "b6432", "b10000"]
    assert flagsets.for_version("llamacpp", "b7000", tmp_path).version == "b6432"
    assert flagsets.for_version("llamacpp", "b20000", tmp_path).version == "b10000"
    assert flagsets.for_version("llamacpp", "b5", tmp_path).version == "b999"
    assert flagsets.for_version("llamacpp", "", tmp_path).version == "b999"


def test_an_engine_without_files_is_an_error_naming_the_tool(tmp_path: Path) -> None:
    with pytest.raises(flagsets.FlagSetError, match=re.escape("python -m enginebuild.flags sglang VERSION")):
        flagsets.for_version("sglang", "0.5.4", tmp_path)


# check_argv, in the engine's words.


def test_check_argv_accepts_what_the_vllm_adapter_builds() -> None:
    fs = flagsets.for_version("vllm", "0.18.0")
    argv = [
        "org/model",
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "2",
        "--quantization",
        "awq",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.9",
        "--shutdown-timeout",
        "25",
        "--api-key",
        "k",
        "--enforce-eager",
        "--port=8001",
    ]
    assert fs.check_argv(argv) == []


def test_check_argv_names_each_problem_like_the_engine() -> None:
    fs = flagsets.for_version("vllm", "0.18.0")
    problems = fs.check_argv(
        [
            "m",
            "--bogus",
            "--port",
            "eighty",
            "-q",
            "nope",
            "--enforce-eager=1",
            "extra",
            "--served-model-name",
        ]
    )
    assert problems[0] == "vLLM 0.18.0: argument --port: invalid int value: 'eighty'"
    assert problems[1].startswith(
        "vLLM 0.18.0: argument --quantization/-q: invalid choice: 'nope' (choose from 'awq', "
    )
    assert problems[2] == (
        "vLLM 0.18.0: argument --enforce-eager/--no-enforce-eager: ignored explicit argument '1'"
    )
    assert problems[3] == "vLLM 0.18.0: argument --served-model-name: expected at least one argument"
    assert problems[4] == "vLLM 0.18.0: unrecognized arguments: --bogus extra"
    assert len(problems) == 5
    assert fs.check_argv(["m", "--port"]) == ["vLLM 0.18.0: argument --port: expected one argument"]
    assert fs.check_argv(["m", "--port", "--host", "h"]) == [
        "vLLM 0.18.0: argument --port: expected one argument"
    ]


def test_vllm_spells_underscores_as_dashes_like_its_parser() -> None:
    """vLLM's FlexibleArgumentParser: ``--max_model_len`` is ``--max-model-len`` (up to a ``.`` or
    ``=``); SGLang's plain argparse has no such rule."""
    fs = flagsets.for_version("vllm", "0.18.0")
    assert fs.normalize(["m", "--max_model_len=4k", "--compilation_config.cudagraph_mode", "x", "-q"]) == [
        "m",
        "--max-model-len=4k",
        "--compilation-config.cudagraph_mode",
        "x",
        "-q",
    ]
    assert fs.check_argv(["m", "--max_num_seqs", "8", "--enforce_eager"]) == []
    assert fs.check_argv(["m", "--bogus_flag"]) == ["vLLM 0.18.0: unrecognized arguments: --bogus-flag"]


def test_check_argv_deprecated_choice_needs_its_flag() -> None:
    fs = flagsets.for_version("vllm", "0.18.0")
    assert fs.check_argv(["m", "--quantization", "fbgemm_fp8"]) == [
        "vLLM 0.18.0: --quantization fbgemm_fp8 is deprecated and needs --allow-deprecated-quantization"
    ]
    assert fs.check_argv(["m", "-q", "fbgemm_fp8", "--allow-deprecated-quantization"]) == []
    # The last spelling wins, as in argparse.
    assert fs.check_argv(
        ["m", "-q", "fbgemm_fp8", "--allow-deprecated-quantization", "--no-allow-deprecated-quantization"]
    )
    assert fs.check_argv(["m", "-q", "modelopt_mxfp8"]) == []
    assert (
        flagsets.for_version("vllm", "0.33.0")
        .check_argv(["m", "-q", "gguf"])[0]
        .startswith("vLLM 0.33.0: argument --quantization/-q: invalid choice: 'gguf'")
    )


# The loader refuses a damaged file, naming it and the key.


def _doc() -> dict[str, object]:
    return json.loads((flagsets.DATA_DIR / "vllm-0.18.0.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d.update(format=2), "format 2 is not 1"),
        (lambda d: d.update(produced_by="by hand"), "produced_by 'by hand'"),
        (lambda d: d["options"].reverse(), "not sorted by their first flag"),
        (lambda d: d["options"][0].update(type="path"), "type 'path' is not one of"),
        (lambda d: d["options"][0].update(nargs=2), "nargs 2"),
        (lambda d: d["options"][0].pop("choices"), "option keys"),
        (lambda d: d.update(engine="tgi"), "engine 'tgi'"),
        (lambda d: d["options"].append(dict(d["options"][-1])), "belongs to two options"),
    ],
)
def test_loader_refuses_damaged_documents(damage: object, message: str) -> None:
    doc = _doc()
    damage(doc)  # type: ignore[operator]
    with pytest.raises(flagsets.FlagSetError, match="nox -s flags") as caught:
        flagsets.parse_document(doc, "vllm-0.18.0.json")
    assert message in str(caught.value)
    assert str(caught.value).startswith("vllm-0.18.0.json: ")


def test_loader_refuses_a_file_named_for_another_version(tmp_path: Path) -> None:
    path = tmp_path / "vllm-0.19.0.json"
    path.write_text(core.render(_doc()), encoding="utf-8")
    with pytest.raises(flagsets.FlagSetError, match=re.escape("its name must be vllm-0.18.0.json")):
        flagsets.load(path)


# The tool's conversion, on a parser built here (the download is `nox -s flags`'s, not CI's).


def test_options_from_parser_reads_argparse_as_vllm_builds_it() -> None:
    def optional_type(return_type: Callable[[str], Any]) -> Callable[[str], Any]:
        def _optional_type(val: str) -> Any:
            return None if val == "None" else return_type(val)

        return _optional_type

    parser = argparse.ArgumentParser()
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--port", type=int)
    parser.add_argument("--max-num-seqs", type=optional_type(int))
    parser.add_argument("--hf-overrides", type=optional_type(json.loads))
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
    parser.add_argument("--dtype", choices=["auto", "half"])
    parser.add_argument("--served-model-name", nargs="+", type=optional_type(str))
    parser.add_argument("--tool-strict-level", choices=["strict", None], type=optional_type(str))
    positionals, options = core.options_from_parser(parser, vllm_extractor._type_name)
    assert positionals == [{"name": "model_tag", "nargs": "?"}]
    by = {o["flags"][0]: o for o in options}
    assert by["--port"]["type"] == "int"
    assert by["--max-num-seqs"]["type"] == "int"
    assert by["--hf-overrides"]["type"] == "json"
    assert by["--enforce-eager"] == {
        "flags": ["--enforce-eager", "--no-enforce-eager"],
        "dest": "enforce_eager",
        "takes_value": False,
        "type": "bool",
        "nargs": None,
        "choices": None,
        "deprecated_choices": {},
    }
    assert by["--dtype"]["choices"] == ["auto", "half"]
    assert by["--served-model-name"]["nargs"] == "+"
    assert by["--tool-strict-level"]["choices"] == ["strict", "None"]
    assert by["-h"]["takes_value"] is False
    doc = core.document(
        engine="vllm",
        version="0.0.1",
        program="vllm serve",
        source="test",
        positionals=positionals,
        options=options,
    )
    assert [o["flags"][0] for o in doc["options"]] == sorted(by)
    assert flagsets.parse_document(json.loads(core.render(doc)), "x").option("--no-enforce-eager") is not None


def test_stubs_stand_in_for_anything_and_are_detected() -> None:
    """The stub rules the vLLM probe relies on, in a child interpreter (stubs change sys.meta_path
    for good): a missing package imports, subclasses with keywords, decorates, and leaks show."""
    code = (
        "from enginebuild.flags import stubs\n"
        "stubs.install('.', 'nothing_here', shims={'torchlike.library.infer_schema': lambda f: 'x'})\n"
        "import torchlike, torchlike.nn as nn\n"
        "from torchlike.library import infer_schema\n"
        "assert infer_schema(None) == 'x'\n"
        "class M(nn.Module, omit_defaults=True): pass\n"
        "@torchlike.compile\n"
        "def f(): return 3\n"
        "assert f() == 3 and list(torchlike.cuda.devices) == []\n"
        "assert stubs.is_stub([1, {'a': torchlike.dtype}]) and not stubs.is_stub(['a', 1])\n"
        "import regex; assert regex.match(r'^a', 'abc')\n"
        "import json; print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_wheel_carries_the_flag_files(tmp_path: Path) -> None:
    """An installed agent (not a checkout) must find its flag files: they are package data. Built
    from a copy, so setuptools' build/ folder lands in tmp_path, not in the checkout."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, tree / name)
    for package in (
        "schema",
        "transport",
        "telemetry",
        "settings",
        "statefile",
        "enginedefs",
        "agent",
        "control",
        "router",
    ):
        shutil.copytree(REPO / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(tree),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("llmgw-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in FILES:
        assert f"agent/engines/flags/{path.name}" in names
    # The shared packages the agent imports travel with it, typed.
    assert {"statefile/__init__.py", "statefile/py.typed"} <= names
    assert {"enginedefs/__init__.py", "enginedefs/py.typed"} <= names


def test_vllm_extractor_names_extensions_and_pinned_versions(tmp_path: Path) -> None:
    """What the probe stubs (the wheel's compiled modules) and the versions it fakes for vLLM's
    import-time checks (``torch==2.10.0``), read from the wheel itself."""
    assert vllm_extractor.extension_modules(
        ["vllm/_C.abi3.so", "vllm/attn/_fa2_C.abi3.so", "vllm.libs/libcudart-1a2b.so.12", "vllm/x.py"]
    ) == ["vllm._C", "vllm.attn._fa2_C"]
    info = tmp_path / "vllm-0.18.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Name: vllm\nRequires-Dist: torch==2.10.0\nRequires-Dist: transformers<5,>=4.56.0\n"
        "Requires-Dist: pytest; extra == 'test'\nRequires-Dist: regex\n",
        encoding="utf-8",
    )
    assert vllm_extractor._fake_versions(tmp_path) == {"torch": "2.10.0", "transformers": "4.56.0"}
