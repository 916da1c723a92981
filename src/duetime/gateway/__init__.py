"""The OpenAI-compatible router service, as a pipeline of stages, one sub-package each
(docs/architecture.md walks a request through them):

========== ==================================================================================
state/     each instance's live state: in-flight ledger, shadow replica, published snapshots,
           scraped load, health, the gateway's own load, pollers, KV events; and the attempt
           lifecycle that feeds them
intake/    a request becomes a context: keys and limits, parsing, prompt tokens, controls,
           policy, candidates, predictions; admission by priority
routing/   the decision and its explanation
relay/     the completion routes: attempts and retries, upstream streams, reassembly
backends/  what gateway replicas share: memory or Redis
picker/    the endpoint picker for Envoy (``duetime epp``)
observe/   observation: the dashboard's history and feed, admin routes, pages, OpenAPI,
           Prometheus series of attempts
========== ==================================================================================

Beside them: the pool config (:mod:`.config`, :mod:`.keys`), the Prometheus registry
(:mod:`.prometheus`) and the HTTP client to the instances (:mod:`.upstream`). The composition
root is :mod:`.app` (``Gateway``); nothing in the gateway imports it.

It never imports the emulator: a pool's embedded (``emulate:``) instances are started by
:mod:`duetime.service`, which gives the gateway their URLs.
"""

from duetime.gateway.config import ConfigError, Pool, load_pool, pool_from_dict

__all__ = ["ConfigError", "Pool", "load_pool", "pool_from_dict"]
