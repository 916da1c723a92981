"""The discrete-event cluster simulator (instances = compiled engines with a true timing)."""

from duetime.autoscale import Autoscaler, PoolStatus, Scripted, Static
from duetime.sim.cluster import ClusterSim, SimResult
from duetime.sim.instance import SimInstance
from duetime.sim.loop import run_clients
from duetime.sim.scaling import Scaling

__all__ = ["Autoscaler", "ClusterSim", "PoolStatus", "Scaling", "Scripted", "SimInstance",
           "SimResult", "Static", "run_clients"]
