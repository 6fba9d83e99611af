"""Engine log files: rotation by size, and the tail of a log across a rotation.

An engine writes ``log_dir/SHARD.log`` through a file descriptor it inherited at spawn (never a
pipe: a pipe would break the engine when the agent dies), so the agent cannot reopen the file for
it. Rotation is therefore logrotate's ``copytruncate``: the older generations move up one
(``SHARD.log.1`` -> ``SHARD.log.2`` ...), the current contents are copied to ``SHARD.log.1``, and
``SHARD.log`` is truncated to zero in place. The engine's descriptor was opened with ``O_APPEND``,
so its next write lands at the new end (offset 0) rather than leaving a hole the size of the old
file.

**The window.** Lines the engine writes between the end of the copy and the truncation are lost,
as with logrotate's copytruncate. The copy is one ``sendfile`` of the file as it stands and the
truncation follows at once, so the window is the time to copy one generation (milliseconds for the
default 50 MiB from the page cache); a partial line at the boundary may also be split between
``SHARD.log.1`` and ``SHARD.log``.

Every function here blocks on the filesystem: the supervisor calls them from a worker thread.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

#: How much of each file a tail reads at most (a tail is for a person, or a failure report).
TAIL_READ_BYTES = 256 * 1024
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
        shutil.copyfile(path, tmp)  # sendfile on Linux: the copy is as short as it can be
        os.truncate(path, 0)
        os.replace(tmp, newest)
    else:
        os.truncate(path, 0)
    return True


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
