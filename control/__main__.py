"""``python -m control --config llmgw.toml`` runs the control plane; ``python -m control ctl ...`` asks it.

``ctl`` subcommands (``--api http://127.0.0.1:7080``, or ``LLMGW_API``), each as a readable table or
with ``--json`` as the API's JSON; ``--api`` and ``--json`` go before or after the subcommand. Exit
status: 0 done, 1 the operation failed (the API said no, or could not be reached), 2 a usage mistake.
The admin API's token comes from ``--token-file PATH`` or ``LLMGW_API_TOKEN`` (none: only a control
plane on this machine without ``[api]`` tokens answers); for HTTPS, ``--cacert`` (or
``LLMGW_API_CACERT``) and, with mutual TLS, ``--cert``/``--key``.

    nodes            every node, its state and why, GPUs free/total, fabrics
    replicas         every placed replica, its shards, where they run and in what state
    why MODEL        why MODEL's replicas are placed where they are, or why they cannot run
    logs SHARD       the tail of a shard's engine log, fetched from its agent over the stream
    cordon NODE      NODE takes no new replicas; what runs there stays
    drain NODE       cordon NODE and move its replicas elsewhere (replacements first); refused when
                     a model would be left without a ready replica, unless --force; --wait shows
                     progress until NODE is empty (exit 1 if --timeout S passes first)
    uncordon NODE    undo a cordon or a drain (replicas that already moved stay where they are)
    token            the cluster join token: agents join with --token (or LLMGW_AGENT_TOKEN) set to it
    node reset NODE  forget NODE's credential, so it can join again with the join token (a node
                     reinstalled on purpose; until then nothing can speak for it with the token)
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import re
import signal
import socket
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from control.config import ConfigError, ControlConfig, Listen, line_of, parse, read
from control.plane import ControlPlane
from control.transport import ServerTLS

log = logging.getLogger("llmgw.control")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in [header, *rows]
    ]
    return "\n".join(lines)


def engines_cell(engines: list[dict[str, str]]) -> str:
    """``ctl nodes``' ENGINES column: each installed engine with its version, then those the node
    lacks ("sim 0.18.0, vllm 0.18.0; missing: sglang, trtllm"); an engine whose version could not
    be read is "NAME ?" (``--json`` has every reason in full)."""
    found, missing = [], []
    for e in engines:
        if e["version"]:
            found.append(f"{e['engine']} {e['version']}")
        elif "command not found" in e["error"] or "not installed" in e["error"]:
            missing.append(e["engine"])
        else:
            found.append(f"{e['engine']} ?")
    text = ", ".join(found) or ("none" if engines else "-")
    return text + (f"; missing: {', '.join(missing)}" if missing else "")


def render(command: str, doc: Any) -> str:
    if command == "nodes":
        insecure = any(n.get("insecure") for n in doc)
        warning = (
            "WARNING: insecure = true: this control plane accepts agents with no authentication\n"
            if insecure
            else ""
        )
        rows = [
            [
                n["node_id"],
                n["state"] + (" (draining)" if n["draining"] else " (cordoned)" if n.get("cordoned") else ""),
                f"{n['since_s']:g}s",
                f"{n['gpus_free']}/{n['gpus']}",
                n["gpu_model"] or "-",
                ",".join(n["fabrics"]) or "-",
                n["mgmt_addr"],
                engines_cell(n.get("engines", [])),
                n["reason"] + (f"; discovery: {n['discovery_error']}" if n["discovery_error"] else ""),
            ]
            for n in doc
        ]
        for row, n in zip(rows, doc, strict=True):
            row.insert(2, n.get("auth") or "-")
        header = [
            "NODE",
            "STATE",
            "AUTH",
            "SINCE",
            "GPUS FREE",
            "GPU",
            "FABRICS",
            "ADDRESS",
            "ENGINES",
            "REASON",
        ]
        return warning + _table(rows, header)
    if command == "token":
        return str(doc["token"])
    if command == "node":
        if doc["forgotten"]:
            return f"{doc['node_id']}: credential forgotten; it joins again with the join token (`ctl token`)"
        return f"{doc['node_id']}: had no credential here; it joins with the join token (`ctl token`)"
    if command == "replicas":
        rows = []
        for r in doc:
            for s in r["shards"]:
                detail = s["error"]
                if s["retry_in_s"] is not None:
                    detail = f"{detail}; retry in {s['retry_in_s']:g}s (failures: {s['failures']})"
                rows.append(
                    [
                        r["replica_id"],
                        s["shard_id"],
                        s["node_id"] + ("" if s["node_state"] == "ready" else f" ({s['node_state']})"),
                        s["state"],
                        ",".join(map(str, s["gpus"])) or "-",
                        s["url"],
                        f"{s['node_rank']}/{s['nnodes']}" + (f" {s['master']}" if s["master"] else ""),
                        detail,
                    ]
                )
        table = _table(rows, ["REPLICA", "SHARD", "NODE", "STATE", "GPUS", "URL", "RANK", "DETAIL"])
        # A failed engine's last words, under the table: the reason is usually in them.
        tails = [
            f"\n{s['shard_id']} output (last {len(s['output_tail'])} lines):\n"
            + "\n".join(f"  | {line}" for line in s["output_tail"])
            for r in doc
            for s in r["shards"]
            if s["state"] == "failed" and s.get("output_tail")
        ]
        return "\n".join([table, *tails])
    if command == "why":
        out = [f"{doc['model']}: {len(doc['placed'])}/{doc['replicas_wanted']} replica(s) placed"]
        for r in doc["placed"]:
            where = ", ".join(
                f"{s['node_id']} GPUs {','.join(map(str, s['gpus'])) or '-'}" for s in r["shards"]
            )
            out.append(f"  {r['replica_id']}: placed on {where} ({r['state']})")
            for sh in r["shards"]:
                # Why a placed shard is not serving, in the agent's (often the engine's) own words.
                if sh.get("error"):
                    retry = f"; retry in {sh['retry_in_s']:g} s" if sh.get("retry_in_s") else ""
                    out.append(
                        f"      {sh['shard_id']} on {sh['node_id']}: {sh['state']}: {sh['error']}{retry}"
                    )
        for u in doc["unplaced"]:
            out.append(f"  {u['replica_id']}: cannot run: {u['reason']}")
            for node, reason in sorted(u["per_node"].items()):
                out.append(f"      {node}: {reason}")
        return "\n".join(out)
    if command == "logs":
        return "\n".join(doc["lines"])
    if command == "drain":
        forced = " (forced)" if doc.get("forced") else ""
        head = (
            f"{doc['node_id']}: draining{forced}; its replicas move elsewhere, then its shards drain and stop"
        )
        return "\n".join([head, *(f"  {line}" for line in doc.get("moves", []))])
    if command == "cordon":
        node = doc["node_id"]
        return f"{node}: {doc['cordon']}; takes no new replicas, keeps what runs (undo: ctl uncordon {node})"
    if command == "uncordon":
        was = f"was {doc['undone']}" if doc["undone"] else "was not cordoned"
        return f"{doc['node_id']}: uncordoned ({was}); takes new replicas again"
    return json.dumps(doc, indent=2)


def drain_progress_line(doc: Any) -> str:
    """One line of ``ctl drain --wait``: what still runs on the node, and each replacement's state."""
    parts = []
    for s in doc["shards"]:
        where = f", replacement on {s['replacement']} {s['replacement_state']}" if s["replacement"] else ""
        parts.append(f"{s['shard_id']} {s['state']}{where}")
    return f"{doc['node_id']}: {len(parts)} shard(s) left: {'; '.join(parts)}"


