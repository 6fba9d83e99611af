"""What the supervisor reads from ``/proc``: engine markers, process groups, listening sockets, pidfds.

Every function here blocks on file reads (``/proc`` is a filesystem), so the supervisor calls them
from a worker thread, never from trio's thread.

**Markers.** Each engine is started with three variables of its own in its environment:
``LLMGW_SHARD_ID`` (the shard), ``LLMGW_SHARD_OWNER`` (the absolute state directory of the agent
that started it: two agents on one host, as in the tests, never adopt each other's engines) and
``LLMGW_SHARD_SPEC`` (the ``StartShard`` as base64 protobuf, so a restarted agent can rebuild a
missing or damaged record from ``/proc/PID/environ`` alone). ``/proc/PID/environ`` is the
environment as passed to ``execve``, so the marker is there from the engine's first instruction
to its last, whatever the engine does with its own environment later. Engines run in their own
session (``setsid``), so the engine *is* the leader of its process group (pid == pgid); its
children inherit the marker but are not leaders, and are counted as part of it, not as engines.

**Listening sockets.** ``/proc/net/tcp`` and ``/proc/net/tcp6`` list every socket of this network
namespace with its inode; ``/proc/PID/fd/N`` links to ``socket:[INODE]``. A LISTEN socket on a port
therefore names the processes that hold it, which is how readiness tells an answer from the engine
it started from an answer from whatever else holds the port.
"""

from __future__ import annotations

import base64
import binascii
import os
import select
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

import schema

MARK_SHARD = "LLMGW_SHARD_ID"
MARK_OWNER = "LLMGW_SHARD_OWNER"
MARK_SPEC = "LLMGW_SHARD_SPEC"

PROC = Path("/proc")

#: ``st`` of a listening socket in /proc/net/tcp{,6} (``TCP_LISTEN``).
_TCP_LISTEN = "0A"


@attrs.frozen
class ProcStat:
    """The fields of ``/proc/PID/stat`` the supervisor uses."""

    pid: int
    state: str
    pgid: int
    #: Field 22: clock ticks since boot. With the pid it names one process: pids are reused.
    start_time: int

    @property
    def running(self) -> bool:
        """Not a zombie (exited, not yet reaped) and not dead."""
        return self.state not in ("Z", "X")


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """``/proc/PID/stat``, or ``None`` when there is no such process (or it went while reading)."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    try:
        fields = text[text.rindex(")") + 2 :].split()
        # fields[0] is field 3 (state), fields[2] field 5 (pgrp), fields[19] field 22 (starttime).
        return ProcStat(pid=pid, state=fields[0], pgid=int(fields[2]), start_time=int(fields[19]))
    except (ValueError, IndexError):
        return None


def process_start_time(pid: int, proc: Path = PROC) -> int | None:
    """The running process's start time in clock ticks since boot; ``None`` when there is no such
    process or it is a zombie (an exited engine is not a running one)."""
    stat = read_stat(pid, proc)
    return stat.start_time if stat is not None and stat.running else None


def read_environ(pid: int, proc: Path = PROC) -> dict[str, str] | None:
    """The environment ``pid`` was exec'd with, or ``None`` when it cannot be read (gone, or another
    user's process)."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
    return env


#: Options whose value is a secret: a command line in a message shows ``***`` in its place.
SECRET_OPTIONS = ("--api-key",)


def command_line(pid: int, proc: Path = PROC, limit: int = 120) -> str:
    """The process's command line for a message, shortened to ``limit`` characters, with the values
    of ``SECRET_OPTIONS`` hidden: the message may name another shard's engine (a port in use) and
    travel to ``ctl`` output."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    words = [p.decode("utf-8", "replace") for p in raw.split(b"\0") if p]
    for i, word in enumerate(words):
        name, eq, _ = word.partition("=")
        if name in SECRET_OPTIONS and eq:
            words[i] = f"{name}=***"
        elif i > 0 and words[i - 1] in SECRET_OPTIONS:
            words[i] = "***"
    text = " ".join(words)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pids(proc: Path) -> Iterator[int]:
    try:
        names = os.listdir(proc)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


# -- markers -------------------------------------------------------------------------------------


def marker_env(shard_id: str, owner: str, spec: schema.StartShard) -> dict[str, str]:
    """The variables that mark an engine as ``owner``'s engine for ``shard_id``."""
    return {
        MARK_SHARD: shard_id,
        MARK_OWNER: owner,
        MARK_SPEC: base64.b64encode(bytes(spec)).decode(),
    }


@attrs.frozen
class MarkedEngine:
    """A process-group leader carrying this agent's marker: an engine this agent started."""

    pid: int
    start_time: int
    shard_id: str
    #: The spec from the marker; ``None`` when it does not decode (never expected; reported).
    spec: schema.StartShard | None


