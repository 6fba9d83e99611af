"""Every command line an adapter builds is one its engine version accepts, over every flag file.

The property (hypothesis over profiles, GPU layouts, launch contexts and every committed flag file
of every engine): whatever ``plan`` accepts, its argv passes ``FlagSet.check_argv`` of the flag
set for the node's version; and what that flag set says the engine refuses (a choice it lacks, a
deprecated one without its enabling flag, a flag it does not have, a value of the wrong type in
``extra_args``), ``plan`` refuses first, before anything is spawned. The flag files are the
engines' own parsers, extracted by ``python -m enginebuild.flags``, so a pass here means the
engine's parser would pass the argv too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schema
from agent.discovery.model import GpuInfo
from agent.engines import LaunchContext, ProfileRefused, base, flagsets, llamacpp, plan, sim, trtllm
from agent.engines.flagsets import FlagSet, Option
from tests.fleet_procs import one_node, poll, sim_processes, sim_version

#: The engines with flag files, and the one the simulator speaks.
FLAG_ENGINES = ("vllm", "sglang", "llamacpp", "trtllm")

#: How each adapter's argv starts before the arguments its flag set describes
#: (the binary, then ``serve`` where the flag set's program has a sub-command).
PREFIX: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "sim": sim.ARGV_PREFIX,
    "sglang": ("python", "-m", "sglang.launch_server"),
    "llamacpp": ("llama-server",),
    "trtllm": ("trtllm-serve",),
}
SUBCOMMAND = {"vllm": ("serve",), "sim": ("serve",), "sglang": (), "llamacpp": (), "trtllm": ("serve",)}

#: The flag set each engine's ``dtype`` and ``quantization`` become, where they become one.
CLI_CHOICE_FLAGS = {"vllm": ("--dtype", "--quantization"), "sglang": ("--dtype", "--quantization")}

#: Versions a node may report: every file's own, and ones between, before, after and unknown.
EXTRA_VERSIONS = {
    "vllm": ("", "0.17.1", "0.20.0", "0.40.0", "not-a-version"),
    "sglang": ("", "0.5.3", "0.5.9", "0.5.23"),
    "llamacpp": ("", "0.5.0-dev", "b6432"),
    "trtllm": ("", "1.0.0", "1.3.0"),
}


def files_of(engine: str) -> list[FlagSet]:
    return [flagsets.for_version(engine, v) for v in flagsets.available(engine)]


def union_options(engine: str) -> list[Option]:
    """Every option of every version of an engine, by first flag (so some are missing in some
    versions: exactly the extra_args a version-blind operator would write)."""
    seen: dict[str, Option] = {}
    for fs in files_of(engine):
        for option in fs.options:
            seen.setdefault(option.flags[0], option)
    return [seen[k] for k in sorted(seen)]


def union_choices(engine: str, flag: str) -> list[str]:
    values: set[str] = set()
    for fs in files_of(engine):
        option = fs.option(flag)
        if option is not None and option.choices:
            values.update(str(c) for c in option.choices)
    return sorted(values)


ALL_QUANTIZATIONS = sorted(
    {q for e in ("vllm", "sglang") for q in union_choices(e, "--quantization")}
    | set(llamacpp.GGUF_TYPES)
    | set(trtllm.QUANT_ALGOS)
    | {"exl2", "FP8", "q4_k_m"}
)
ALL_DTYPES = sorted({d for e in ("vllm", "sglang") for d in union_choices(e, "--dtype")} | {"fp8", "int4"})


def values_for(option: Option) -> st.SearchStrategy[list[str]]:
    """Tokens after a flag: mostly valid for the option's type and choices, sometimes not."""
    if not option.takes_value:
        return st.just([])
    good: st.SearchStrategy[str]
    if option.choices:
        good = st.sampled_from([str(c) for c in option.choices])
    elif option.type == "int":
        good = st.integers(min_value=0, max_value=4096).map(str)
    elif option.type == "float":
        good = st.sampled_from(["0.5", "0.9", "1", "2.5"])
    elif option.type == "json":
        good = st.sampled_from(['{"a": 1}', "[1, 2]"])
    else:
        good = st.sampled_from(["x", "auto", "/tmp/file", "8"])
    bad = st.sampled_from(["many", "{not json", "-", "--", "0x1"])
    one = st.one_of(good, good, good, good, good, bad)
    if option.nargs in ("+", "*"):
        return st.lists(one, min_size=0 if option.nargs == "*" else 1, max_size=2)
    if option.nargs == "?":
        return st.lists(one, max_size=1)
    return st.lists(one, min_size=1, max_size=1) | st.just([])


