"""``python -m demo``: the whole system on one machine without GPUs.

It starts the control plane (``python -m control``) with an embedded catalog, two node agents
(``python -m agent``) with static inventories (an 8x H100 node and a 4x L40S node), whose vLLM
profiles run on the ``sim`` engine through the real vLLM adapter; waits, showing progress, until the
replicas are ready; streams a chat completion through the router with the ``openai`` client; prints
``ctl get nodes -o wide``, ``ctl get models`` and ``ctl get replicas -o wide``; and exits cleanly, ending every process it started (engines
included: they outlive agents by design). ``--serve`` keeps everything running and says where the
router listens.

``--engine llamacpp`` runs the same story on a real engine: llama.cpp's ``llama-server`` (built once
from the pinned sdist into ``~/.cache/llmgw/llama.cpp/``, about 15 minutes on 2 cores, by the same
``enginebuild`` module ``nox -s engines`` uses) loading a tiny random-weight llama, on two agents
with CPU-only inventories, so the streamed tokens are the engine's own (and nonsense).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx
import openai

from agent.supervise import procfs

MODEL = "llama-3.1-8b-instruct"

#: The control plane's settings and one model of two replicas, a ``str.format`` template (state,
#: agents, api, router, model and, for llama.cpp, gguf); ``{placement}`` is where each engine's
#: catalog differs (the GPUs a replica needs and its profile), filled in by :func:`_catalog`.
_CATALOG = """
state_dir = "{state}"
reconcile_interval = 0.5
[listen]
agents = "127.0.0.1:{agents}"
api = "127.0.0.1:{api}"
router = "127.0.0.1:{router}"
[engines]
ports = "21000-21999"
[liveness]
unreachable_after = 6
lost_after = 60

[[models]]
name = "{model}"
replicas = 2
ready_timeout = 120
{placement}"""


def _catalog(placement: str) -> str:
    """The demo's catalog template with one engine's GPUs and profile in it (still a template)."""
    return _CATALOG.replace("{placement}", placement)


#: The simulated catalog: two replicas of a vLLM model, two GPUs each.
CATALOG = _catalog(
    """[models.gpus]
count = 2
min_memory_gib = 40
[models.profile]
engine = "vllm"
model = "meta-llama/Llama-3.1-8B-Instruct"
tensor_parallel_size = 2
dtype = "bfloat16"
max_model_len = 8192
env = {{ LLMGW_SIM_LOAD_SECONDS = "3", LLMGW_SIM_TTFT_MS = "40", LLMGW_SIM_ITL_MS = "25" }}
"""
)


def inventory(name: str, count: int, memory_mib: int, cc: str) -> str:
    lines = ['driver_version = "550.54.15"', 'cuda_version = "12.4"', ""]
    for i in range(count):
        peers = [j for j in range(count) if j != i] if "H100" in name else []
        lines += [
            "[[gpus]]",
            f"index = {i}",
            f'uuid = "GPU-demo-{name[-5:]}-{i}"',
            f'name = "{name}"',
            f'compute_capability = "{cc}"',
            f"memory_total_mib = {memory_mib}",
            f"nvlink_peers = {peers}",
            "",
        ]
    return "\n".join(lines)


NODES = [
    (
        "gpu01",
        "127.0.0.1",
        inventory("NVIDIA H100 80GB HBM3", 8, 81559, "9.0"),
        "ib-a:mlx5_0:1",
        "21000-21099",
    ),
    ("gpu02", "127.0.0.2", inventory("NVIDIA L40S", 4, 46068, "8.9"), "ib-a:mlx5_0:1", "21100-21199"),
]


TINY_MODEL = "tiny-llama"

#: The real-engine catalog: one CPU-only replica per node, llama-server loading the tiny GGUF.
LLAMACPP_CATALOG = _catalog(
    """[models.gpus]
count = 0
[models.profile]
engine = "llamacpp"
model = "{gguf}"
max_model_len = 512
extra_args = ["--threads", "1"]
"""
)

CPU_ONLY = "# A node without GPUs: llama.cpp runs on its CPU.\ngpus = []\n"


class Setup(NamedTuple):
    """What differs between the demo's engines: the model, the catalog, the nodes, the binaries."""

    model: str
    catalog: str
    #: (node id, mgmt address, inventory TOML, fabrics, engine ports)
    nodes: list[tuple[str, str, str, str, str]]
    engines: str
    gguf: str = ""


