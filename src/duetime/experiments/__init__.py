"""The papers' experiments as named, reproducible runs, and their reports."""

from duetime.experiments.catalog import EXPERIMENTS, run_experiment
from duetime.experiments.runner import Point, Runner

__all__ = ["EXPERIMENTS", "Point", "Runner", "run_experiment"]
