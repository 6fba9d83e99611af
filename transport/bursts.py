"""A burst of the same log line, said once with a count.

A port open to a network meets crowds: a scanner, a load balancer's health checks, thousands of
idle connections a misconfigured client opened. Each is closed correctly, but one WARNING per
connection buries every other line (5,000 idle connections made 5,002 lines). So the first few of
a burst are logged one by one, the rest are counted, and one line per interval says how many:
"closed 4,998 connections that sent no TLS handshake or request within 10 s, in the last 10 s".

:class:`BurstCounter` is the decision (sans-IO: the caller passes ``now``); :class:`BurstLog` puts
it on a logger and a trio task that writes each interval's summary when the interval ends.
"""

from __future__ import annotations

import logging

import trio


class BurstCounter:
    """Which lines of a burst to log one by one, and how many were held back per interval.

    A window of ``interval`` seconds opens at the first line after a quiet spell; its first ``keep``
    lines are logged, the rest held back and counted. A window that held lines back is followed by
    windows that hold back every line until a whole ``interval`` passes with none (the burst goes
    on: one summary per interval, not ``keep`` more lines each time).
    """

    def __init__(self, keep: int, interval: float) -> None:
        self.keep = keep
        self.interval = interval
        #: When the current window ends; ``None`` when no window is open.
        self.window_end: float | None = None
        self.held = 0
        self._seen = 0
        self._in_burst = False
        self._last_end: float | None = None

    def record(self, now: float) -> bool:
        """Count one line at ``now``; ``True`` when it is to be logged by itself."""
        if self.window_end is None:
            if self._last_end is not None and now - self._last_end >= self.interval:
                self._in_burst = False
            self.window_end = now + self.interval
        self._seen += 1
        if self._seen <= (0 if self._in_burst else self.keep):
            return True
        self.held += 1
        return False

    def close_window(self) -> int:
        """End the open window; the number of lines it held back (0 when none, or none open)."""
        held = self.held
        if self.window_end is not None:
            self._last_end = self.window_end
        self._in_burst = held > 0
        self.window_end = None
        self.held = self._seen = 0
        return held


class BurstLog:
    """A log line that may come in bursts: see :class:`BurstCounter`; ``run`` writes the summaries.

    ``summary`` is a format string with ``{count}`` (held back, in the window), ``{interval}``
    (seconds) and ``{last}`` (the last held-back line's text, for an example).
    """

    def __init__(
        self,
        logger: logging.Logger,
        summary: str,
        *,
        level: int = logging.WARNING,
        keep: int = 3,
        interval: float = 10.0,
    ) -> None:
        self.logger = logger
        self.summary = summary
        self.level = level
        self.counter = BurstCounter(keep, interval)
        self._last = ""
        self._held_back = trio.Event()

    def note(self, message: str, *args: object) -> None:
        """Log ``message % args`` now, or count it for the interval's summary line."""
        now = trio.current_time()
        end = self.counter.window_end
        if end is not None and now >= end:
            self._flush(end)  # an interval that ended before ``run`` got to it
        if self.counter.record(now):
            self.logger.log(self.level, message, *args)
            return
        self._last = message % args if args else message
        self._held_back.set()

    async def run(self) -> None:
        """Write each interval's summary when it ends, until cancelled (then at once)."""
        try:
            while True:
                await self._held_back.wait()
                end = self.counter.window_end
                if end is None:
                    self._held_back = trio.Event()
                    continue
                await trio.sleep_until(end)
                self._flush(end)
        finally:
            self._flush(self.counter.window_end)

    def _flush(self, end: float | None) -> None:
        if end is None or self.counter.window_end != end:
            return  # that window was already summed up
        self._held_back = trio.Event()
        held = self.counter.close_window()
        if held:
            text = self.summary.format(
                count=f"{held:,}", interval=f"{self.counter.interval:g}", last=self._last
            )
            self.logger.log(self.level, "%s", text)