SIM = Setup(MODEL, CATALOG, NODES, f"vllm={sys.executable} -m agent.engines.sim")


def llamacpp_setup() -> Setup:
    """The cached llama-server and tiny model, built first when absent (that takes a while)."""
    from enginebuild import llamacpp as enginebuild

    built = enginebuild.installed()
    if built is None:
        say(
            f"llama-server is not built yet: building it from llama-cpp-python {enginebuild.VERSION} "
            f"into {enginebuild.cache().root} ({enginebuild.BUILD_TIME_HINT}, once)"
        )
        try:
            built = enginebuild.ensure(say=lambda text: say(f"engines | {text}"))
        except enginebuild.BuildError as exc:
            raise SystemExit(f"demo: cannot build llama-server: {exc}") from exc
        except ImportError as exc:
            raise SystemExit(
                f"demo: writing the tiny model needs the gguf package ({exc}): "
                "pip install -e '.[engines]', or run nox -s demo -- --engine llamacpp"
            ) from exc
    say(f"engine: {built.server}")
    say(f"model: {built.model} (random weights: the tokens are real, the text is nonsense)")
    nodes = [
        ("cpu01", "127.0.0.1", CPU_ONLY, "", "21000-21099"),
        ("cpu02", "127.0.0.2", CPU_ONLY, "", "21100-21199"),
    ]
    return Setup(TINY_MODEL, LLAMACPP_CATALOG, nodes, f"llamacpp={built.server}", gguf=str(built.model))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def say(text: str) -> None:
    print(f"demo | {text}", flush=True)


