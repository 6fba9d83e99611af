"""Child processes of the benchmarks, with a bound on every wait for them.

A benchmark waits for its children to say something (a port, ``ready``, a whole fleet registered).
Reading a pipe blocks until a line or end of file comes, so a child that hangs silently would hang
the benchmark with it, whatever deadline the loop around the read means to check. Here a thread per
child reads its stdout into a queue and every wait takes from that queue with a timeout; when the
time is up the child is killed (by its pid, or its process group when it runs in a session of its
own) and the error says what was waited for, from whom, and how long.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

#: How long a child is given to exit after SIGTERM before it is sent SIGKILL.
STOP_GRACE = 10.0


class ChildTimeout(TimeoutError):
    """A child did not say what a benchmark waited for in time (it has been killed)."""


class ChildExited(RuntimeError):
    """A child ended while a benchmark still waited for it to say something."""


class Child:
    """A child process whose stdout is read line by line by a daemon thread.

    ``name`` is how errors call it. stderr goes to this process's stderr (or to ``stderr``), so a
    crash explains itself on the terminal. With ``session=True`` the child gets a session of its own
    and stopping it ends its whole process group (servers that fork workers).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdin: bool = False,
        stderr: IO[bytes] | int | None = None,
        session: bool = False,
    ) -> None:
        self.name = name
        self.session = session
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=cwd,
            text=True,
            start_new_session=session,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"{name} stdout", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        for line in stdout:
            self._lines.put(line)
        self._lines.put(None)  # end of file: the child closed stdout or exited

    def line(self, what: str, timeout: float, prefix: str = "") -> str:
        """The next line that starts with ``prefix`` (other lines are skipped), within ``timeout``
        seconds. ``what`` says what the line means, for the error. Kills the child on a timeout
        (``ChildTimeout``); ``ChildExited`` when it ended first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.0))
            except queue.Empty:
                self.kill()
                raise ChildTimeout(
                    f"{self.name} (pid {self.pid}) did not report {what} within {timeout:g} s; killed it"
                ) from None
            if line is None:
                self._lines.put(None)  # every later wait sees the end too
                code = self.proc.wait()
                raise ChildExited(f"{self.name} (pid {self.pid}) exited {code} before reporting {what}")
            if line.startswith(prefix):
                return line.rstrip("\n")

    def write(self, text: str) -> None:
        """Write ``text`` to the child's stdin (it must have been started with ``stdin=True``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def wait(self, what: str, timeout: float) -> int:
        """The child's exit code, once it exits on its own within ``timeout`` (else it is killed and
        ``ChildTimeout`` names ``what`` it was expected to finish)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ChildTimeout(
                f"{self.name} (pid {self.pid}) did not finish {what} within {timeout:g} s; killed it"
            ) from None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child (its process group with ``session=True``), if it still runs."""
        if self.proc.poll() is not None:
            return
        try:
            if self.session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL, and reap it (the kernel ends a SIGKILLed process promptly)."""
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:  # a process in uninterruptible sleep: nothing more to do
            pass

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; never waits longer than that."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()
