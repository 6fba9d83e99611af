"""``python -m agent.engines.sim serve MODEL ...``: run the engine simulator (see the package
docstring for its command line and knobs)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import trio

from agent.engines.flagsets import FlagSetError
from agent.engines.sim.config import EngineUsageError, SimUsageError, imitated, parse_command_line
from agent.engines.sim.server import run


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args == ["--version"]:
            # Like `vllm --version`: the version of vLLM whose command line the simulator takes
            # (the newest flag file, or LLMGW_SIM_VLLM_VERSION's), which the agent reports as this
            # engine's installed version (agent.engines.versions), so adapters build for it.
            print(imitated(os.environ).version)
            return 0
        config = parse_command_line(args, os.environ)
    except EngineUsageError as exc:
        # vLLM's words and exit status: argparse's usage line and error, or its config error.
        if exc.usage:
            print(exc.usage, file=sys.stderr)
        print(exc, file=sys.stderr)
        return exc.exit_code
    except (SimUsageError, FlagSetError) as exc:
        print(f"sim: {exc}", file=sys.stderr)
        return 2
    return trio.run(run, config)


if __name__ == "__main__":
    sys.exit(main())
