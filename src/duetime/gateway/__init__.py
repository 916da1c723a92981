"""The OpenAI-compatible router service: upstream clients, per-instance live state, the policy
call, streaming pass-through, retries and ejection, Prometheus metrics. See docs/gateway.md.

It never imports the emulator: a pool's embedded (``emulate:``) instances are started by
:mod:`duetime.service`, which gives the gateway their URLs."""

from duetime.gateway.app import Gateway
from duetime.gateway.config import ConfigError, Pool, load_pool, pool_from_dict
from duetime.gateway.inflight import Flight, FlightStore, MemoryStore
from duetime.gateway.instance import InstanceState

__all__ = ["ConfigError", "Flight", "FlightStore", "Gateway", "InstanceState", "MemoryStore",
           "Pool", "load_pool", "pool_from_dict"]
