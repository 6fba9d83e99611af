"""The engine descriptors: each one is complete, and every list of engines in the tree is theirs.

A new engine is its adapter, its descriptor and its flag files; these tests are what tells whoever
adds one what is missing, instead of a test that keeps two hand-written lists equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import enginedefs
from agent.config import AgentConfig
from agent.engines import ENGINES, flagsets, versions
from agent.supervise import probes
from control.config import engine_problem
from enginebuild.flags import EXTRACTORS

DESCRIPTORS = {d.name: d for d in enginedefs.DESCRIPTORS}
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(DESCRIPTORS))
def test_each_descriptor_has_an_adapter_flag_files_and_a_version_probe(name: str) -> None:
    d = DESCRIPTORS[name]
    # Its adapter, loaded from the import path, is the engine it says.
    assert ENGINES[name].name == name
    assert d.label and d.default_command()
    # Flag files to check its command line: its own (written by its extractor) or the ones of the
    # engine it imitates.
    fs = flagsets.for_version(d.flags, "")
    assert fs.engine == d.flags and fs.label.startswith(enginedefs.label(d.flags))
    if d.flags == name:
        assert d.extractor and EXTRACTORS[name].VERSIONS, f"{name}: no extractor writes its flag files"
    else:
        assert not d.extractor
    # A version probe for the command a node runs it with.
    argv = tuple(d.default_command().split())
    probe = versions.plan_probe(name, argv, None)
    assert probe.argv[0] == argv[0] and probe.reads in ("metadata", "text", "llamacpp")
    # The key options it names exist in every one of its flag files (an engine version without
    # them would get a key it cannot enforce, or an option it refuses).
    if d.key is not None:
        for version in flagsets.available(d.flags):
            fs = flagsets.for_version(d.flags, version)
            for flag in (d.key.flag, d.key.file_flag, d.key.config_flag):
                if flag:
                    assert fs.option(flag) is not None, f"{fs.label} has no {flag}"
    # What it publishes: a metrics path, and in-flight gauges that the drain reads.
    assert d.publishes.metrics_path.startswith("/")
    for gauge in d.publishes.in_flight:
        assert probes.IN_FLIGHT.search(f"{gauge} 3\n".encode()) is not None


def test_every_list_of_engines_is_the_descriptors() -> None:
    names = [d.name for d in enginedefs.DESCRIPTORS]
    assert list(ENGINES) == names
    assert sorted(AgentConfig(node_id="n", server="http://cp:1").engines) == sorted(names)
    assert all(engine_problem(n) == "" for n in names)
    assert set(EXTRACTORS) == set(enginedefs.FLAG_ENGINES)
    assert set(versions.PACKAGES) == {d.name for d in enginedefs.DESCRIPTORS if d.version.package}


def test_the_facts_the_control_plane_acts_on() -> None:
    # trtllm-serve has no key option and no served-name option; every other engine has both.
    assert [d.name for d in enginedefs.DESCRIPTORS if not enginedefs.takes_key(d.name)] == ["trtllm"]
    assert [d.name for d in enginedefs.DESCRIPTORS if not enginedefs.renames(d.name)] == ["trtllm"]
    assert enginedefs.model_names("/models/llama-8b/") == ("/models/llama-8b/", "llama-8b")
    assert enginedefs.model_names("meta-llama/Llama-3.1-8B") == ("meta-llama/Llama-3.1-8B",)
    known = ", ".join(enginedefs.NAMES)
    assert (
        enginedefs.unknown_engine("vlm")
        == f"unknown engine 'vlm'; did you mean 'vllm'? known engines: {known}"
    )
    assert enginedefs.unknown_engine("tgi") == f"unknown engine 'tgi'; known engines: {known}"


def test_a_key_has_one_place_besides_the_command_line() -> None:
    with pytest.raises(ValueError, match="at most one of env, file_flag, config_flag"):
        enginedefs.ApiKey(env="X_KEY", file_flag="--key-file")
    assert enginedefs.ApiKey().on_command_line
    assert not enginedefs.ApiKey(env="VLLM_API_KEY").on_command_line


#: A new engine for the test below: an adapter module of its own (the sim's functions under another
#: name) and nothing else.
ECHO_ADAPTER = """
import attrs
from agent.engines import sim

ENGINE = attrs.evolve(sim.ENGINE, name="echo")
"""

ECHO_DESCRIPTOR = (
    '    EngineDescriptor(name="echo", label="Echo", adapter="echo_engine:ENGINE", '
    'command="{python} -m agent.engines.sim", flags="vllm", extractor="", version=VersionProbe(), '
    'key=None, renames=False, publishes=Publishes(in_flight=("echo:requests_running",))),\n'
)

ECHO_CHECK = """
import schema
from agent.config import AgentConfig
from agent.engines import ENGINES, LaunchContext, plan
from agent.supervise import probes
from control.config import engine_problem
import enginedefs

assert "echo" in ENGINES and "echo" in AgentConfig(node_id="n", server="http://cp:1").engines
assert engine_problem("echo") == "" and not enginedefs.takes_key("echo") and not enginedefs.renames("echo")
assert probes.IN_FLIGHT.search(b"echo:requests_running 2\\n") is not None
profile = schema.EngineProfile(engine="echo", model="m", served_model_name="m")
spec = schema.StartShard(shard_id="e1", profile=profile, http_port=8001)
launch = plan(spec, [], LaunchContext(argv_prefix=("echo-server",)))
assert launch.engine == "echo" and launch.command.argv[:3] == ("echo-server", "serve", "m"), launch
print("ok")
"""


def test_a_new_engine_is_an_adapter_and_a_descriptor(tmp_path: Path) -> None:
    """Add a descriptor (in a copy of ``enginedefs``) and an adapter module, touch nothing else: the
    agent runs the engine, its config and the control plane's accept its name, its key and rename
    rules hold, the drain reads its gauge."""
    source = (REPO / "enginedefs" / "__init__.py").read_text()
    anchor = "\n)\n\nBY_NAME"
    assert source.count(anchor) == 1, "the DESCRIPTORS tuple ends where this test expects"
    (tmp_path / "enginedefs").mkdir()
    (tmp_path / "enginedefs" / "__init__.py").write_text(source.replace(anchor, ECHO_DESCRIPTOR + anchor[1:]))
    (tmp_path / "echo_engine.py").write_text(ECHO_ADAPTER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO)))}
    done = subprocess.run(
        [sys.executable, "-c", ECHO_CHECK],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
