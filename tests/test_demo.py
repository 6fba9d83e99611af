"""The README's demo command runs to completion as a real process."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_end_to_end() -> None:
    proc = subprocess.run([sys.executable, "-m", "demo"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for node, carrier in (("gpu01", "grpc protocol"), ("gpu02", "connect protocol"), ("gpu03", "websocket")):
        assert f"{node} | registered over" in proc.stdout and carrier in proc.stdout
        assert f"{node} | stream closed cleanly" in proc.stdout
    assert "done: three carriers" in proc.stdout
