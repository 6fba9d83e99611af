"""GPU usage from heartbeats to ``ctl describe node``, on a node whose discovery went through
``nvidia-smi`` (no NVML): the agent reads memory used and utilization with nvidia-smi at every
heartbeat, and the control plane shows each GPU's latest figures with the shards placed on it.

The nvidia-smi here is a stand-in script run for real by the real agent; it prints the recorded
H200 outputs (``tests/fixtures/nvidia-smi``) and the memory used that the test writes to a file, so
the test can change what the GPU "uses" and watch the change arrive.
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet_procs import Agent, ControlProcess, free_port, poll

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"
MODEL = "usage-chat"

FAKE = """#!{python}
import sys
args = sys.argv[1:]
fixtures = {fixtures!r}
used_file = {used!r}
if args and args[0].startswith("--query-gpu="):
    fields = args[0].split("=", 1)[1].split(",")
    if fields == ["index", "memory.used", "utilization.gpu"]:
        used, util = open(used_file).read().split()
        print(f"0, {{used}}, {{util}}")
        sys.exit(0)
    sys.stdout.write(open(fixtures + "/query-gpu-h200-1x.csv").read())
elif args == ["topo", "-m"]:
    sys.stdout.write(open(fixtures + "/topo-h200-1x.txt").read())
elif args == ["--version"]:
    sys.stdout.write(open(fixtures + "/version-h200.txt").read())
else:
    sys.exit(99)
"""


def nvml_loads() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ControlProcess, Agent, Path]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    used = tmp_path / "used"
    used.write_text("1024 0\n")
    fake = bin_dir / "nvidia-smi"
    fake.write_text(FAKE.format(python=sys.executable, fixtures=str(FIXTURES), used=str(used)))
    fake.chmod(0o755)
    cp = ControlProcess(
        tmp_path / "cp",
        f"""
state_dir = "{tmp_path / "cp" / "state"}"
reconcile_interval = 0.3
[listen]
agents = "127.0.0.1:{free_port()}"
api = "127.0.0.1:0"
router = ""
[engines]
ports = "20000-29999"
[[models]]
name = "{MODEL}"
[models.gpus]
count = 1
min_memory_gib = 130
[models.profile]
engine = "vllm"
model = "Qwen/Qwen2.5-0.5B-Instruct"
env = {{ LLMGW_SIM_LOAD_SECONDS = "0.2" }}
""",
    )
    agent = Agent(
        tmp_path,
        "h200-node",
        "http://127.0.0.1:0",
        None,
        "ib-a:mlx5_0:1",
        "127.0.0.1",
        extra=("--engine-ports", "20000-29999"),
    )
    try:
        cp.start()
        agent.argv[agent.argv.index("--server") + 1] = f"http://127.0.0.1:{cp.agent_port}"
        agent.start(env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
        yield cp, agent, used
    finally:
        agent.stop_all()
        cp.terminate()


@pytest.mark.skipif(nvml_loads(), reason="NVML loads here, and discovery prefers it to nvidia-smi")
def test_heartbeat_usage_through_nvidia_smi_reaches_describe_node(
    fleet: tuple[ControlProcess, Agent, Path],
) -> None:
    cp, _agent, used = fleet

    def ready_shard() -> str | None:
        for replica in cp.api("/api/replicas"):
            for shard in replica["shards"]:
                if replica["model"] == MODEL and shard["state"] == "ready":
                    return str(shard["shard_id"])
        return None

    shard_id = poll("the model ready on the H200 node", ready_shard, timeout=60)
    (gpu,) = cp.api("/api/nodes/h200-node")["gpu_devices"]
    assert gpu["name"] == "NVIDIA H200" and gpu["memory_total_mib"] == 143771, gpu
    assert gpu["shards"] == [shard_id]

    # The engine's allocation as nvidia-smi would see it: the next heartbeats carry it.
    used.write_text("131072 87\n")

    def described() -> str | None:
        out = cp.ctl("describe", "node", "h200-node").stdout
        return out if "128.0/140.4 GiB" in out else None

    out = poll("describe node to show the new memory used", described, timeout=30)
    section = out.split("GPU devices:\n", 1)[1].splitlines()
    header, row = section[0].split(), section[1].split()
    assert header == ["GPU", "NAME", "MEMORY", "UTIL", "NVLINK", "BUS", "SHARDS"], section
    assert row[0] == "0" and "128.0/140.4" in row and "87%" in row and row[-1] == shard_id, row
    doc = json.loads(cp.ctl("describe", "node", "h200-node", "-o", "json").stdout)
    assert doc["gpu_devices"][0]["memory_used_mib"] == 131072
    assert doc["gpu_devices"][0]["utilization_percent"] == 87
