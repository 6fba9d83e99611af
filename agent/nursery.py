"""The agent's root nursery: discovery, the supervisor, and one session per connection attempt.

::

    agent root nursery
    ├── supervisor service        owns every engine process; outlives every session
    └── reconnect loop            jittered exponential backoff, forever
        └── session nursery       one per connection attempt; cancelled as a whole on disconnect

A fleet must not reconnect in lockstep after a control plane restart: thousands of agents retrying on
the same schedule arrive as one wave, again and again. The delay is exponential in the number of
failed attempts, capped, and jittered ("equal jitter": half fixed, half random), and the attempt
counter resets after a session that got as far as a registered stream.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import socket
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import trio

import schema
from agent import __version__
from agent.config import AgentConfig
from agent.discovery import Inventory, NvmlSession, nvidia_smi
from agent.discovery.model import GpuUsage
from agent.engineload import LoadScraper
from agent.engines import ENGINES, LaunchContext, versions
from agent.engines.versions import Installed
from agent.metrics import AgentMetrics
from agent.session import Session, SessionResult, read_credential, write_credential
from agent.supervise import LivenessProbe, Supervisor, probe_address
from agent.supervise.supervisor import TEST_KILL_AT_ENV
from transport import CallOptions, ClientTLS, GoAwayReceived, TransportError, open_stream

log = logging.getLogger("llmgw.agent")


def backoff_delay(attempt: int, base: float, cap: float, rand: float) -> float:
    """Seconds to wait before connection attempt ``attempt`` + 1 (``rand`` uniform in [0, 1)).

    Equal jitter: the exponential step is ``min(cap, base * 2**attempt)``; half of it is always
    waited (no hammering at zero delay), the other half is spread at random across the fleet.
    """
    step = min(cap, base * 2.0 ** min(attempt, 62))
    return step / 2 + rand * step / 2


def mgmt_address(config: AgentConfig) -> str:
    """The configured mgmt_addr, or the local address this node uses to reach the control plane.

    Blocks (DNS for the server's name, and the hostname fallback): call it from a worker thread.
    """
    if config.mgmt_addr:
        return config.mgmt_addr
    parts = urlsplit(config.servers[0])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((parts.hostname or "127.0.0.1", parts.port or 80))  # UDP: sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()


def build_register(
    config: AgentConfig,
    inventory: Inventory,
    supervisor: Supervisor,
    mgmt_addr: str,
    engines: Sequence[Installed] = (),
) -> schema.Register:
    """The first message of a session; ``mgmt_addr`` comes from :func:`mgmt_address`, which may
    do DNS and so runs in a worker thread; ``engines`` from :func:`engine_versions`."""
    return schema.Register(
        node_id=config.node_id,
        hostname=config.hostname,
        mgmt_addr=mgmt_addr,
        agent_version=__version__,
        labels=dict(config.labels),
        mgmt_interface=config.mgmt_interface,
        gpus=[
            schema.Gpu(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                compute_capability=f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                memory_total_mib=g.memory_total_mib,
                memory_used_mib=g.memory_used_mib,
                pci_bus_id=g.pci_bus_id,
                nvlink_peers=list(g.nvlink_peers),
                utilization_percent=g.utilization_percent,
            )
            for g in inventory.gpus
        ],
        fabrics=[schema.FabricAttachment(fabric=f.fabric, hca=f.hca, port=f.port) for f in config.fabrics],
        cpu_count=inventory.cpu_count,
        memory_total_mib=inventory.memory_total_mib,
        engine_ports=schema.PortRange(first=config.engine_ports.first, last=config.engine_ports.last),
        shards=supervisor.register_statuses(),
        driver_version=inventory.driver_version,
        cuda_version=inventory.cuda_version,
        discovery_error=inventory.error,
        token=config.token,
        engines=[e.to_proto() for e in engines],
    )


async def engine_versions(config: AgentConfig) -> tuple[Installed, ...]:
    """Every engine's installed version on this node (``agent.engines.versions``), once at start.

    Every known engine, not only those named in the config: the defaults are configured too, and
    an operator reading ``ctl nodes`` must see which engines a node lacks. Bounded by
    ``versions.TIMEOUT`` however the engines' commands behave; once per agent start (see
    ``agent.engines.versions`` for why not on each reconnect)."""
    found = await versions.detect((name, config.engine_argv(name)) for name in ENGINES)
    for e in found:
        if e.version:
            log.info("engine %s: version %s", e.engine, e.version)
        else:
            log.info("engine %s: version unknown: %s", e.engine, e.error)
    return found


def stream_options(config: AgentConfig) -> CallOptions:
    tls = None
    if config.tls_ca or config.tls_cert:
        tls = ClientTLS(ca_file=config.tls_ca, cert_file=config.tls_cert, key_file=config.tls_key)
    metadata = {"x-llmgw-node": config.node_id}
    # Keepalive well inside the heartbeat period: a dead peer is noticed before a beat is missed twice.
    interval = max(min(config.heartbeat_interval * 2, 30.0), 1.0)
    return CallOptions(
        protocol=config.protocol,
        tls=tls,
        keepalive_interval=interval,
        keepalive_timeout=max(min(config.heartbeat_interval * 2, 20.0), 1.0),
        metadata=metadata,
        settings_timeout=config.settings_timeout,
        user_agent=f"llmgw-agent/{__version__}",
    )


async def keep_credential(config: AgentConfig, credential: str) -> None:
    """Store the credential the control plane issued this node (``agent.session.write_credential``)."""
    await trio.to_thread.run_sync(write_credential, config.state_dir, config.node_id, credential)


#: The bound on one ``nvidia-smi`` usage read for a heartbeat: well under the control plane's
#: ``unreachable_after``, so a wedged nvidia-smi costs one heartbeat's figures, never the node.
NVIDIA_SMI_USAGE_TIMEOUT_S = 2.0


def usage_reader(inventory: Inventory) -> Callable[[], Sequence[GpuUsage]]:
    """Per-GPU usage for heartbeats, read by the method discovery used: NVML, else ``nvidia-smi``
    (one fork a heartbeat), else the static inventory's figures. Opening NVML blocks: call it from
    a worker thread."""
    if inventory.source == "nvml":
        session = NvmlSession.open()
        return session.usage
    if inventory.source == "nvidia-smi":
        return functools.partial(nvidia_smi.usage, timeout_s=NVIDIA_SMI_USAGE_TIMEOUT_S)
    static = tuple(GpuUsage(index=g.index, memory_used_mib=g.memory_used_mib) for g in inventory.gpus)
    return lambda: static


async def run_agent(
    config: AgentConfig,
    inventory: Inventory,
    *,
    rng: random.Random | None = None,
    metrics: AgentMetrics | None = None,
    task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The whole agent: the supervisor service and the reconnect loop, until cancelled; ``metrics``
    (``agent.metrics``) is told the session's state and follows the supervisor's shards."""
    rng = rng or random.Random()
    installed = await engine_versions(config)
    installed_version = {e.engine: e.version for e in installed}
    # Engines listen on the management address unless told otherwise: the router reaches them
    # there, and nothing else the node is attached to needs to (each shard has its own key too).
    engine_host = config.engine_host or await trio.to_thread.run_sync(mgmt_address, config)

    def launch_context(engine: str) -> LaunchContext:
        return LaunchContext(
            argv_prefix=config.engine_argv(engine),
            host=engine_host,
            mgmt_interface=config.mgmt_interface,
            fabrics=config.fabrics,
            gpus=inventory.gpus,
            shutdown_timeout_seconds=config.stop_grace,
            engine_version=installed_version.get(engine, ""),
        )

    supervisor = Supervisor(
        node_id=config.node_id,
        state_dir=config.state_dir,
        log_dir=config.logs,
        gpus=inventory.gpus,
        launch_context=launch_context,
        stop_grace=config.stop_grace,
        probe_host=probe_address(engine_host),
        log_max_bytes=config.log_max_bytes,
        log_generations=config.log_generations,
        secrets=(config.token,),
        liveness=LivenessProbe(
            period=config.liveness_period,
            timeout=config.liveness_timeout,
            failures=config.liveness_failures,
        ),
        verify_listener=config.verify_listener,
        # A test hook (see Supervisor): makes the agent kill itself at a named point of a start.
        test_kill_at=os.environ.get(TEST_KILL_AT_ENV, ""),
    )
    usage = await trio.to_thread.run_sync(usage_reader, inventory)
    options = stream_options(config)
    async with trio.open_nursery() as root:
        await root.start(supervisor.run)
        if metrics is not None:
            root.start_soon(metrics.watch, supervisor)
        # In the root nursery, not the session's: samples (and counter rates) survive a reconnect.
        scraper = LoadScraper(supervisor, config.heartbeat_interval)
        root.start_soon(scraper.run)
        task_status.started(supervisor)
        attempt = 0
        # Which of the control planes to dial: the same one while it takes us, the next one after an
        # attempt it did not register (down, or a standby answering with the leader's name).
        which = 0
        while True:
            server = config.servers[which % len(config.servers)]
            result = SessionResult()
            if metrics is not None:
                metrics.attempt()
            try:
                mgmt_addr = await trio.to_thread.run_sync(mgmt_address, config)
                register = build_register(config, inventory, supervisor, mgmt_addr, installed)
                # Once joined, the node's own credential speaks for it (the join token alone cannot).
                register.node_credential = await trio.to_thread.run_sync(
                    read_credential, config.state_dir, config.node_id
                )
                async with open_stream(server, options) as stream:
                    session = Session(
                        stream,
                        register=register,
                        supervisor=supervisor,
                        heartbeat_interval=config.heartbeat_interval,
                        usage=usage,
                        keep_credential=functools.partial(keep_credential, config),
                        metrics=metrics,
                        loads=scraper.loads,
                    )
                    result = await session.run()
            except (TransportError, OSError, trio.TooSlowError) as exc:
                result.reason = f"{type(exc).__name__}: {exc}"
                result.graceful = isinstance(exc, GoAwayReceived) and exc.graceful
            except Exception as exc:
                # A daemon that must run for months: an unexpected failure of one session is logged
                # and retried like any other; the engines and the supervisor are not affected.
                log.exception("session failed unexpectedly")
                result.reason = f"unexpected {type(exc).__name__}: {exc}"
            if result.registered:
                attempt = 0
            else:
                which += 1
            if metrics is not None:
                metrics.disconnected()
            delay = backoff_delay(attempt, config.reconnect_base, config.reconnect_max, rng.random())
            attempt += 1
            log.log(
                logging.INFO if result.graceful else logging.WARNING,
                "session with %s ended (%s); reconnecting in %.1f s",
                server,
                result.reason or "?",
                delay,
            )
            await trio.sleep(delay)