class Demo:
    def __init__(self, workdir: Path, router_port: int, setup: Setup = SIM) -> None:
        self.workdir = workdir
        self.setup = setup
        self.model = setup.model
        self.procs: list[subprocess.Popen[bytes]] = []
        self.api_port = free_port()
        self.agent_port = free_port()
        self.router_port = router_port or free_port()
        #: The admin API's token; empty: the demo's API has none and answers loopback clients only.
        self.api_token = ""

    def spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        config = self.workdir / "llmgw.toml"
        config.write_text(
            self.setup.catalog.format(
                state=self.workdir / "control-state",
                agents=self.agent_port,
                api=self.api_port,
                router=self.router_port,
                model=self.model,
                gguf=self.setup.gguf,
            )
        )
        self.spawn([sys.executable, "-m", "control", "--config", str(config)], self.workdir / "control.log")
        self.wait(
            "the control plane",
            lambda: "llmgw control plane ready" in (self.workdir / "control.log").read_text(),
        )
        say(
            f"control plane up: agents on :{self.agent_port}, admin API on :{self.api_port}, router on :{self.router_port}"
        )
        # The agents join with the cluster's join token, which the control plane created in its
        # state directory (`ctl token` prints it); passed in the environment, not on the command line.
        token_file = self.workdir / "control-state" / "join-token"
        env = {**os.environ}
        if token_file.exists():
            env["LLMGW_AGENT_TOKEN"] = token_file.read_text().strip()
        for node_id, addr, inv, fabric, ports in self.setup.nodes:
            node_dir = self.workdir / node_id
            node_dir.mkdir()
            (node_dir / "inventory.toml").write_text(inv)
            self.spawn(
                [
                    sys.executable, "-m", "agent", "--node-id", node_id,
                    "--server", f"http://127.0.0.1:{self.agent_port}",
                    "--inventory", str(node_dir / "inventory.toml"),
                    "--state-dir", str(node_dir), "--mgmt-addr", addr, "--fabrics", fabric,
                    "--engine-ports", ports, "--heartbeat-interval", "1", "--stop-grace", "5",
                    "--engines", self.setup.engines,
                ],
                node_dir / "agent.log",
                env,
            )  # fmt: skip
            say(f"agent {node_id} started ({addr}, inventory: {inv.count('[[gpus]]')} GPUs)")

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"demo: timed out after {timeout:g} s waiting for {what}; logs in {self.workdir}"
                )
            for proc in self.procs:
                if proc.poll() is not None:
                    raise SystemExit(f"demo: a process exited early ({proc.args!r}); logs in {self.workdir}")
            time.sleep(0.2)

    def api(self, path: str) -> object:
        return httpx.get(f"http://127.0.0.1:{self.api_port}{path}", timeout=10).json()

    def wait_ready(self) -> None:
        last = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            replicas = self.api("/api/replicas")
            assert isinstance(replicas, list)
            states = [f"{r['replica_id']}: {'/'.join(s['state'] for s in r['shards'])}" for r in replicas]
            if not replicas:
                why = self.api(f"/api/why/{self.model}")
                assert isinstance(why, dict)
                states = [u["reason"] for u in why["unplaced"][:1]] or ["placing"]
            ready = sum(r["state"] == "ready" for r in replicas)
            line = f"waiting for replicas: {ready}/2 ready ({', '.join(states) or 'placing'})"
            if line != last:
                say(line)
                last = line
            if ready == 2:
                return
            time.sleep(0.3)
        raise SystemExit(f"demo: replicas not ready within 120 s; logs in {self.workdir}")

    def chat(self) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.router_port}/v1", api_key="demo")
        say(f"POST /v1/chat/completions via the router (model {self.model}, streaming):")
        print("    ", end="", flush=True)
        stream = client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Say hello to the fleet."}],
            stream=True,
            max_tokens=24,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print(flush=True)

    def ctl(self, *args: str) -> None:
        say(f"python -m control ctl {' '.join(args)}")
        out = subprocess.run(
            [sys.executable, "-m", "control", "ctl", "--api", f"http://127.0.0.1:{self.api_port}", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        print(out.stdout.rstrip() or out.stderr.rstrip(), flush=True)

    def stop(self) -> None:
        """End what the demo started: agents and control plane, then the engines they left running."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        # Engines outlive their agents by design; each carries its agent's marker (agent.supervise.procfs),
        # so they are found in /proc even where a record was never finished.
        owners = {os.path.abspath(d.parent) for d in self.workdir.glob("*/shards")}
        engines = [e.pid for owner in owners for e in procfs.find_engines(owner)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in engines:
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while engines and time.monotonic() < deadline:
                engines = [pid for pid in engines if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
                time.sleep(0.1)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def ctl_lines(api: str, token: str = "") -> list[str]:
    """What another shell needs for ``ctl`` to reach this demo's admin API, as lines to paste: the
    API's address, its token when it has one, and a first command with this interpreter (the
    shell's own ``python`` may not have llmgw installed)."""
    lines = [f"export LLMGW_API={shlex.quote(api)}"]
    if token:
        lines.append(f"export LLMGW_API_TOKEN={shlex.quote(token)}")
    lines.append(f"{shlex.quote(sys.executable)} -m control ctl get nodes -o wide")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description="llmgw demo: control plane, two agents, engines, router")
    parser.add_argument("--serve", action="store_true", help="keep serving after the demo (Ctrl-C to stop)")
    parser.add_argument("--router-port", type=int, default=0, help="router port (default: a free one)")
    parser.add_argument(
        "--engine",
        choices=("sim", "llamacpp"),
        default="sim",
        help="sim: vLLM profiles on the engine simulator (default); llamacpp: real llama-server "
        "engines on CPU (built into ~/.cache/llmgw/llama.cpp/ first if absent, about 15 min)",
    )
    args = parser.parse_args()
    setup = llamacpp_setup() if args.engine == "llamacpp" else SIM
    with tempfile.TemporaryDirectory(prefix="llmgw-demo-") as tmp:
        demo = Demo(Path(tmp), args.router_port, setup)
        try:
            demo.start()
            demo.wait_ready()
            demo.chat()
            demo.ctl("get", "nodes", "-o", "wide")
            demo.ctl("get", "models")
            demo.ctl("get", "replicas", "-o", "wide")
            if args.serve:
                say(
                    f"serving: the router listens on http://127.0.0.1:{demo.router_port}/v1 (model {demo.model}); Ctrl-C to stop"
                )
                say("for ctl in another shell, paste:")
                for line in ctl_lines(f"http://127.0.0.1:{demo.api_port}", demo.api_token):
                    print(line, flush=True)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
        except KeyboardInterrupt:
            pass
        finally:
            demo.stop()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