@st.composite
def extra_args(draw: st.DrawFn, engine: str, fs: FlagSet) -> list[str]:
    """0-3 options: mostly the node's version's own, else another version's of the same engine
    (what a version-blind operator writes), another engine's, or made up."""
    own = list(fs.options)
    any_version = union_options(fs.engine)
    others = [o for e in FLAG_ENGINES if e != fs.engine for o in union_options(e)]
    args: list[str] = []
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        option = draw(
            st.one_of(
                st.sampled_from(own),
                st.sampled_from(own),
                st.sampled_from(any_version),
                st.sampled_from(others),
            )
        )
        flag = draw(st.sampled_from(option.flags))
        args += [flag, *draw(values_for(option))]
    if draw(st.integers(min_value=0, max_value=5)) == 0:
        args.append(
            draw(st.sampled_from(["--allow-deprecated-quantization", "--made-up-flag", "positional"]))
        )
    return args


MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "/models/llama-8b", "m.gguf", "-dash-model", "with space")


def own_choices(engine: str, fs: FlagSet, flag: str) -> list[str]:
    """The choices the node's version has for a profile field, where the engine has a list."""
    if engine == "llamacpp" and flag == "--quantization":
        return list(llamacpp.GGUF_TYPES)
    if engine == "trtllm" and flag == "--quantization":
        return list(trtllm.QUANT_ALGOS)
    option = fs.option(flag)
    return [str(c) for c in option.choices] if option is not None and option.choices else ["auto"]


