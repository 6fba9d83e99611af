"""Engine processes: spawn outside the session, log files, readiness and liveness, drain, stop, adopt."""

from agent.supervise.probes import LivenessProbe, probe_address
from agent.supervise.supervisor import LIVE_STATES, Shard, Supervisor, tail

__all__ = ["LIVE_STATES", "LivenessProbe", "Shard", "Supervisor", "probe_address", "tail"]
