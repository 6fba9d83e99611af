"""``python -m control --config llmgw.toml`` runs the control plane; ``python -m control ctl ...`` asks it;
``python -m control migrate-state --to etcd|file`` moves its state between backends (``control.migrate``).

``ctl`` (``control.ctl``) is the operator's client: ``get nodes|replicas|models``, ``describe``,
``logs -f``, ``apply -f``, ``scale``, ``delete``, ``cordon``, ``drain`` and the rest, each with
``--help``. Exit status, for both: 0 done, 1 the operation failed (the API said no, or could not be
reached), 2 a usage mistake (for the server: a configuration it cannot run).

SIGHUP makes a running control plane read its llmgw.toml again and apply the ``[[models]]`` by the
file rule (``MODELS_RULE`` below, ``control.catalog``); a file it cannot parse is logged as one error
naming the key and line, and nothing changes.
"""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# Only ctl at import time: ``python -m control ctl`` starts in a third of the time (0.35 s, not
# 1.07 s, on the test host; the control plane's modules, trio and hypercorn are imported by the
# server's functions below when it runs), and ctl never depends on the server's code importing.
from control.ctl import EXIT_CODES, ctl, version
from control.ctl import render as render  # re-exported: tests and scripts import it from here

if TYPE_CHECKING:
    import trio

    from control.config import ControlConfig
    from control.plane import ControlPlane
    from telemetry.logs import LogSettings

log = logging.getLogger("llmgw.control")

#: The file rule, for ``--help`` (the README's "Models as objects" says the same).
MODELS_RULE = """models as objects:
  llmgw.toml's [[models]] are the declarative starting point; ctl apply -f, scale and delete
  change models at run time, and the control plane keeps them in its state across restarts.
  On start and on SIGHUP it applies the file's [[models]]:
    - a model new in the file is created;
    - a model whose table in the file changed since the file last applied it takes the file's
      definition (the file changed, the file wins over ctl apply and ctl scale);
    - a model whose table did not change keeps what ctl made of it (a restart never reverts a scale);
    - a model that came from the file and left it is deleted (drained, stopped, then gone);
    - a model that exists only through ctl apply stays.
  ctl delete refuses a model the file defines: remove its table and send SIGHUP instead.
  SIGHUP applies [[models]] only; other changed settings are named in a warning and wait for a
  restart. A file that does not parse is logged (key and line) and changes nothing."""


async def _reload(plane: ControlPlane, path: Path, lock: trio.Lock) -> None:
    """SIGHUP: read and parse llmgw.toml in a worker thread, then apply its ``[[models]]``
    (``ControlPlane.reload_config``). A file that cannot be read or parsed is one error line naming
    the key and line, and the control plane keeps running as it was."""
    import trio

    from control.config import ConfigError, parse, read

    async with lock:  # one reload at a time: two quick SIGHUPs apply the file twice, in order
        if not plane.acting:
            log.warning("SIGHUP: a standby applies nothing (the leader reads its own llmgw.toml)")
            return
        if not plane.config.runs_control_plane:
            log.warning("SIGHUP: a router-only run has no models to apply; restart it to read %s", path)
            return
        try:
            text = await trio.to_thread.run_sync(read, path)
            config = await trio.to_thread.run_sync(parse, text, str(path))
        except ConfigError as exc:
            log.error("SIGHUP: %s; nothing was changed, the control plane runs on as it was", exc)
            return
        log.info("SIGHUP: applying the [[models]] of %s", path)
        await plane.reload_config(config)