@st.composite
def cases(draw: st.DrawFn, engine: str) -> tuple[schema.StartShard, list[GpuInfo], LaunchContext, FlagSet]:
    """A StartShard, the node's GPUs and launch context, and the flag set of the node's version;
    biased towards what plan accepts, so the property is checked on many accepted argvs."""
    flag_engine = "vllm" if engine == "sim" else engine
    version = draw(st.sampled_from([*flagsets.available(flag_engine), *EXTRA_VERSIONS[flag_engine]]))
    fs = flagsets.for_version(flag_engine, version)
    model = draw(st.one_of(st.sampled_from(MODELS[:3]), st.sampled_from(MODELS)))
    served = draw(st.one_of(st.just(model), st.just(model), st.sampled_from(["served-name", "-served"])))
    tp = draw(st.sampled_from([0, 1, 1, 2, 4]))
    pp = draw(st.sampled_from([0, 1, 1, 2]))
    nnodes = draw(st.sampled_from([1, 1, 1, 1, 2]))
    world = max(tp, 1) * max(pp, 1)
    per_node = max(world // nnodes, 1)
    fits = draw(st.integers(min_value=0, max_value=4)) > 0  # mostly a layout plan can take
    n_gpus = draw(st.integers(min_value=per_node if fits else 0, max_value=8))
    cc = draw(st.sampled_from([(9, 0), (9, 0), (8, 0), (7, 0)]))
    node = [
        GpuInfo(index=i, uuid=f"GPU-{i}", name="gpu", compute_capability=cc, memory_total_mib=81559)
        for i in range(n_gpus)
    ]
    if fits:
        indices = list(draw(st.permutations(range(n_gpus)))[:per_node])
    else:
        indices = draw(st.lists(st.integers(min_value=0, max_value=7), unique=True, max_size=n_gpus))
    dtype = draw(
        st.one_of(
            st.just(""),
            st.just(""),
            st.sampled_from(own_choices(engine, fs, "--dtype")),
            st.sampled_from(ALL_DTYPES),
        )
    )
    quantization = draw(
        st.one_of(
            st.just(""),
            st.sampled_from(own_choices(flag_engine, fs, "--quantization")),
            st.sampled_from(ALL_QUANTIZATIONS),
        )
    )
    profile = schema.EngineProfile(
        engine=engine,
        model=model,
        served_model_name=served,
        dtype=dtype,
        quantization=quantization,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=draw(st.sampled_from([0, 0, 4096, 131072])),
        gpu_memory_utilization=draw(st.sampled_from([0.0, 0.0, 0.5, 0.9, 1.0])),
        extra_args=draw(extra_args(engine, fs)),
    )
    spec = schema.StartShard(
        shard_id="r1-s0",
        replica_id="r1",
        profile=profile,
        gpu_indices=indices,
        http_port=8001,
        nnodes=nnodes,
        node_rank=draw(st.integers(min_value=0, max_value=nnodes - 1)),
        master_addr="10.0.0.5" if nnodes > 1 else "",
        master_port=29500 if nnodes > 1 else 0,
        api_key=draw(st.sampled_from(["", "", "3f9a0c1d5e7b", "3f9a0c1d5e7b", "-starts-with-dash"])),
    )
    ctx = LaunchContext(
        argv_prefix=PREFIX[engine],
        host="10.0.0.7",
        gpus=tuple(node),
        shutdown_timeout_seconds=draw(st.sampled_from([0.0, 2.0, 30.0])),
        engine_version=version,
    )
    return spec, node, ctx, fs


def arguments(engine: str, argv: Sequence[str]) -> list[str]:
    """What follows the program in an argv: what the flag set describes."""
    head = (*PREFIX[engine], *SUBCOMMAND[engine])
    assert tuple(argv[: len(head)]) == head
    return list(argv[len(head) :])


def refusals_the_flag_file_predicts(engine: str, profile: schema.EngineProfile, fs: FlagSet) -> list[str]:
    """What the engine version's own parser refuses in this profile, found without the adapter:
    its choices for the fields that become flags, and every problem in ``extra_args`` alone."""
    found: list[str] = []
    for flag, value in zip(
        CLI_CHOICE_FLAGS.get(engine, ()), (profile.dtype, profile.quantization), strict=False
    ):
        option = fs.option(flag)
        if not value or option is None:
            continue
        if option.choices is not None and value not in {str(c) for c in option.choices}:
            found.append(f"{flag} {value}: not a choice")
        elif value in option.deprecated_choices and not any(
            f in profile.extra_args for f in ("--allow-deprecated-quantization",)
        ):
            found.append(f"{flag} {value}: deprecated")
    # extra_args on their own: an unknown flag, a bad value or a missing one (a positional an
    # engine would take as its model, where the adapter already gives one, is not counted).
    found += [
        p for p in fs.check_argv(list(profile.extra_args)) if "required" not in p and "unrecognized" not in p
    ]
    known = {t.partition("=")[0] for t in profile.extra_args if t.startswith("-") and len(t) > 1}
    found += [
        f"{flag}: unknown" for flag in sorted(known) if fs.option(flag) is None and not _is_number(flag)
    ]
    return found


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def check_property(
    engine: str, case: tuple[schema.StartShard, list[GpuInfo], LaunchContext, FlagSet]
) -> None:
    spec, node, ctx, fs = case
    assert spec.profile is not None
    predicted = refusals_the_flag_file_predicts("vllm" if engine == "sim" else engine, spec.profile, fs)
    try:
        launch = plan(spec, node, ctx)
    except ProfileRefused:
        return
    problems = fs.check_argv(arguments(engine, launch.command.argv))
    assert problems == [], f"{fs.label} refuses what plan accepted: {problems}; argv {launch.command.argv}"
    assert predicted == [], f"plan accepted what {fs.label}'s flag file refuses: {predicted}"


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("engine", [*FLAG_ENGINES, "sim"])
def test_every_argv_plan_accepts_is_one_the_engine_version_accepts(engine: str) -> None:
    @SETTINGS
    @given(cases(engine))
    def run(case: tuple[schema.StartShard, list[GpuInfo], LaunchContext, FlagSet]) -> None:
        check_property(engine, case)

    run()


@pytest.mark.parametrize("engine", [*FLAG_ENGINES, "sim"])
def test_the_adapters_own_flags_are_valid_without_the_final_check(engine: str) -> None:
    """Not only the last line of defence: with the whole-argv check switched off and no
    extra_args, what an adapter builds from the profile and the StartShard is already valid for
    the version. (This is how the property found values starting with '-' in the model, the
    served name and the key, which every engine's parser reads as an option.)"""

    @SETTINGS
    @given(cases(engine))
    def run(case: tuple[schema.StartShard, list[GpuInfo], LaunchContext, FlagSet]) -> None:
        spec, node, ctx, fs = case
        assert spec.profile is not None
        del spec.profile.extra_args[:]
        try:
            launch = plan(spec, node, ctx)
        except ProfileRefused:
            return
        problems = fs.check_argv(arguments(engine, launch.command.argv))
        assert problems == [], f"{fs.label} refuses the adapter's own argv {launch.command.argv}: {problems}"

    with mock.patch.object(base, "check_command_line", lambda fs, args: None):
        run()


@pytest.mark.parametrize("engine", FLAG_ENGINES)
def test_every_flag_file_is_reached(engine: str) -> None:
    """Each committed file is the one some installed version builds for, so the property above
    runs against every file, and a version between two files gets the older one's flags."""
    versions = flagsets.available(engine)
    assert versions
    for version in versions:
        assert flagsets.for_version(engine, version).version == version


def test_the_property_catches_an_adapter_that_emits_a_flag_the_version_lacks() -> None:
    """The check is not vacuous: vLLM 0.18.0's argv with a flag it has not got is refused by its
    flag set, and the same flag in extra_args is refused by plan."""
    fs = flagsets.for_version("vllm", "0.18.0")
    assert fs.check_argv(["m", "--no-such-option"]) == [
        "vLLM 0.18.0: unrecognized arguments: --no-such-option"
    ]
    profile = schema.EngineProfile(
        engine="vllm", model="m", served_model_name="m", extra_args=["--no-such-option"]
    )
    spec = schema.StartShard(
        shard_id="r1-s0", replica_id="r1", profile=profile, gpu_indices=[0], http_port=8001
    )
    gpu = GpuInfo(index=0, uuid="GPU-0", name="gpu", compute_capability=(9, 0), memory_total_mib=81559)
    with pytest.raises(ProfileRefused) as info:
        plan(spec, [gpu], LaunchContext(argv_prefix=("vllm",), engine_version="0.18.0"))
    assert str(info.value) == "vLLM 0.18.0: unrecognized arguments: --no-such-option"


def test_fleet_a_deprecated_quantization_is_refused_before_launch(tmp_path: Path) -> None:
    """A real control plane and agent on a node without GPUs, vLLM's command line run by the
    simulator (the ``sim`` engine builds vLLM's argv for the vLLM version it imitates, which the
    agent found at start): a profile asking for
    ``fbgemm_fp8`` without ``--allow-deprecated-quantization`` fails at the agent before anything is
    spawned, with vLLM's own words and the version in the shard's error (``ctl why --json``), while
    a plain profile runs on the same node."""
    tag = f"q{os.getpid()}"
    refused, plain = f"fbgemm-{tag}", f"plain-{tag}"
    version = flagsets.for_version("vllm", sim_version()).version
    profile = 'engine = "sim"\nmodel = "m"\nenv = { LLMGW_SIM_LOAD_SECONDS = "0.2" }'
    models = (
        f'[[models]]\nname = "{refused}"\n[models.profile]\n{profile}\nquantization = "fbgemm_fp8"\n'
        f'[[models]]\nname = "{plain}"\n[models.profile]\n{profile}\n'
    )
    with one_node(tmp_path, models, "23700-23799") as (cp, _):
        poll(
            f"{plain} ready",
            lambda: [r for r in cp.api("/api/replicas") if r["state"] == "ready"],
            timeout=60,
        )
        words = f"vLLM {version}: --quantization fbgemm_fp8 is deprecated and needs --allow-deprecated-quantization"

        def refused_with_reason() -> list[dict[str, object]]:
            doc = cp.api(f"/api/why/{refused}")
            return [s for r in doc["placed"] for s in r["shards"] if words in str(s.get("error", ""))]

        (shard,) = poll(f"{refused} failed with vLLM's words", refused_with_reason, timeout=30)
        assert shard["state"] == "failed", shard
        # The reason is in ctl why, as text and as JSON.
        for form in ((), ("--json",)):
            why = cp.ctl("why", refused, *form)
            assert why.returncode == 0, why.stderr
            assert words in why.stdout, why.stdout
        # Nothing was spawned for it, ever: no engine process names it.
        assert not sim_processes(refused)
        assert len(sim_processes(plain)) == 1


# ---------------------------------------------------------------------------------------------
# The extractors behind the SGLang, trtllm-serve and llama-server files, on small inputs of the
# shapes the engines have (the committed files are their output on the real ones).

LLAMA_HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
                                        (env: LLAMA_ARG_CTX_SIZE)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
--perf, --no-perf                       whether to enable internal libllama performance timings (default:
                                        false)
--cpu-strict <0|1>                      use strict CPU placement (default: 0)
-sm,   --split-mode {none,layer,row,tensor}
                                        how to split the model across multiple GPUs
--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft N
                                        number of layers to store in VRAM for the draft model

----- example-specific params -----

--api-key KEY                           API key to use for authentication
-c,    --ctx-size N                     printed again by another section: kept once
"""


def test_llamacpp_help_parser() -> None:
    from enginebuild.flags import llamacpp as extractor

    options = {o["flags"][0]: o for o in extractor.extract_help(LLAMA_HELP)}
    assert sorted(options) == [
        "--api-key",
        "--cpu-strict",
        "--perf",
        "--spec-draft-ngl",
        "-c",
        "-fa",
        "-h",
        "-sm",
    ]
    assert options["-c"]["flags"] == ["-c", "--ctx-size"] and options["-c"]["takes_value"]
    assert options["-fa"]["choices"] == ["on", "off", "auto"]
    assert options["-sm"]["choices"] == ["none", "layer", "row", "tensor"]
    assert options["--cpu-strict"]["choices"] == ["0", "1"]
    assert options["--perf"] == {
        "flags": ["--perf", "--no-perf"],
        "dest": "perf",
        "takes_value": False,
        "type": "bool",
        "nargs": None,
        "choices": None,
        "deprecated_choices": {},
    }
    assert options["--spec-draft-ngl"]["flags"] == [
        "--spec-draft-ngl",
        "-ngld",
        "--gpu-layers-draft",
        "--n-gpu-layers-draft",
    ]
    assert extractor.version_of("version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU") == "b1"
    with pytest.raises(ValueError, match="printed no"):
        extractor.version_of("version: 6432 (c4df49a4)")


CLICK_SOURCE = """
import click

LEVELS = {"info": 1, "debug": 2}


@click.command("other")
@click.option("--not-this", type=int)
def other(not_this):
    pass


@click.command("serve")
@click.argument("model", type=str)
@click.option("--tp_size", "--tensor_parallel_size", type=int, default=1)
@click.option("--config", "--extra_llm_api_options", "extra_llm_api_options", type=str)
@click.option("--backend", type=ChoiceWithAlias(["pytorch", "tensorrt"], {"trt": "tensorrt"}))
@click.option("--log_level", type=click.Choice(LEVELS.keys()))
@click.option("--parser", type=click.Choice(Registry.parsers.keys()))
@click.option("--trust_remote_code", is_flag=True, default=False)
@click.option("--fraction", type=float)
def serve(model, **kwargs):
    pass
"""


def test_trtllm_click_walker() -> None:
    from enginebuild.flags import trtllm as extractor

    options, positionals = extractor.extract_source(CLICK_SOURCE)
    assert positionals == [{"name": "model", "nargs": None}]
    by_flag = {o["flags"][0]: o for o in options}
    assert "--not-this" not in by_flag
    assert by_flag["--tp_size"]["dest"] == "tensor_parallel_size" and by_flag["--tp_size"]["type"] == "int"
    assert by_flag["--config"]["dest"] == "extra_llm_api_options"
    assert by_flag["--backend"]["choices"] == ["pytorch", "tensorrt", "trt"]
    assert by_flag["--log_level"]["choices"] == ["info", "debug"]
    assert by_flag["--parser"]["choices"] is None  # a run-time registry: any string, never a wrong refusal
    assert by_flag["--trust_remote_code"]["takes_value"] is False
    assert by_flag["--fraction"]["type"] == "float"


SERVER_ARGS = """
import argparse
import dataclasses

import torch  # stubbed: never imported for real
from sglang.srt.utils import SUPPORTED_MODULES, nullable_str

QUANTIZATION_CHOICES = ["awq", "fp8"]


class DeprecatedAction(argparse.Action):
    def __init__(self, option_strings, dest, nargs=0, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)


@dataclasses.dataclass
class ServerArgs:
    model_path: str = ""
    tp_size: int = 1

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=ServerArgs.tp_size)
        parser.add_argument("--quantization", type=str, choices=QUANTIZATION_CHOICES)
        parser.add_argument("--modules", type=str, nargs="*", choices=SUPPORTED_MODULES + ["all"])
        parser.add_argument("--tokenizer", type=nullable_str)
        parser.add_argument("--enable-metrics", action="store_true")
        if torch.cuda.is_available():
            parser.add_argument("--cuda-only", action="store_true")
        parser.add_argument("--old-flag", action=DeprecatedAction, help="gone")
