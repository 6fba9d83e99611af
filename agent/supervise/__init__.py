"""Engine processes: spawn outside the session, log files, readiness, drain, stop, adopt."""

from agent.supervise.supervisor import LIVE_STATES, Shard, Supervisor, tail

__all__ = ["LIVE_STATES", "Shard", "Supervisor", "tail"]
