"""``python -m agent.engines.sim serve MODEL ...``: run the engine simulator (see the package
docstring for its command line and knobs)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import trio

from agent.engines.sim.config import SimUsageError, parse_command_line
from agent.engines.sim.server import run
from agent.engines.vllm import VERSION as IMITATES


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--version"]:
        # Like `vllm --version`: the version of vLLM whose command line the simulator takes, which
        # the agent reports as this engine's installed version (agent.engines.versions).
        print(IMITATES)
        return 0
    try:
        config = parse_command_line(args, os.environ)
    except SimUsageError as exc:
        print(f"sim: {exc}", file=sys.stderr)
        return 2
    return trio.run(run, config)


if __name__ == "__main__":
    sys.exit(main())