def _drain_wait(
    api: str, node: str, timeout: float, poll_every: float = 0.5, *, http: dict[str, Any] | None = None
) -> int:
    """Show progress lines until nothing runs on ``node`` (0) or ``timeout`` passes (1)."""
    import time

    url = f"{api.rstrip('/')}/api/drain/{node}"
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            resp = httpx.get(url, **(http or {"timeout": 30}))
            doc = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"ctl: GET {url}: {exc}", file=sys.stderr)
            return 1
        if resp.status_code != 200:
            print(f"ctl: GET {url}: HTTP {resp.status_code}: {doc.get('error', '')}", file=sys.stderr)
            return 1
        if doc["empty"]:
            print(f"{node}: drained; nothing runs there any more", flush=True)
            return 0
        line = drain_progress_line(doc)
        if line != last:
            print(line, flush=True)
            last = line
        if time.monotonic() >= deadline:
            print(f"ctl: drain of {node} not done after {timeout:g} s; {line}", file=sys.stderr)
            return 1
        time.sleep(min(poll_every, max(deadline - time.monotonic(), 0.0)))


def _add_global_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """``--api`` and ``--json``, on the top parser with their defaults and on each subcommand with
    none (argparse.SUPPRESS), so ``ctl --json nodes`` and ``ctl nodes --json`` both work and a
    subcommand's parse never overwrites what was given before it."""
    api_default = os.environ.get("LLMGW_API", "http://127.0.0.1:7080") if defaults else argparse.SUPPRESS
    parser.add_argument(
        "--api",
        default=api_default,
        help="the control plane's admin API URL (default: $LLMGW_API, else http://127.0.0.1:7080)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="print the API's JSON",
    )
    none = None if defaults else argparse.SUPPRESS
    parser.add_argument(
        "--token-file",
        type=Path,
        default=none,
        metavar="PATH",
        help="a file holding the admin API token (default: $LLMGW_API_TOKEN; none: only a control plane "
        "on this machine without [api] tokens answers)",
    )
    parser.add_argument(
        "--cacert",
        type=Path,
        default=Path(os.environ["LLMGW_API_CACERT"])
        if defaults and os.environ.get("LLMGW_API_CACERT")
        else none,
        metavar="PATH",
        help="https: the CA that signs the admin API's certificate (default: $LLMGW_API_CACERT, else the system's)",
    )
    parser.add_argument(
        "--cert",
        type=Path,
        default=none,
        metavar="PATH",
        help="https with [api.tls] client_ca: this client's certificate (PEM; with --key, or the key inside it)",
    )
    parser.add_argument(
        "--key", type=Path, default=none, metavar="PATH", help="the private key of --cert, if not inside it"
    )


