"""Engine versions per node: detection against real commands, placement by a version constraint,
and a whole fleet where a model asks for a version no node has.

Detection runs real programs: small scripts on a PATH of the test's own (one prints a version, one
hangs with a child holding its pipes, one fails), a Python interpreter reading a real package's
metadata, the simulator's own ``--version``, and llama.cpp's ``llama-server`` when it is built.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from pathlib import Path

import pytest
import trio

from agent.engines import versions
from agent.engines.versions import Installed, Probe, plan_probe, read_version
from tests.fleet_procs import free_port, one_node, poll, sim_processes, sim_version
from tests.support import processes


@functools.cache
def _script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory first on PATH, for engine commands the test writes."""
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ.get('PATH', '')}")
    return d


def _detect(engine: str, argv: tuple[str, ...], timeout: float = versions.TIMEOUT) -> Installed:
    return trio.run(versions.detect_one, engine, argv, timeout)


def test_version_command_on_path(bin_dir: Path) -> None:
    _script(bin_dir, "vllm", 'echo "0.17.1"')
    assert _detect("vllm", ("vllm",)) == Installed("vllm", version="0.17.1")


def test_missing_binary_says_command_not_found(bin_dir: Path) -> None:
    found = _detect("vllm", ("llmgw-no-such-engine",))
    assert found == Installed("vllm", error="llmgw-no-such-engine: command not found")


def test_failing_version_command_is_one_line_with_status(bin_dir: Path) -> None:
    _script(
        bin_dir,
        "trtllm-serve",
        'echo "Traceback (most recent call last):" >&2\necho "ImportError: libcudart.so.12" >&2\nexit 3',
    )
    found = _detect("trtllm", ("trtllm-serve",))
    assert found.version == ""
    assert found.error == "`trtllm-serve --version` exited with status 3: ImportError: libcudart.so.12"
    assert "\n" not in found.error


def test_hanging_version_command_is_bounded_and_leaves_nothing(bin_dir: Path, tmp_path: Path) -> None:
    """A version command that never answers, with a child holding its output pipe: the agent moves
    on at the deadline, and the whole process group is gone (no child left holding the pipe)."""
    marker = f"llmgw-hang-{os.getpid()}"
    _script(bin_dir, "llama-server", f'{sys.executable} -c "import time; time.sleep(300)" {marker}\n')
    started = time.monotonic()
    found = _detect("llamacpp", ("llama-server",), timeout=1.0)
    took = time.monotonic() - started
    assert found == Installed("llamacpp", error="`llama-server --version` did not answer within 1 s")
    assert took < 4.0, f"detection took {took:.1f} s with a 1 s deadline"
    # SIGKILL went to the whole group at the deadline; the kernel ends the child asynchronously (on a
    # loaded machine it may still be exiting a moment later), so wait for it with a short deadline.
    poll(
        "the hanging command's child to be gone after the deadline",
        lambda: not _processes_naming(marker),
        5.0,
    )


def _processes_naming(marker: str) -> list[int]:
    return processes(lambda argv: any(marker.encode() in arg for arg in argv))


def test_agent_secrets_never_reach_a_version_command(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_AGENT_TOKEN", "s3cret")
    _script(
        bin_dir,
        "vllm",
        'if [ -n "$LLMGW_AGENT_TOKEN" ]; then echo "saw the token" >&2; exit 1; fi\necho 0.18.0',
    )
    assert _detect("vllm", ("vllm",)) == Installed("vllm", version="0.18.0")


def test_python_engine_version_from_package_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PYTHON -m sglang.launch_server``: the interpreter the argv names reads the package's own
    metadata (no import of the engine, which would take torch and CUDA)."""
    site = tmp_path / "site"
    dist = site / "sglang-0.5.4.post1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.4.post1\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    found = _detect("sglang", (sys.executable, "-m", "sglang.launch_server"))
    assert found == Installed("sglang", version="0.5.4.post1")


def test_python_engine_not_installed_for_its_interpreter(tmp_path: Path) -> None:
    found = _detect("sglang", (sys.executable, "-m", "sglang.launch_server"))
    assert found.version == ""
    assert found.error == f"sglang not installed: no package 'sglang' in {sys.executable}"


def test_console_script_version_from_its_interpreter(
    bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm`` as pip installs it, a script whose ``#!`` names its venv's Python: that Python's
    metadata answers (``vllm --version`` would import torch first)."""
    site = tmp_path / "site"
    dist = site / "vllm-0.33.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    script = bin_dir / "vllm"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('imported the engine: too slow')\n")
    script.chmod(0o755)
    assert _detect("vllm", ("vllm",)) == Installed("vllm", version="0.33.0")


