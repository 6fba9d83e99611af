"""Engine log files: rotation by size, and the tail of a log across a rotation.

An engine writes ``log_dir/SHARD.log`` through a file descriptor it inherited at spawn (never a
pipe: a pipe would break the engine when the agent dies), so the agent cannot reopen the file for
it. Rotation is therefore logrotate's ``copytruncate``: the older generations move up one
(``SHARD.log.1`` -> ``SHARD.log.2`` ...), the current contents are copied to ``SHARD.log.1``, and
``SHARD.log`` is truncated to zero in place. The engine's descriptor was opened with ``O_APPEND``,
so its next write lands at the new end (offset 0) rather than leaving a hole the size of the old
file.

**The window.** Lines the engine writes between the end of the copy and the truncation are lost,
as with logrotate's copytruncate. The copy is ``sendfile`` in passes: the file as it stands
(65-170 ms for the default 50 MiB from the page cache on the test host), then whatever the engine
appended meanwhile, again until a pass is short (under 64 KiB; at most 8 passes), and the
truncation follows that last pass at once, so the window is one short pass, not the whole copy.
Measured on the test host during 50 MiB rotations (25-55 ms each): a writer appending 1,000 or
6,000 lines a second lost none; one appending as fast as it could (~450,000 lines a second, far
beyond any engine) lost none in one run and 2,192 lines (about 5 ms of its output) in another. A partial line at the boundary
may also be split between ``SHARD.log.1`` and ``SHARD.log``.

Every function here blocks on the filesystem: the supervisor calls them from a worker thread.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterable
from pathlib import Path

#: How much of each file a tail reads at most (a tail is for a person, or a failure report).
TAIL_READ_BYTES = 256 * 1024
#: A rotation's copy passes: more while a pass copied at least ``SHORT_PASS_BYTES``, at most this many.
MAX_PASSES = 8
SHORT_PASS_BYTES = 64 * 1024
#: What a secret is replaced with in a tail.
REDACTED = "***"
#: A key as engines print their own arguments (``--api-key K``, vLLM's ``'api_key': 'K'``): hidden
#: even when the shard's key is not known any more (a log read after its shard ended).
KEY_IN_TEXT = re.compile(r"""(?i)(api[_-]key['"]?(?:\s*[:=]\s*|\s+)['"]?)([^\s'",}]{4,})""")


def generation(path: Path, n: int) -> Path:
    """``SHARD.log.N`` for ``n`` >= 1, the live file for 0."""
    return path if n == 0 else path.with_name(f"{path.name}.{n}")


def rotate(path: Path, max_bytes: int, generations: int) -> bool:
    """Rotate ``path`` when it is larger than ``max_bytes``, keeping ``generations`` old files (see
    the module docstring for how, and what can be lost); whether it did."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return False
    if size <= max_bytes:
        return False
    if generations >= 1:
        for n in range(generations - 1, 0, -1):
            older = generation(path, n)
            if older.exists():
                os.replace(older, generation(path, n + 1))
        newest = generation(path, 1)
        tmp = newest.with_name(newest.name + ".tmp")
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            # Passes until one is short (what the engine wrote during the previous pass), bounded:
            # the truncation follows the last pass at once, so the window is that pass alone.
            copied = _copy_to_end(src.fileno(), dst.fileno(), 0)
            for _ in range(MAX_PASSES):
                before = copied
                copied = _copy_to_end(src.fileno(), dst.fileno(), copied)
                if copied - before < SHORT_PASS_BYTES:
                    break
            os.truncate(path, 0)
        os.replace(tmp, newest)
    else:
        os.truncate(path, 0)
    return True


def _copy_to_end(src: int, dst: int, offset: int) -> int:
    """Append ``src`` from ``offset`` to its current end onto ``dst`` (``sendfile``: in the
    kernel); the new offset."""
    while True:
        sent = os.sendfile(dst, src, offset, 1 << 24)
        if sent == 0:
            return offset
        offset += sent


