"""Writing a state file so that a crash at any instant leaves the old contents or the new, whole.

Every llmgw process keeps something a restart needs in a small file: the control plane its fleet
(``control-state.json``), the join token and credential digests, the shard key secret; the agent its
credential and one record per engine. They are all written the same way, here:

1. the new contents go to a temporary file beside the target (``.NAME.tmp``), created with the
   file's mode from the first byte (0600 by default: most of these files hold secrets or what
   points to them), and ``fchmod``-ed as well, since ``O_CREAT`` keeps the mode of a leftover;
2. that file is fsynced: without it ext4 and XFS may put the rename on disk before the data, and a
   crash leaves the name on an empty or partial file;
3. it is renamed over the target (``os.replace``, atomic on POSIX), or linked to a target that must
   not exist yet (``replace=False``: a secret created once, never overwritten by a racing second
   writer);
4. the directory is fsynced: without it the rename itself may not survive a power loss.

A write that fails removes its temporary file and raises the ``OSError``; the target is untouched.
Because the target is replaced by the temporary file, it takes the temporary file's mode: a state
file an older version left world-readable is 0600 after the next write.

Everything here blocks on the filesystem. ``write_atomic`` is for worker threads and synchronous
code; ``write_atomic_async`` runs it in a trio worker thread, so the event loop never waits on a
disk. This package imports nothing of llmgw's: the agent and the control plane both use it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import trio

#: ``link()`` errors of a filesystem that has no hard links.
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})

#: Suffix of the temporary file a write uses (``.NAME.tmp``): what a cleanup of leftovers looks for.
TEMP_SUFFIX = ".tmp"


def temp_path(path: Path) -> Path:
    """The temporary file a write of ``path`` uses: hidden, beside it, so the rename stays within
    one filesystem, and named after it, so a leftover of a crashed write is recognisable."""
    return path.with_name(f".{path.name}{TEMP_SUFFIX}")


def sync_dir(directory: Path) -> None:
    """fsync ``directory``, so that renames and creations in it survive a power loss."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o600, replace: bool = True) -> bool:
    """Make ``path`` hold ``data`` (text is UTF-8), atomically and durably, with ``mode``.

    With ``replace=False`` an existing ``path`` is left as it is and False returned (a secret made
    on a first start must not be overwritten by a second process making its own). Otherwise returns
    True once the new contents and their name are on disk. Blocks: see the module docstring.
    Raises ``OSError`` (the target unchanged, no temporary file left behind)."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # a leftover temporary file keeps its own mode through O_CREAT
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                # A filesystem without hard links (some FUSE and SMB mounts): check, then rename.
                # Only a second writer racing this one could slip between the two.
                if os.path.lexists(path):
                    return False
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)
    return True


async def write_atomic_async(
    path: Path, data: bytes | str, *, mode: int = 0o600, replace: bool = True
) -> bool:
    """``write_atomic`` in a trio worker thread (the loop never blocks on fsync)."""
    return await trio.to_thread.run_sync(lambda: write_atomic(path, data, mode=mode, replace=replace))


__all__ = ["TEMP_SUFFIX", "sync_dir", "temp_path", "write_atomic", "write_atomic_async"]