async def _serve(
    plane: ControlPlane, config_path: Path | None = None, logs: LogSettings | None = None
) -> None:
    """Run until SIGTERM or SIGINT, then stop in order and return (the process exits 0).

    Stopping is bounded and keeps what a restart needs: cancelling ``plane.run`` makes its agent
    stream server say GOAWAY to every agent and end their streams (``StreamServer.serve``, within
    its ``shutdown_grace`` plus a few seconds), so agents reconnect with their backoff instead of
    finding a dead socket; then the state file is written once more, with fsync. A second signal
    while that runs ends the process at once: the signal handlers are back to their defaults by then.
    """
    import trio

    from telemetry.logs import LogSettings, announce

    logs = logs if logs is not None else LogSettings()
    reloading = trio.Lock()

    async def start() -> None:
        # Started apart from the signal loop: a standby (etcd) waits here until it leads, and a
        # SIGTERM must stop it meanwhile.
        await nursery.start(plane.run)
        if plane.config.runs_control_plane:
            announce(
                logs,
                "llmgw.control",
                f"llmgw control plane ready: agents :{plane.agent_port} api :{plane.api_port} "
                f"router :{plane.router_port or '-'}",
                agents_port=plane.agent_port,
                api_port=plane.api_port,
                router_port=plane.router_port or None,
            )
        else:
            announce(
                logs,
                "llmgw.control",
                f"llmgw router ready (router-only run): router :{plane.router_port}",
                router_port=plane.router_port,
            )

    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            nursery.start_soon(start)
            async for signum in signals:
                if signum == signal.SIGHUP:
                    if config_path is not None:
                        nursery.start_soon(_reload, plane, config_path, reloading)
                    continue
                log.info(
                    "%s: stopping: GOAWAY to every agent, then the state is saved",
                    signal.Signals(signum).name,
                )
                nursery.cancel_scope.cancel()
                break
    if plane.config.runs_control_plane and plane.config.state.backend == "file":
        # (etcd: the plane saved before its etcd client closed, if it led; a standby saves nothing.)
        # Nothing is cancelled out here (plane.run has returned), so the bound is the only guard.
        with trio.move_on_after(10) as waited:
            await plane.save_now()
        if waited.cancelled_caught:
            log.warning("control plane stopped; saving %s took over 10 s and was left", plane.state_where)
        else:
            log.info("control plane stopped; state saved in %s", plane.state_where)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:
        return ctl(argv[1:])
    if argv[:1] == ["migrate-state"]:
        from control.migrate import main as migrate

        return migrate(argv[1:])
    import trio

    from control.config import ConfigError, parse, read
    from control.plane import ControlPlane
    from telemetry.logs import LogSettingsError, add_log_arguments, log_settings, setup_logging

    parser = argparse.ArgumentParser(
        prog="python -m control",
        description="The llmgw control plane: holds every node's agent stream, places model replicas, "
        "reconciles, serves the admin API and an embedded router.\n\n"
        "Ask a running one with ctl: python -m control ctl --help (get, describe, logs, drain ...).",
        epilog="exit status:\n  0  stopped by SIGTERM or SIGINT\n  2  a configuration it cannot run "
        "(one line names the key, file and line)\n\nctl's own:\n"
        + EXIT_CODES.split("\n", 1)[1]
        + "\n\n"
        + MODELS_RULE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"llmgw control plane {version()}")
    parser.add_argument(
        "--config",
        type=Path,
        default=Path(os.environ.get("LLMGW_CONFIG", "llmgw.toml")),
        metavar="PATH",
        help="the configuration file (default: $LLMGW_CONFIG, else llmgw.toml)",
    )
    add_log_arguments(parser)
    args = parser.parse_args(argv)
    try:
        logs = log_settings(args.log_format, args.log_level)
        setup_logging(logs)
    except LogSettingsError as exc:
        print(f"llmgw-control: {exc}", file=sys.stderr)
        return 2
    try:
        text = read(args.config)
        config = parse(text, str(args.config))
    except ConfigError as exc:
        print(f"llmgw-control: {exc}", file=sys.stderr)
        return 2
    problems = startup_problems(config, text, str(args.config))
    for problem in problems:
        print(f"llmgw-control: {problem}", file=sys.stderr)
    if problems:
        return 2
    tune_gc()
    try:
        trio.run(_serve, ControlPlane(config), args.config, logs)
    except (OSError, ExceptionGroup) as exc:
        # The ports were free a moment ago (startup_problems); one taken since is still one line.
        lost = _bind_errors(exc)
        if not lost:
            if stopped := _state_stop(exc):
                # etcd backend: stepped down, etcd unusable, or a state it cannot read: one line.
                print(f"llmgw-control: {stopped}", file=sys.stderr)
                return 1
            raise
        print(
            f"llmgw-control: cannot listen: {lost[0].strerror}; a port was taken while starting",
            file=sys.stderr,
        )
        return 2
    return 0


def _where(text: str, source: str, path: tuple[str, ...], is_default: bool) -> str:
    """``llmgw.toml line 3``, or that the value is the default (written nowhere to point at)."""
    from control.config import line_of

    line = line_of(text, *path, exact=True) or (None if is_default else line_of(text, *path))
    return f"{source} line {line}" if line else f"the default; {source} does not set {'.'.join(path)}"


def _state_dir_problem(config: ControlConfig, text: str, source: str) -> str:
    """Why the control plane could not save its state in ``state_dir``; "" when it can.

    Found now, before anything is served, rather than at the first save, minutes into a run whose
    placements a restart would then forget."""
    from control.config import ControlConfig

    state_dir = config.state_dir
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        probe = state_dir / f".llmgw-write-test-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"llmgw")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        return (
            f"state_dir: cannot write {exc.filename or state_dir}: {exc.strerror or exc} "
            f"({_where(text, source, ('state_dir',), state_dir == ControlConfig().state_dir)}); make {state_dir} a directory this user "
            f"(uid {os.geteuid()}) can write, or set state_dir to one"
        )
    return ""


