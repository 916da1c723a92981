"""The discrete-event cluster simulator (instances = compiled engines with a true timing)."""

from duetime.sim.cluster import ClusterSim, SimInstance, SimResult

__all__ = ["ClusterSim", "SimInstance", "SimResult"]
