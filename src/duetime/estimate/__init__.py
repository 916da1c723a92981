"""Latency estimators behind one interface: how long until a new request's first token.

* ``SfsEstimator``: replay the instance's scheduler from its snapshot (duetime.engine);
* ``ThroughputEstimator``: queued prefill tokens / profiled prefill rate + a mean decode step
  (the SFS paper's baseline estimator);
* ``LpsEstimator``: a limited-processor-sharing queue from time-averaged rates only (the SFS
  paper's no-visibility approximation);
* ``LaarLatency``: LAAR's latency term c(m)·(T(x) + alpha·R(m)) for retry-aware routing
  (``SfsEstimator.e2e`` is the end-to-end forecast duetime's ``ttca`` router uses instead).
"""

from duetime.estimate.base import Estimator, InstanceStats, InstanceView
from duetime.estimate.laar import LaarLatency, queued_tokens
from duetime.estimate.lps import LpsEstimator
from duetime.estimate.sfs import SfsEstimator
from duetime.estimate.throughput import ThroughputEstimator, profile_rates

__all__ = ["Estimator", "InstanceStats", "InstanceView", "LaarLatency", "LpsEstimator",
           "SfsEstimator", "ThroughputEstimator", "profile_rates", "queued_tokens"]
