"""The discrete-event cluster simulator (instances = compiled engines with a true timing)."""

from duetime.sim.cluster import ClusterSim, SimResult
from duetime.sim.instance import SimInstance
from duetime.sim.loop import run_clients

__all__ = ["ClusterSim", "SimInstance", "SimResult", "run_clients"]
