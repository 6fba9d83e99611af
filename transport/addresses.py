"""Peer addresses: whether a peer is this machine, for every listener that answers local clients
only while it has no tokens (the admin API, the route watch, the router's /metrics)."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host``, an IP literal as a socket reports its peer, is this machine: 127.0.0.0/8,
    ``::1``, or an IPv4 loopback mapped into IPv6 (``::ffff:127.0.0.1``, what a dual-stack listener
    reports for an IPv4 client). A name is never loopback here: nothing is resolved."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
