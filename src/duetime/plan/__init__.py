"""Capacity planning: the cheapest pool (models, replicas, GPUs) that meets a workload's
targets with the router in the loop (``duetime plan``, docs/plan.md)."""