def test_an_engine_behind_a_container_runtime_is_not_probed(bin_dir: Path, tmp_path: Path) -> None:
    """``docker run ... IMAGE`` plus ``--version`` would start a container that outlives the
    probe's deadline; the agent says why it has no version instead of running it."""
    ran = tmp_path / "ran"
    _script(bin_dir, "docker", f"touch {ran}")
    found = _detect("vllm", ("docker", "run", "--rm", "vllm/vllm-openai:v0.18.0"))
    assert found == Installed(
        "vllm", error="not probed: vllm runs through docker, and a probe would start a container"
    )
    assert not ran.exists()


def test_sim_reports_the_vllm_version_it_imitates() -> None:
    found = _detect("sim", (sys.executable, "-m", "agent.engines.sim"))
    assert found == Installed("sim", version=sim_version())
    assert re.fullmatch(r"\d+\.\d+\.\d+", found.version), found.version
    # The simulator standing in for vLLM (as the demo and fleet tests run it) reports the same.
    assert _detect("vllm", (sys.executable, "-m", "agent.engines.sim")).version == sim_version()


def test_all_engines_at_once_within_one_deadline(bin_dir: Path) -> None:
    _script(bin_dir, "vllm", "echo 0.18.0")
    _script(bin_dir, "trtllm-serve", "exec sleep 300")
    started = time.monotonic()
    found = trio.run(
        versions.detect,
        [("vllm", ("vllm",)), ("trtllm", ("trtllm-serve",)), ("llamacpp", ("llmgw-no-such-server",))],
        1.0,
    )
    assert time.monotonic() - started < 4.0
    assert [f.engine for f in found] == ["vllm", "trtllm", "llamacpp"]
    assert found[0].version == "0.18.0"
    assert "did not answer within 1 s" in found[1].error
    assert found[2].error == "llmgw-no-such-server: command not found"


def test_llama_server_built_here() -> None:
    from enginebuild import llamacpp as enginebuild

    built = enginebuild.installed()
    if built is None:
        pytest.skip("llama-server not built: run `nox -s engines`")
    found = _detect("llamacpp", (str(built.server),))
    assert found.error == ""
    assert re.fullmatch(r"b\d+", found.version), found.version


@pytest.mark.parametrize(
    ("output", "version"),
    [
        ("version: 6432 (c4df49a4)\nbuilt with cc (GCC) 13.2 for x86_64-linux-gnu\n", "b6432"),
        ("version: 0.5.0-dev (build 7002, commit 0c1e570)\n", "b7002"),
        # A tree without git history counts one commit; still the key its flag file has.
        ("version: 0.5.0-dev (build 1, commit 0c1e570)\n", "b1"),
    ],
)
def test_llamacpp_version_lines(output: str, version: str) -> None:
    assert read_version(Probe(("llama-server", "--version"), "llamacpp"), "", output) == version


