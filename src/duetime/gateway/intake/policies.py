"""The policy a request is routed by: the pool's, or (``x-duetime-policy`` /
``x-duetime-lambda``) another registered one, built with the pool's shared settings
(:meth:`~duetime.gateway.config.Pool.policy_defaults`) and the inputs the gateway provides
(its replicas' shared session bindings, to a policy that consumes them)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableMapping

from duetime.gateway.config import Pool
from duetime.policy import make_policy
from duetime.policy.base import Policy

MAX_VARIANTS = 32  # policies kept for requests that ask for another policy or lambda


class PolicyBook:
    """The pool's policy (:attr:`default`) and the variants requests asked for (kept for the
    next requests that ask for the same; at most ``MAX_VARIANTS``, the least recently used
    dropped). ``bindings``: session bindings shared by the gateway's replicas (None: each
    session-affinity policy keeps its own)."""

    def __init__(self, pool: Pool, *,
                 bindings: MutableMapping[str, str] | None = None) -> None:
        self.pool = pool
        self.bindings = bindings
        self.default = self._make(pool.policy, dict(pool.policy_params), None)
        self.variants: OrderedDict[tuple[str, float | None], Policy] = OrderedDict()

    def _make(self, name: str, params: dict, lam: float | None) -> Policy:
        return make_policy(name, params, defaults=self.pool.policy_defaults(lam),
                           bindings=self.bindings)

    def get(self, name: str | None, lam: float | None) -> Policy:
        """The policy for a request that asked for ``name`` (None: the pool's) and ``lam``
        (None: the pool's lambda)."""
        pool = self.pool
        name = name or pool.policy
        if name == pool.policy and lam is None:
            return self.default
        key = (name, lam)
        found = self.variants.get(key)
        if found is not None:
            self.variants.move_to_end(key)
            return found
        params = dict(pool.policy_params) if name == pool.policy else {}
        if lam is not None:
            params.pop("lambda", None)
            params.pop("lam", None)
        policy = self.variants[key] = self._make(name, params, lam)
        while len(self.variants) > MAX_VARIANTS:
            self.variants.popitem(last=False)
        return policy