def _http_options(args: argparse.Namespace) -> dict[str, Any]:
    """What every request of this ``ctl`` run carries: the bearer token (``--token-file``, else
    ``$LLMGW_API_TOKEN``) and the TLS settings. Raises ``ValueError`` naming the file it cannot read."""
    token = os.environ.get("LLMGW_API_TOKEN", "").strip()
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"--token-file {args.token_file}: cannot read it: {reason}") from exc
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty; put the admin API token in it")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    options: dict[str, Any] = {"headers": headers, "timeout": 30}
    if args.cacert is not None:
        options["verify"] = ssl.create_default_context(cafile=str(args.cacert))
    if args.cert is not None:
        context = options.get("verify") or ssl.create_default_context()
        context.load_cert_chain(str(args.cert), str(args.key) if args.key else None)
        options["verify"] = context
    return options


def ctl(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m control ctl", description="Ask a running control plane.")
    _add_global_options(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("nodes")
    sub.add_parser("replicas")
    sub.add_parser("why").add_argument("model")
    logs = sub.add_parser("logs")
    logs.add_argument("shard")
    logs.add_argument("-n", "--lines", type=int, default=100)
    sub.add_parser("cordon").add_argument("node")
    sub.add_parser("uncordon").add_argument("node")
    sub.add_parser("token", help="print the cluster join token")
    node_parser = sub.add_parser("node", help="node membership: node reset NODE")
    node_sub = node_parser.add_subparsers(dest="node_command", required=True)
    node_sub.add_parser("reset", help="forget NODE's credential; it joins again").add_argument("node")
    drain = sub.add_parser("drain")
    drain.add_argument("node")
    drain.add_argument(
        "--force", action="store_true", help="drain even if a model is left without a ready replica"
    )
    drain.add_argument("--wait", action="store_true", help="show progress until the node is empty")
    drain.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="with --wait: give up after S seconds (600)"
    )
    for subparser in [*sub.choices.values(), *node_sub.choices.values()]:
        _add_global_options(subparser, defaults=False)
    args = parser.parse_args(argv)
    if not re.fullmatch(r"https?://[^/\s?#]+/?", args.api):
        parser.error(f"--api {args.api!r} is not the admin API's URL; write it as http://HOST:PORT")
    try:
        http = _http_options(args)
    except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError: a bad --cacert, --cert or --key
        print(f"ctl: {exc}", file=sys.stderr)
        return 2
    method, path = "GET", f"/api/{args.command}"
    if args.command == "why":
        path += f"/{args.model}"
    elif args.command == "logs":
        path += f"/{args.shard}?lines={args.lines}"
    elif args.command == "drain":
        method, path = "POST", f"/api/drain/{args.node}" + ("?force=1" if args.force else "")
    elif args.command in ("cordon", "uncordon"):
        method, path = "POST", f"/api/{args.command}/{args.node}"
    elif args.command == "node":
        method, path = "POST", f"/api/reset/{args.node}"
    url = args.api.rstrip("/") + path
    try:
        # Writes carry a JSON body: the API refuses any other content type for them (see
        # control/api.py: ApiGuard, why a browser's text/plain POST must not get through).
        resp = httpx.request(method, url, json={} if method == "POST" else None, **http)
    except httpx.HTTPError as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        print(
            f"ctl: cannot reach the control plane: {method} {url}: {reason}; "
            "is it running, and is --api (or LLMGW_API) its admin API address?",
            file=sys.stderr,
        )
        return 1
    try:
        doc = resp.json()
    except ValueError:
        body = " ".join(resp.text[:200].split())
        print(f"ctl: {method} {url}: HTTP {resp.status_code} without JSON: {body}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        error = doc.get("error") if isinstance(doc, dict) else None
        reason = " ".join(str(error or resp.text[:200]).split())
        print(f"ctl: {method} {url}: HTTP {resp.status_code}: {reason}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2) if args.json else render(args.command, doc), flush=True)
    if args.command == "drain" and args.wait:
        return _drain_wait(args.api, args.node, args.timeout, http=http)
    return 0


async def _serve(plane: ControlPlane) -> None:
    """Run until SIGTERM or SIGINT, then stop in order and return (the process exits 0).

    Stopping is bounded and keeps what a restart needs: cancelling ``plane.run`` makes its agent
    stream server say GOAWAY to every agent and end their streams (``StreamServer.serve``, within
    its ``shutdown_grace`` plus a few seconds), so agents reconnect with their backoff instead of
    finding a dead socket; then the state file is written once more, with fsync. A second signal
    while that runs ends the process at once: the signal handlers are back to their defaults by then.
    """
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await nursery.start(plane.run)
            if plane.config.runs_control_plane:
                print(
                    f"llmgw control plane ready: agents :{plane.agent_port} api :{plane.api_port} "
                    f"router :{plane.router_port or '-'}",
                    flush=True,
                )
            else:
                print(f"llmgw router ready (router-only run): router :{plane.router_port}", flush=True)
            async for signum in signals:
                log.info(
                    "%s: stopping: GOAWAY to every agent, then the state is saved",
                    signal.Signals(signum).name,
                )
                nursery.cancel_scope.cancel()
                break
    if plane.config.runs_control_plane:
        # Nothing is cancelled out here (plane.run has returned), so the bound is the only guard.
        with trio.move_on_after(10) as waited:
            await plane.save_now()
        if waited.cancelled_caught:
            log.warning("control plane stopped; saving %s took over 10 s and was left", plane.state_file)
        else:
            log.info("control plane stopped; state saved in %s", plane.state_file)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:
        return ctl(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m control", description="llmgw control plane")
    parser.add_argument("--config", type=Path, default=Path(os.environ.get("LLMGW_CONFIG", "llmgw.toml")))
    args = parser.parse_args(argv)
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
        trio.run(_serve, ControlPlane(config))
    except (OSError, ExceptionGroup) as exc:
        # The ports were free a moment ago (startup_problems); one taken since is still one line.
        lost = _bind_errors(exc)
        if not lost:
            raise
        print(
            f"llmgw-control: cannot listen: {lost[0].strerror}; a port was taken while starting",
            file=sys.stderr,
        )
        return 2
    return 0


def _where(text: str, source: str, path: tuple[str, ...], is_default: bool) -> str:
    """``llmgw.toml line 3``, or that the value is the default (written nowhere to point at)."""
    line = line_of(text, *path, exact=True) or (None if is_default else line_of(text, *path))
    return f"{source} line {line}" if line else f"the default; {source} does not set {'.'.join(path)}"


def _state_dir_problem(config: ControlConfig, text: str, source: str) -> str:
    """Why the control plane could not save its state in ``state_dir``; "" when it can.

    Found now, before anything is served, rather than at the first save, minutes into a run whose
    placements a restart would then forget."""
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
        ServerTLS(tls.cert, tls.key, tls.client_ca, tls.require_client_cert).context()
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
