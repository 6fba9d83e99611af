"""The README's demo command runs to completion as a real process and cleans up after itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def sim_engines() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"agent.engines.sim" in cmd and b"llama-3.1-8b-instruct" in cmd:
                pids.add(int(entry.name))
    return pids


def test_demo_runs_end_to_end() -> None:
    before = sim_engines()
    proc = subprocess.run([sys.executable, "-m", "demo"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "waiting for replicas: 2/2 ready" in out
    streamed = out.split("(model llama-3.1-8b-instruct, streaming):", 1)[1].splitlines()[1]
    assert len(streamed.split()) >= 5  # tokens arrived through the router
    assert re.search(r"gpu01\s+ready", out) and re.search(r"gpu02\s+ready", out)
    assert out.count("llama-3.1-8b-instruct-r") >= 4 and re.search(r"http://127\.0\.0\.[12]:21[01]\d\d", out)
    assert out.rstrip().endswith("demo | done")
    # Every engine the demo started is gone again.
    assert sim_engines() <= before