def _last_lines(path: Path) -> tuple[list[str], int] | None:
    """The lines of the last ``TAIL_READ_BYTES`` of ``path``, and the offset where they end;
    ``None`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - TAIL_READ_BYTES)
            f.seek(start)
            data = f.read()
    except OSError:
        return None
    return data.decode("utf-8", "replace").splitlines(), start + len(data)


def tail(path: Path | None, n: int, *, generations: int = 1, redact: Iterable[str] = ()) -> list[str]:
    """The last ``n`` lines of a log, reading older generations (``SHARD.log.1`` ...) too when the
    live file has fewer lines than asked for (it was just rotated), with each secret in ``redact``
    replaced by ``***``: an engine may print its own command line, key included."""
    return tail_and_offset(path, n, generations=generations, redact=redact)[0]


def tail_and_offset(
    path: Path | None, n: int, *, generations: int = 1, redact: Iterable[str] = ()
) -> tuple[list[str], int]:
    """``tail``, and the offset in the live file where its lines end: where a follower
    (``read_after``) goes on from, so no line is shown twice or skipped."""
    if path is None:
        return [], 0
    lines: list[str] = []
    offset = 0
    for g in range(0, max(generations, 0) + 1):
        got = _last_lines(generation(path, g))
        if got is None:
            if g == 0:
                continue  # rotated away or not created yet: the older generation may still answer
            break
        if g == 0:
            offset = got[1]
        lines = got[0] + lines
        if len(lines) >= n:
            break
    return redact_lines(lines[-n:] if n > 0 else [], redact), offset


def redact_lines(lines: list[str], redact: Iterable[str] = ()) -> list[str]:
    """``lines`` with each secret in ``redact``, and any key written as an argument, shown as ``***``."""
    secrets = [s for s in redact if s]
    out = []
    for line in lines:
        for secret in secrets:
            if secret in line:
                line = line.replace(secret, REDACTED)
        out.append(KEY_IN_TEXT.sub(lambda m: m.group(1) + REDACTED, line))
    return out


def read_after(path: Path, offset: int, *, redact: Iterable[str] = ()) -> tuple[list[str], int]:
    """The whole lines written to the live log after ``offset`` (at most ``TAIL_READ_BYTES`` of
    them: the rest comes with the next call), and the offset to go on from: ``ctl logs -f``.

    A rotation truncates the live file (copytruncate), so an offset past its end means the lines
    after it were copied to ``SHARD.log.1``: those are returned, and the follower goes on from the
    start of the live file. A partial last line waits for its newline."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return [], 0
    source, start = path, offset
    if offset > size:
        source = generation(path, 1)
    try:
        with open(source, "rb") as f:
            f.seek(start)
            data = f.read(TAIL_READ_BYTES)
    except OSError:
        data = b""
    if source != path:
        # The rest of the rotated copy, partial line included (nothing more will be added to it).
        return redact_lines(data.decode("utf-8", "replace").splitlines(), redact), 0
    end = data.rfind(b"\n") + 1
    if end == 0 and len(data) == TAIL_READ_BYTES:
        end = len(data)  # one line longer than a read: passed on in pieces rather than never
    return redact_lines(data[:end].decode("utf-8", "replace").splitlines(), redact), offset + end


#: How each engine start begins in the log (``supervisor._spawn`` writes it before the engine runs).
START_MARKER = b"=== llmgw "


def _start_markers(path: Path) -> list[int]:
    """Offsets of the start lines in one log file, last first. Blocks (a scan of the file, in the
    kernel's page cache through mmap: a 50 MiB file is scanned without being read into memory)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return []
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                found = []
                end = len(mm)
                while True:
                    at = mm.rfind(b"\n" + START_MARKER, 0, end)
                    if at < 0:
                        break
                    found.append(at + 1)
                    end = at
                if mm[: len(START_MARKER)] == START_MARKER:
                    found.append(0)
                return found
    except (OSError, ValueError):
        return []


def previous_run(path: Path | None, n: int, *, generations: int = 1, redact: Iterable[str] = ()) -> list[str]:
    """The last ``n`` lines of the engine run before the current one (``ctl logs --previous``):
    what the log holds between its last two start lines, its start line included, across
    rotations. Empty when the kept logs hold one run only."""
    if path is None or n <= 0:
        return []
    found: list[tuple[int, int]] = []  # (generation, offset), newest first
    for g in range(0, max(generations, 0) + 1):
        found += [(g, at) for at in _start_markers(generation(path, g))]
        if len(found) >= 2:
            break
    if len(found) < 2:
        return []
    (g_last, at_last), (g_prev, at_prev) = found[0], found[1]
    # The run's text, newest piece first, until enough bytes for a tail are in hand.
    pieces: list[bytes] = []
    wanted = TAIL_READ_BYTES
    for g in range(g_last, g_prev + 1):
        lo = at_prev if g == g_prev else 0
        try:
            with open(generation(path, g), "rb") as f:
                hi = at_last if g == g_last else f.seek(0, os.SEEK_END)
                start = max(lo, hi - wanted)
                f.seek(start)
                data = f.read(hi - start)
        except OSError:
            break
        pieces.insert(0, data)
        wanted -= len(data)
        if wanted <= 0:
            break
    lines = b"".join(pieces).decode("utf-8", "replace").splitlines()
    return redact_lines(lines[-n:], redact)


__all__ = [
    "KEY_IN_TEXT",
    "REDACTED",
    "START_MARKER",
    "TAIL_READ_BYTES",
    "generation",
    "previous_run",
    "read_after",
    "redact_lines",
    "rotate",
    "tail",
    "tail_and_offset",
]
