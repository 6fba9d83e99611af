"""Router-only runs: ``python -m router --static MODEL=URL`` (and the ``llmgw-router`` script)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import trio

from router.limits import (
    DEFAULT_CLIENT_IDLE_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    ClientLimits,
)
from router.relay import DEFAULT_COALESCE_US, MAX_COALESCE_US
from router.routes import static_routes
from router.server import Router
from router.stalls import DEFAULT_RESPONSE_TIMEOUT, DEFAULT_STREAM_IDLE_TIMEOUT


def parse_static(values: Sequence[str]) -> list[tuple[str, str]]:
    endpoints = []
    for value in values:
        model, sep, url = value.partition("=")
        if not sep or not model or not url:
            raise ValueError(f"--static {value!r}: expected MODEL=URL, e.g. llama=http://10.0.0.7:8000")
        endpoints.append((model, url))
    return endpoints


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router",
        description="llmgw's OpenAI-compatible router on a static endpoint list (no control plane).",
    )
    parser.add_argument(
        "--static", action="append", default=[], metavar="MODEL=URL", help="a replica; repeat"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted bearer key; repeat (or LLMGW_ROUTER_API_KEYS=k1,k2, which keeps keys out of ps)",
    )
    parser.add_argument(
        "--relay-coalesce-us",
        type=int,
        default=DEFAULT_COALESCE_US,
        metavar="US",
        help=f"the relay pump's pause after each wake-up, 0 to {MAX_COALESCE_US} "
        f"(default {DEFAULT_COALESCE_US}; 0: none): streamed tokens that arrive together share a wake-up",
    )
    parser.add_argument(
        "--response-timeout",
        type=float,
        default=DEFAULT_RESPONSE_TIMEOUT,
        metavar="SECONDS",
        help=f"the longest wait for an engine's first response byte (default {DEFAULT_RESPONSE_TIMEOUT:g}); "
        "past it the client gets a 504 and the replica is ejected",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=DEFAULT_STREAM_IDLE_TIMEOUT,
        metavar="SECONDS",
        help=f"the longest silence of an engine once its response began (default "
        f"{DEFAULT_STREAM_IDLE_TIMEOUT:g}); past it the stream ends with an error event and the "
        "replica is ejected",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="SECONDS",
        help=f"a request's head must arrive within this of its first byte, a new connection's first "
        f"within this of the accept (default {DEFAULT_HEADER_TIMEOUT:g}; slowloris clients are closed)",
    )
    parser.add_argument(
        "--client-idle-timeout",
        type=float,
        default=DEFAULT_CLIENT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help=f"an idle keep-alive client connection is closed after this (default {DEFAULT_CLIENT_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"client connections over N get a 503 and are closed (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--metrics-key",
        default=os.environ.get("LLMGW_ROUTER_METRICS_KEY", ""),
        metavar="KEY",
        help="GET /metrics wants Authorization: Bearer KEY (or LLMGW_ROUTER_METRICS_KEY, which keeps it "
        "out of ps); without one /metrics answers loopback clients only",
    )
    args = parser.parse_args(argv)
    if args.max_connections < 1:
        parser.error(f"--max-connections must be at least 1, got {args.max_connections}")
    for flag, value in (
        ("--response-timeout", args.response_timeout),
        ("--stream-idle-timeout", args.stream_idle_timeout),
        ("--header-timeout", args.header_timeout),
        ("--client-idle-timeout", args.client_idle_timeout),
    ):
        if not value > 0:
            parser.error(f"{flag} must be more than 0 seconds, got {value:g}")
    try:
        routes = static_routes(parse_static(args.static))
    except ValueError as exc:
        parser.error(str(exc))
    if not args.static:
        parser.error("no --static MODEL=URL given")
    keys = set(args.api_key)
    keys.update(k for k in os.environ.get("LLMGW_ROUTER_API_KEYS", "").split(",") if k)
    try:
        router = Router(
            routes,
            api_keys=frozenset(keys),
            relay_coalesce_us=args.relay_coalesce_us,
            response_timeout=args.response_timeout,
            stream_idle_timeout=args.stream_idle_timeout,
            client_limits=ClientLimits(
                header_timeout=args.header_timeout,
                idle_timeout=args.client_idle_timeout,
                max_connections=args.max_connections,
            ),
            metrics_key=args.metrics_key,
        )
    except (RuntimeError, ValueError) as exc:  # the relay pump asked for (LLMGW_RELAY, coalescing), timeouts
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(router.serve, args.host, args.port)
            print(
                f"llmgw router listening on {args.host}:{port} (pid {os.getpid()}, {router.pump.kind} relay pump)",
                flush=True,
            )

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