def _listen_problem(key: str, address: str, text: str, source: str) -> str:
    """Why ``address`` cannot be listened on (taken, not this machine's, privileged); "" when it can.

    Binds and closes a socket the way trio.open_tcp_listeners will (SO_REUSEADDR, IPv6-only), so a
    port held by another process is named with its listener here instead of surfacing as a
    traceback from inside the running server."""
    from control.config import Listen

    host, port = Listen.split(address)
    where = _where(text, source, ("listen", key), address == getattr(Listen(), key))
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"listen.{key}: cannot resolve {host!r} ({exc.strerror}) ({where}); use an IP address of this machine"
    for family, type_, proto, _, sockaddr in infos:
        try:
            sock = socket.socket(family, type_, proto)
        except OSError as exc:
            if exc.errno == errno.EAFNOSUPPORT:
                continue
            return f"listen.{key}: cannot open a socket for {address}: {exc.strerror} ({where})"
        with sock:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(sockaddr)
                sock.listen(1)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (
                        f"listen.{key}: {address} is in use: another process holds port {port} ({where}); "
                        f"stop it (`ss -ltnp 'sport = :{port}'` names it) or choose another port"
                    )
                if exc.errno == errno.EADDRNOTAVAIL:
                    return (
                        f"listen.{key}: {host} is not an address of this machine ({where}); "
                        "use one of its addresses, or 0.0.0.0 for all"
                    )
                if exc.errno == errno.EACCES:
                    return (
                        f"listen.{key}: port {port} needs privilege ({where}); ports below 1024 need "
                        "root or CAP_NET_BIND_SERVICE: choose a port above 1023"
                    )
                return f"listen.{key}: cannot listen on {address}: {exc.strerror or exc} ({where})"
    return ""


def startup_problems(config: ControlConfig, text: str, source: str) -> list[str]:
    """What would stop this configuration from serving, each one line: an unwritable state_dir and
    listen addresses that cannot be bound. Runs before the event loop, so its blocking calls
    (mkdir, fsync, DNS) hold up nothing."""
    problems = []
    listeners = [("router", config.listen.router)]
    if config.runs_control_plane:
        problems.append(_state_dir_problem(config, text, source))
        listeners = [("agents", config.listen.agents), ("api", config.listen.api), *listeners]
        problems.append(_api_tls_problem(config, text, source))
        problems.append(config.state.password_problem(os.environ))
    problems += [_listen_problem(key, address, text, source) for key, address in listeners if address]
    return [p for p in problems if p]


def _api_tls_problem(config: ControlConfig, text: str, source: str) -> str:
    """Why ``[api.tls]``'s certificate, key or client CA cannot be loaded; "" when they can (or
    there is no ``[api.tls]``). Found before serving, as one line, rather than as a traceback from
    inside the admin API's start."""
    tls = config.api.tls
    if tls is None:
        return ""
    for key, path in (("cert", tls.cert), ("key", tls.key), ("client_ca", tls.client_ca)):
        if path is None:
            continue
        try:
            path.open("rb").close()
        except OSError as exc:
            return (
                f"api.tls.{key}: cannot read {path}: {exc.strerror or exc} "
                f"({_where(text, source, ('api', 'tls', key), False)})"
            )
    try:
        tls.context()
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        named = f" {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
        return (
            f"api.tls: cannot load the admin API's certificate, key or client CA{named}: {reason} "
            f"({_where(text, source, ('api', 'tls'), False)}); check cert, key and client_ca"
        )
    return ""


def _bind_errors(exc: BaseException) -> list[OSError]:
    """The bind failures an error from the running server consists of, or [] when it is anything
    else (which then keeps its traceback)."""
    leaves = list(_leaves(exc))
    binds = [
        e for e in leaves if isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)
    ]
    return binds if len(binds) == len(leaves) else []


def _state_stop(exc: BaseException) -> str:
    """Why an etcd-backed control plane stopped, when that is all its error is: it stepped down
    (``control.leader``), etcd could not be used, or the state in it is damaged; "" otherwise."""
    from control.etcd import EtcdError
    from control.leader import SteppedDown
    from control.state import StateFileError

    leaves = _leaves(exc)
    known = [e for e in leaves if isinstance(e, SteppedDown | EtcdError | StateFileError)]
    if not known or len(known) != len(leaves):
        return ""
    what = "stepped down" if isinstance(known[0], SteppedDown) else "state backend"
    return f"{what}: {known[0]}"


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def tune_gc() -> None:
    """Make full garbage collections rare. A control plane holds a large, long-lived heap (a stream,
    an h2 connection and a node record per node); with CPython's default thresholds a full
    collection walks all of it every few thousand allocations, which at 5,000 nodes measured 3 s
    pauses, long enough for every node to look silent. The heap has few reference cycles, so
    collecting rarely costs little memory."""
    gc.freeze()  # what exists at start-up (modules, config) is never garbage
    gc.set_threshold(100_000, 50, 1000)


if __name__ == "__main__":
    sys.exit(main())
