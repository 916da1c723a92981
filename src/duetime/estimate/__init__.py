"""Latency estimators behind one interface: how long until a new request's first token.

* ``SfsEstimator``: replay the instance's scheduler from its snapshot (duetime.engine);
* ``ThroughputEstimator``: queued prefill tokens / profiled prefill rate + a mean decode step
  (the SFS paper's baseline estimator);
* ``LpsEstimator``: a limited-processor-sharing queue from time-averaged rates only (the SFS
  paper's no-visibility approximation);
* ``LaarLatency``: LAAR's latency term c(m)·(T(x) + alpha·R(m)) for retry-aware routing
  (``SfsEstimator.e2e`` is the end-to-end forecast duetime's ``ttca`` router uses instead).

And what a cache-aware router knows of an instance's prefix cache: a ``PrefixIndex`` (precise,
or ``EstimatedPrefixIndex``: an LRU learnt from the router's own decisions), read from a view
with ``prefix_index_of``.
"""

from duetime.estimate.base import Estimator, InstanceStats, InstanceView
from duetime.estimate.laar import LaarLatency, queued_tokens
from duetime.estimate.lps import LpsEstimator
from duetime.estimate.prefix_index import EstimatedPrefixIndex, PrefixIndex, prefix_index_of
from duetime.estimate.sfs import SfsEstimator
from duetime.estimate.throughput import ThroughputEstimator, profile_rates

__all__ = ["EstimatedPrefixIndex", "Estimator", "InstanceStats", "InstanceView", "LaarLatency",
           "LpsEstimator", "PrefixIndex", "SfsEstimator", "ThroughputEstimator",
           "prefix_index_of", "profile_rates", "queued_tokens"]
