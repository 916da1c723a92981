"""The gateway with embedded emulated instances: ``duetime serve``.

It sits above both :mod:`duetime.gateway` and :mod:`duetime.emulator` (which never import each
other): it validates a pool config's ``emulate:`` blocks as emulator options, starts those
emulators on loopback, fills in their URLs and starts the gateway in front; it stops them in
the opposite order.
"""

from duetime.gateway.config import ConfigError, Pool
from duetime.service.pool import DEMO_MODELS, demo_pool, embedded_options, load_pool, pool_from_dict
from duetime.service.runner import Service

__all__ = ["DEMO_MODELS", "ConfigError", "Pool", "Service", "demo_pool", "embedded_options",
           "load_pool", "pool_from_dict"]
