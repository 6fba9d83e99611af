"""The README's demo command runs to completion as a real process and cleans up after itself."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from tests.support import processes


def sim_engines() -> set[int]:
    return set(processes(lambda argv: b"agent.engines.sim" in argv and b"llama-3.1-8b-instruct" in argv))


def test_demo_runs_end_to_end() -> None:
    before = sim_engines()
    proc = subprocess.run([sys.executable, "-m", "demo"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "waiting for replicas: 2/2 ready" in out
    streamed = out.split("(model llama-3.1-8b-instruct, streaming):", 1)[1].splitlines()[1]
    assert len(streamed.split()) >= 5  # tokens arrived through the router
    assert re.search(r"gpu01\s+ready", out) and re.search(r"gpu02\s+ready", out)
    assert re.search(r"llama-3\.1-8b-instruct\s+2/2\s+2\s+2", out)  # get models: READY PLACED WANTED
    replicas = re.findall(
        r"^llama-3\.1-8b-instruct-r\d\s+llama-3\.1-8b-instruct\s+ready\s.*\s21[01]\d\d(\s+\S+){5}$", out, re.M
    )
    assert len(replicas) == 2, (
        out
    )  # get replicas -o wide: both ready, each with its engine's port, then its five load columns
    assert out.rstrip().endswith("demo | done")
    # Every engine the demo started is gone again.
    assert sim_engines() <= before


def test_demo_serve_prints_lines_that_make_ctl_work_in_another_shell() -> None:
    """``--serve`` prints ``export LLMGW_API=...`` and a ctl command; run as printed, in a fresh
    environment (another shell), ctl reaches the demo's admin API and shows both nodes ready."""
    before = sim_engines()
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo", "--serve"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        # The printed command is the first line after the exports without the "demo | " prefix.
        while not (
            seen
            and seen[-1].endswith(" -m control ctl get nodes -o wide\n")
            and not seen[-1].startswith("demo |")
        ):
            try:
                seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                raise AssertionError(f"no ctl lines within 240 s: {''.join(seen)}") from None
        exports = [line for line in seen if line.startswith("export ")]
        assert [line.split("=", 1)[0] for line in exports] == ["export LLMGW_API"], seen
        shell = subprocess.run(
            ["sh", "-c", "".join(exports) + seen[-1]],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": os.environ.get("PATH", "")},  # nothing of this test's environment
        )
        assert shell.returncode == 0, shell.stderr
        assert re.search(r"gpu01\s+ready", shell.stdout) and re.search(r"gpu02\s+ready", shell.stdout)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0
    assert sim_engines() <= before