"""


def test_sglang_runs_its_own_parser_with_imports_stubbed(tmp_path: Path) -> None:
    from enginebuild.flags import sglang as extractor

    (tmp_path / "sglang" / "srt" / "utils").mkdir(parents=True)
    (tmp_path / "sglang" / "srt" / "server_args.py").write_text(SERVER_ARGS)
    (tmp_path / "sglang" / "srt" / "utils" / "__init__.py").write_text(
        "from sglang.srt.utils.common import *\n"
    )
    (tmp_path / "sglang" / "srt" / "utils" / "common.py").write_text(
        'SUPPORTED_MODULES = ["q_proj", "k_proj"]\n'
    )
    options, positionals = extractor.options_of(extractor.build_parser(tmp_path))
    by_flag = {o["flags"][0]: o for o in options}
    assert positionals == []
    assert sorted(by_flag) == [
        "--enable-metrics",
        "--model-path",
        "--modules",
        "--quantization",
        "--tokenizer",
        "--tp-size",
        "-h",
    ]
    assert by_flag["--tp-size"]["flags"] == ["--tp-size", "--tensor-parallel-size"]
    assert by_flag["--quantization"]["choices"] == ["awq", "fp8"]
    # A literal from another module of the package, found in its source through a star re-export.
    assert (
        by_flag["--modules"]["choices"] == ["q_proj", "k_proj", "all"]
        and by_flag["--modules"]["nargs"] == "*"
    )
    assert by_flag["--tokenizer"]["type"] == "str"
    assert by_flag["--enable-metrics"]["takes_value"] is False
    assert "torch" not in sys.modules or not hasattr(sys.modules["torch"], "_stub_name")


# SGLang 0.5.23's layout in miniature: the options are annotated fields in sglang.srt.arg_groups,
# turned into add_argument calls by its own arg_utils (dataclasses here, msgspec Structs there).
SGLANG_ARG_GROUPS = {
    "srt/server_args.py": """
