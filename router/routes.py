"""What the router routes to: ready engine replicas per served model name, as values.

Routes come from the control plane (watched, or handed in by the embedding control plane) or from
``--static MODEL=URL``; either way they are these frozen values, read once per request."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from urllib.parse import urlsplit

import attrs


@attrs.frozen
class Upstream:
    """One ready engine replica that serves a model."""

    replica_id: str
    url: str  # engine base URL, e.g. "http://127.0.0.1:8000"
    #: The engine's own key (its shard's), sent upstream as ``Authorization: Bearer`` in place of
    #: anything the client sent; empty for an engine without one. Never in a repr (logs).
    api_key: str = attrs.field(default="", repr=False)


@attrs.frozen
class ModelRoutes:
    """Where a served model name goes now: its READY replicas, or why there are none."""

    upstreams: tuple[Upstream, ...]  # READY replicas only (the control plane filters draining/failed)
    reason: str = ""  # when empty of upstreams: why (from placement), for the 503 message


RoutesFn = Callable[[], Mapping[str, ModelRoutes]]


def static_routes(endpoints: Sequence[tuple[str, str]]) -> RoutesFn:
    """Routes for router-only runs: ``[(model, url), ...]``; a model named twice has two replicas
    (``MODEL-r0``, ``MODEL-r1``, as the control plane names them). URLs are checked now, so a typo
    fails at start with its text rather than at the first request."""
    by_model: dict[str, list[Upstream]] = {}
    for model, url in endpoints:
        if not model:
            raise ValueError(f"static route {url!r}: empty model name")
        parse_url(url)
        ups = by_model.setdefault(model, [])
        ups.append(Upstream(replica_id=f"{model}-r{len(ups)}", url=url.rstrip("/")))
    table: Mapping[str, ModelRoutes] = MappingProxyType(
        {m: ModelRoutes(upstreams=tuple(ups)) for m, ups in by_model.items()}
    )

    def routes() -> Mapping[str, ModelRoutes]:
        return table

    return routes


@attrs.frozen
class EngineAddress:
    """Where an upstream URL's requests go: address, Host header and path prefix."""

    host: str
    port: int
    host_header: bytes
    base_path: bytes


def parse_url(url: str) -> EngineAddress:
    """``http://host:port[/prefix]``. Only plain HTTP: engines listen on the node's management
    address without TLS, and the relay writes to raw sockets."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"upstream URL {url!r}: expected http://HOST:PORT (plain HTTP)")
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"upstream URL {url!r}: {exc}") from exc
    host_header = parts.netloc.rsplit("@", 1)[-1]
    base = parts.path.rstrip("/")
    if base.endswith("/v1"):  # "http://host:8000/v1" is how clients are usually configured
        base = base[:-3]
    return EngineAddress(parts.hostname, port, host_header.encode(), base.encode())
