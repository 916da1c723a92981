"""The OpenAI-compatible router service: upstream clients, per-instance live state, the policy
call, streaming pass-through, retries and ejection, Prometheus metrics. See docs/gateway.md."""

from duetime.gateway.app import Gateway
from duetime.gateway.config import ConfigError, Pool, demo_pool, load_pool, pool_from_dict
from duetime.gateway.service import Service
from duetime.gateway.state import InstanceState

__all__ = ["ConfigError", "Gateway", "InstanceState", "Pool", "Service", "demo_pool",
           "load_pool", "pool_from_dict"]
