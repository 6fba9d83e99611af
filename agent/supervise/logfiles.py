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


def _last_lines(path: Path) -> list[str] | None:
    """The lines of the last ``TAIL_READ_BYTES`` of ``path``; ``None`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_READ_BYTES))
            data = f.read()
    except OSError:
        return None
    return data.decode("utf-8", "replace").splitlines()


def tail(path: Path | None, n: int, *, generations: int = 1, redact: Iterable[str] = ()) -> list[str]:
    """The last ``n`` lines of a log, reading older generations (``SHARD.log.1`` ...) too when the
    live file has fewer lines than asked for (it was just rotated), with each secret in ``redact``
    replaced by ``***``: an engine may print its own command line, key included."""
    if path is None or n <= 0:
        return []
    lines: list[str] = []
    for g in range(0, max(generations, 0) + 1):
        got = _last_lines(generation(path, g))
        if got is None:
            if g == 0:
                continue  # rotated away or not created yet: the older generation may still answer
            break
        lines = got + lines
        if len(lines) >= n:
            break
    lines = lines[-n:]
    secrets = [s for s in redact if s]
    for i, line in enumerate(lines):
        for secret in secrets:
            if secret in line:
                line = line.replace(secret, REDACTED)
        lines[i] = KEY_IN_TEXT.sub(lambda m: m.group(1) + REDACTED, line)
    return lines


__all__ = ["KEY_IN_TEXT", "REDACTED", "TAIL_READ_BYTES", "generation", "rotate", "tail"]
