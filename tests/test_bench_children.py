"""bench.children: every wait of a benchmark on a child process is bounded, whatever the child
prints or does not print, and a child that overstays is killed by its pid."""

from __future__ import annotations

import signal
import sys

import pytest

from bench.children import Child, ChildExited, ChildTimeout


def test_a_silent_child_is_killed_when_the_wait_for_its_line_runs_out() -> None:
    child = Child("the silent one", [sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(
        ChildTimeout, match=r"the silent one \(pid \d+\) did not report its port within 0.5 s; killed it"
    ):
        child.line("its port", 0.5)
    assert child.proc.returncode == -signal.SIGKILL


def test_lines_before_the_awaited_one_are_skipped_and_an_early_exit_is_named() -> None:
    child = Child("the chatty one", [sys.executable, "-c", "print('hello'); print('all 3 1.5', flush=True)"])
    assert child.line("the fleet registered", 30, prefix="all ") == "all 3 1.5"
    with pytest.raises(ChildExited, match=r"the chatty one \(pid \d+\) exited 0 before reporting more"):
        child.line("more", 30)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    child = Child("the stubborn one", [sys.executable, "-c", code], session=True)
    assert child.line("ready", 30) == "ready"
    child.stop(grace=0.5)
    assert child.proc.returncode == -signal.SIGKILL