from sglang.srt.arg_groups.arg_utils import add_cli_args_from_dataclass
from sglang.srt.arg_groups.fields import Model
from sglang.srt.arg_groups.overrides import resolving_view  # a resolution hook: stubbed


class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        add_cli_args_from_dataclass(parser, Model)
""",
    "srt/arg_groups/__init__.py": "",
    "srt/arg_groups/overrides.py": "raise RuntimeError('a resolution hook must not run')\n",
    "srt/arg_groups/choices.py": "QUANTIZATION_CHOICES = ['awq', 'auto-round']\n",
    "srt/arg_groups/arg_utils.py": """
import dataclasses
from typing import Literal, get_args, get_origin, get_type_hints


def add_cli_args_from_dataclass(parser, cls):
    hints = get_type_hints(cls, include_extras=True)
    for field in dataclasses.fields(cls):
        inner, meta = get_args(hints[field.name])
        name = "--" + field.name.replace("_", "-")
        if get_origin(inner) is Literal:
            parser.add_argument(name, type=str, choices=list(get_args(inner)))
        elif inner is bool:
            parser.add_argument(name, action="store_true")
        else:
            parser.add_argument(name, type=meta.get("type_parser") or inner, choices=meta.get("choices"))
""",
    "srt/arg_groups/fields/__init__.py": """
