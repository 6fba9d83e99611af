"""What idle and slow clients may cost a router: the header timeout, the idle timeout and the
connection cap, and the cap the process's descriptor limit allows."""

from __future__ import annotations

import logging
import resource

import attrs

log = logging.getLogger("llmgw.router")

#: A request's head (request line and headers) must arrive within this many seconds of its first
#: byte; a new connection's first head within this of the accept. Real clients send a head in one
#: write, so ten seconds is generous for any network, and a slowloris client (a head sent a byte at
#: a time) holds its connection ten seconds, not for ever.
DEFAULT_HEADER_TIMEOUT = 10.0
#: An idle keep-alive connection (between requests) is closed after this many seconds. Longer than
#: the 60 s idle timeout of the load balancers that sit in front of routers (the balancer, not the
#: router, should close first, or it may send a request on a connection the router is closing),
#: the same as nginx's keepalive_timeout; clients' own pools (httpx: 5 s) close theirs sooner.
DEFAULT_CLIENT_IDLE_TIMEOUT = 75.0
#: Client connections served at once. Each costs two descriptors (the socket and its hang-up
#: watch) and one more while its request is relayed; 10,000 is far above what one router's
#: engines answer at once, and a router whose descriptor limit is lower lowers it (``serve``).
DEFAULT_MAX_CONNECTIONS = 10_000


@attrs.frozen
class ClientLimits:
    """What idle and slow clients may cost the router.

    Over ``max_connections`` a connection is answered ``503`` with ``retry-after: 1`` and closed,
    not queued: routers run several behind a load balancer, and a fast refusal lets the balancer
    or the client (the OpenAI SDKs retry 503 with backoff) go elsewhere, where a queue (a paused
    accept) would leave them waiting in the kernel's backlog with no answer and no way to tell an
    overloaded router from a dead one."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    idle_timeout: float = DEFAULT_CLIENT_IDLE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __attrs_post_init__(self) -> None:
        for name in ("header_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ValueError(f"the router's client {name} must be more than 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"the router's max_connections must be at least 1, got {self.max_connections}")


#: Descriptors per client connection: its socket, its hang-up watch, and an engine connection.
_FDS_PER_CONNECTION = 3
#: Descriptors kept for everything else: listeners, pooled engine connections, logs, the pump.
_FDS_RESERVED = 256


def connection_cap(wanted: int) -> int:
    """The connection cap this process's descriptor limit allows, ``wanted`` or less. The soft
    limit is raised towards the hard one first (as Go's runtime does at start: the soft default of
    1,024 is a relic of select()); if even the hard limit is short, one warning says so and the
    cap is lowered, so that over-cap clients get a 503 rather than an accept loop out of
    descriptors."""
    need = wanted * _FDS_PER_CONNECTION + _FDS_RESERVED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    cap = max(1, (soft - _FDS_RESERVED) // _FDS_PER_CONNECTION)
    log.warning(
        "router: a cap of %d client connections (router_max_connections, --max-connections) needs %d "
        "descriptors, this process may open %d (hard limit %s); serving at most %d client "
        "connections: raise the limit (LimitNOFILE= in the unit, ulimit -n) to serve more",
        wanted,
        need,
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        cap,
    )
    return cap
