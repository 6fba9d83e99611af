"""Prometheus helpers: a registry per process (never the library's global one) and its exposition.

A registry of one's own keeps a test that runs two services in one interpreter from seeing the other's
series, and keeps an import from registering anything as a side effect. Exposition is always
``prometheus_client``'s own (text 0.0.4, or OpenMetrics when the scraper asks for it): hand-written
text loses precision (``:g`` prints 1234567 as ``1.23457e+06``) and escaping.
"""

from __future__ import annotations

import trio
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder


def new_registry(*, process: bool = True) -> CollectorRegistry:
    """A fresh registry; with ``process``, the standard process, platform and GC collectors in it
    (``process_resident_memory_bytes``, ``process_open_fds``, ``python_info``, ...)."""
    registry = CollectorRegistry(auto_describe=True)
    if process:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """The registry's exposition in the format ``accept`` (a scraper's Accept header) asks for, and
    its content type. Reads ``/proc`` for the process collector: call it from a worker thread."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


async def exposition(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """:func:`render` in a worker thread, so a scrape never blocks the trio thread (collecting reads
    ``/proc``; the metric values themselves are thread-safe in ``prometheus_client``)."""
    return await trio.to_thread.run_sync(render, registry, accept)