import dataclasses
from typing import Annotated as A, Literal

from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.utils.common import human_readable_int


@dataclasses.dataclass
class Model:
    quantization: A[str, {"choices": QUANTIZATION_CHOICES}] = None
    context_length: A[int, {"type_parser": human_readable_int}] = None
    cuda_graph_backend: A[str, {"choices": Backend.ALL}] = "full"
    dtype: A[Literal["auto", "half"], {}] = "auto"
    trust_remote_code: A[bool, {}] = False
""",
    "srt/model_executor/cuda_graph_config.py": """
from sglang.srt.runtime_context import get_exec  # stubbed


class Backend:
    FULL = "full"
    BREAKABLE = "breakable"
    ALL = (FULL, BREAKABLE)
""",
    "srt/utils/common.py": "import torch\n\n\ndef human_readable_int(value):\n    return int(value)\n",
}


def test_sglang_arg_groups_layout_runs_its_field_modules_for_real(tmp_path: Path) -> None:
    from enginebuild.flags import sglang as extractor

    for name, text in SGLANG_ARG_GROUPS.items():
        (tmp_path / "sglang" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sglang" / name).write_text(text)
    options, _ = extractor.options_of(extractor.build_parser(tmp_path))
    by_flag = {o["flags"][0]: o for o in options}
    assert sorted(by_flag) == [
        "--context-length",
        "--cuda-graph-backend",
        "--dtype",
        "--quantization",
        "--trust-remote-code",
        "-h",
    ]
    assert by_flag["--quantization"]["choices"] == ["awq", "auto-round"]
    assert by_flag["--cuda-graph-backend"]["choices"] == ["full", "breakable"]  # a class attribute
    assert by_flag["--dtype"]["choices"] == ["auto", "half"]
    # A stubbed module's function is kept by ``type_parser or int``: "32k" is a valid length.
    assert by_flag["--context-length"]["type"] == "str"
    assert by_flag["--trust-remote-code"]["takes_value"] is False
    assert not any(name.startswith("sglang") for name in sys.modules)


def test_a_vllm_without_its_graceful_flag_is_not_trusted_to_drain_and_the_sim_follows_its_version() -> None:
    """plan's stop behaviour follows the argv it built: a vLLM older than --shutdown-timeout aborts on
    SIGTERM, so the supervisor must wait for in-flight requests itself. And the simulator takes the
    choices of the vLLM version it imitates on the node, not the oldest file's."""
    gpu = GpuInfo(index=0, uuid="GPU-0", name="gpu", compute_capability=(9, 0), memory_total_mib=81559)

    def launch(engine: str, version: str, quantization: str = "", grace: float = 30.0) -> object:
        profile = schema.EngineProfile(
            engine=engine, model="m", served_model_name="m", quantization=quantization
        )
        spec = schema.StartShard(
            shard_id="r1-s0", replica_id="r1", profile=profile, gpu_indices=[0], http_port=8001
        )
        ctx = LaunchContext(argv_prefix=(engine,), engine_version=version, shutdown_timeout_seconds=grace)
        return plan(spec, [gpu], ctx)

    new, old = launch("vllm", "0.18.0"), launch("vllm", "0.17.1")
    assert "--shutdown-timeout" in new.command.argv and new.stop.drains_in_flight  # type: ignore[attr-defined]
    assert "--shutdown-timeout" not in old.command.argv and not old.stop.drains_in_flight  # type: ignore[attr-defined]
    only_new = sorted(
        set(union_choices("vllm", "--quantization"))
        - set(own_choices("vllm", flagsets.for_version("vllm", "0.18.0"), "--quantization"))
    )
    assert only_new, "vLLM 0.33.0 has quantization methods 0.18.0 lacks"
    newest = flagsets.available("vllm")[-1]
    quant = next(
        q
        for q in only_new
        if q in own_choices("vllm", flagsets.for_version("vllm", newest), "--quantization")
    )
    accepted = launch("sim", newest, quantization=quant)
    assert quant in accepted.command.argv  # type: ignore[attr-defined]
    with pytest.raises(ProfileRefused):
        launch("sim", "0.18.0", quantization=quant)