def _decode_spec(text: str) -> schema.StartShard | None:
    try:
        return schema.StartShard.parse(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return None


def _marked(owner: str, proc: Path, pgid: int | None) -> Iterator[tuple[ProcStat, dict[str, str]]]:
    """Running processes that carry ``owner``'s marker, with their environment: the leaders of
    their own groups (``pgid`` None) or the members of group ``pgid``. The group is checked from
    ``stat`` first, so only the environments of candidates are read."""
    for pid in _pids(proc):
        stat = read_stat(pid, proc)
        if stat is None or not stat.running or stat.pgid != (pid if pgid is None else pgid):
            continue
        env = read_environ(pid, proc)
        if env is not None and env.get(MARK_OWNER) == owner:
            yield stat, env


def find_engines(owner: str, proc: Path = PROC) -> list[MarkedEngine]:
    """Every running process-group leader whose environment names ``owner`` as its agent."""
    found = [
        MarkedEngine(
            pid=stat.pid,
            start_time=stat.start_time,
            shard_id=env[MARK_SHARD],
            spec=_decode_spec(env.get(MARK_SPEC, "")),
        )
        for stat, env in _marked(owner, proc, None)
        if MARK_SHARD in env
    ]
    return sorted(found, key=lambda e: (e.shard_id, e.start_time, e.pid))


def marked_members(pgid: int, owner: str, shard_id: str, proc: Path = PROC) -> list[ProcStat]:
    """Running processes of group ``pgid`` that carry ``owner``'s marker for ``shard_id``: the
    engine's own processes, whoever their parent is now."""
    return [stat for stat, env in _marked(owner, proc, pgid) if env.get(MARK_SHARD) == shard_id]


# -- listening sockets ---------------------------------------------------------------------------


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """Inodes of the TCP sockets listening on ``port``, on any address, IPv4 or IPv6."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(fields[9]))
            except (ValueError, IndexError):
                continue
    inodes.discard(0)
    return inodes


def socket_holders(inodes: set[int], pids: Iterable[int] | None = None, proc: Path = PROC) -> set[int]:
    """The processes (among ``pids``, or all) holding a file descriptor on one of ``inodes``."""
    if not inodes:
        return set()
    wanted = {f"socket:[{i}]" for i in inodes}
    holders = set()
    for pid in _pids(proc) if pids is None else pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd_dir / fd) in wanted:
                    holders.add(pid)
                    break
            except OSError:
                continue
    return holders


def group_pids(pgid: int, proc: Path = PROC) -> list[int]:
    """Running members of process group ``pgid``."""
    out = []
    for pid in _pids(proc):
        stat = read_stat(pid, proc)
        if stat is not None and stat.running and stat.pgid == pgid:
            out.append(pid)
    return out


def describe_holders(holders: set[int], proc: Path = PROC) -> str:
    """``pid 4242 (python3 -m http.server 8123)``, or a note that the holder is not visible."""
    if not holders:
        return "a process this agent cannot see (another user's or another namespace's)"
    parts = []
    for pid in sorted(holders)[:3]:
        cmd = command_line(pid, proc)
        parts.append(f"pid {pid} ({cmd})" if cmd else f"pid {pid}")
    return ", ".join(parts)


def port_in_use(port: int, proc: Path = PROC) -> str:
    """Empty when nothing listens on ``port``; else who does, in words."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return ""
    return describe_holders(socket_holders(inodes, proc=proc), proc)


def listener_problem(port: int, pgid: int, proc: Path = PROC) -> str:
    """Empty when a socket listening on ``port`` belongs to process group ``pgid``; else why not.

    Readiness trusts only the engine it started: an HTTP answer on the port proves nothing unless
    the listening socket is the engine's own.
    """
    inodes = listening_inodes(port, proc)
    if not inodes:
        return f"nothing listens on port {port}"
    if socket_holders(inodes, group_pids(pgid, proc), proc):
        return ""
    others = describe_holders(socket_holders(inodes, proc=proc), proc)
    return f"port {port} is held by {others}, not by the engine (process group {pgid})"


# -- pidfds --------------------------------------------------------------------------------------


def open_pidfd(pid: int, start_time: int, proc: Path = PROC) -> int | None:
    """A pidfd for ``pid``, only if that pid is still the process that started at ``start_time``.

    The check comes *after* opening: from then on the pidfd names one process for good, whatever
    happens to the number, so a pid recorded before an agent restart can never reach a stranger.
    """
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None
    if process_start_time(pid, proc) != start_time:
        os.close(fd)
        return None
    return fd


def pidfd_exited(fd: int) -> bool:
    """Whether the process behind ``fd`` has exited (a pidfd polls readable from then on)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


__all__ = [
    "MARK_OWNER",
    "MARK_SHARD",
    "MARK_SPEC",
    "MarkedEngine",
    "ProcStat",
    "command_line",
    "describe_holders",
    "find_engines",
    "group_pids",
    "listener_problem",
    "listening_inodes",
    "marked_members",
    "marker_env",
    "open_pidfd",
    "pidfd_exited",
    "port_in_use",
    "process_start_time",
    "read_environ",
    "read_stat",
    "socket_holders",
]