def test_probe_plans() -> None:
    py = sys.executable
    assert plan_probe("sglang", (py, "-m", "sglang.launch_server"), None).reads == "metadata"
    assert plan_probe("sim", (py, "-m", "agent.engines.sim"), None).argv == (
        py,
        "-m",
        "agent.engines.sim",
        "--version",
    )
    assert plan_probe("vllm", ("vllm",), ("/opt/v/bin/python",)).argv[0] == "/opt/v/bin/python"
    assert plan_probe("vllm", ("vllm",), None).argv == ("vllm", "--version")
    assert read_version(Probe(("x",), "text"), "vllm version 0.18.1rc2\n", "") == "0.18.1rc2"


def test_fleet_a_model_asking_for_a_version_no_node_has_is_explained_and_never_started(
    tmp_path: Path,
) -> None:
    """A real control plane and agent: the agent reports the versions it found (the sim's imitated
    vLLM, a llama-server that is not there), ``ctl nodes`` shows them, a model that asks for sim
    ``>=99`` is explained with the node's actual version and nothing is spawned for it, while a
    model without a constraint runs on the same node."""
    tag = f"v{os.getpid()}"
    wanted, plain = f"new-{tag}", f"ok-{tag}"
    profile = 'engine = "sim"\nmodel = "m"\nenv = { LLMGW_SIM_LOAD_SECONDS = "0.2" }'
    models = (
        f'[[models]]\nname = "{wanted}"\n[models.profile]\n{profile}\nengine_version = ">=99"\n'
        f'[[models]]\nname = "{plain}"\n[models.profile]\n{profile}\n'
    )
    with one_node(tmp_path, models, "23800-23899", engines="llamacpp=llmgw-no-such-llama-server") as (cp, _):
        poll(
            f"{plain} ready",
            lambda: [r for r in cp.api("/api/replicas") if r["state"] == "ready"],
            timeout=60,
        )

        why = cp.ctl("why", wanted)
        assert why.returncode == 0, why.stderr
        assert f"      gpu07: sim {sim_version()} does not satisfy >=99" in why.stdout, why.stdout
        assert "0/1 nodes are available: 1 do not have sim >=99." in why.stdout

        nodes = cp.ctl("nodes")
        assert nodes.returncode == 0, nodes.stderr
        row = next(line for line in nodes.stdout.splitlines() if line.startswith("gpu07"))
        assert f"vllm {sim_version()}" in row and f"sim {sim_version()}" in row
        assert "missing: " in row and "llamacpp" in row.split("missing: ", 1)[1]
        (node,) = cp.api("/api/nodes")
        reported = {e["engine"]: e for e in node["engines"]}
        assert reported["llamacpp"] == {
            "engine": "llamacpp",
            "version": "",
            "error": "llmgw-no-such-llama-server: command not found",
        }

        # Nothing was started for the constrained model: no placement, no engine naming it.
        assert not [r for r in cp.api("/api/replicas") if r["model"] == wanted and r["shards"]]
        assert not sim_processes(wanted)
        assert len(sim_processes(plain)) == 1


async def test_the_agent_builds_every_launch_context_with_the_version_it_found(
    tmp_path: Path, bin_dir: Path
) -> None:
    """The real agent root (``run_agent``): its supervisor's launch contexts carry each engine's
    version as found at start ("" for one that is missing), before any session exists."""
    from agent.config import AgentConfig
    from agent.discovery import Inventory
    from agent.nursery import run_agent

    _script(bin_dir, "vllm", "echo 0.17.1")
    config = AgentConfig(
        node_id="gpu07",
        server=f"http://127.0.0.1:{free_port()}",  # nothing listens: the sessions just retry
        mgmt_addr="127.0.0.1",
        state_dir=tmp_path / "state",
        engines={"vllm": "vllm", "llamacpp": "llmgw-no-such-llama-server"},
    )
    async with trio.open_nursery() as nursery:
        supervisor = await nursery.start(run_agent, config, Inventory(source="static"))
        assert supervisor.launch_context("vllm").engine_version == "0.17.1"
        assert supervisor.launch_context("sim").engine_version == sim_version()
        assert supervisor.launch_context("llamacpp").engine_version == ""
        nursery.cancel_scope.cancel()
