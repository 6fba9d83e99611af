"""Types of the native relay pump (router/_pump.c); see router/relay.py."""

from typing import TypeAlias

DONE: int
ENGINE: int
CLIENT: int
HEAD: int
EARLY: int
MAX_HEAD: int

#: A job's facts: (events, first_at, last_at, gap_sum, gap counts per bucket, tail or None).
Facts: TypeAlias = tuple[int, float, float, float, tuple[int, ...], bytes | None]
#: A job's result: (up_fd, code, extra, message, data, errno, sent_at, facts or None).
Result: TypeAlias = tuple[int, int, bool, str, bytes | None, int, float, Facts | None]

def client_head(head: bytes, suffix: bytes, /) -> tuple[bytes, bool] | None: ...
def scan_chunked(
    state: int, remaining: int, line: bytes, data: bytes, /
) -> tuple[int, tuple[int, int, bytes], str | None, int]: ...

class Pump:
    def __init__(self, coalesce_us: int = 0, gap_bounds: tuple[float, ...] | None = None) -> None: ...
    @property
    def notify_fd(self) -> int: ...
    def add(
        self,
        up_fd: int,
        client_fd: int,
        state: int,
        remaining: int,
        line: bytes,
        since: float = 0.0,
        want_tail: bool = False,
        /,
    ) -> None: ...
    def respond(self, up_fd: int, client_fd: int, suffix: bytes, want_tail: bool = False, /) -> None: ...
    def withdraw(
        self, up_fd: int, /
    ) -> tuple[float, Result | None, tuple[int, int, bytes] | None, Facts | None]: ...
    def collect(self) -> list[Result]: ...
    def stats(self) -> tuple[int, int]: ...
    def counters(self) -> tuple[int, int, int]: ...
    def close(self) -> list[int]: ...
