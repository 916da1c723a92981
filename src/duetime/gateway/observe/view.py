"""What the observation routes read of the gateway they serve: a typed seam, so that they never
import the composition root (``gateway/app.py``), which provides it."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from duetime.gateway.config import Pool
from duetime.gateway.intake.auth import Auth
from duetime.gateway.intake.request import Intake
from duetime.gateway.observe.observatory import Observatory
from duetime.gateway.observe.replicas import DesiredReplicas
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.routing.router import Router
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.membership import Membership


class GatewayView(Protocol):
    """The gateway's parts the admin routes and the dashboard read."""

    pool: Pool
    instances: list[InstanceState]
    membership: Membership
    metrics: GatewayMetrics
    auth: Auth
    intake: Intake
    router: Router
    observatory: Observatory
    replicas: DesiredReplicas
    draining: asyncio.Event  # set when the server stops: event streams end

    def describe_store(self) -> dict[str, Any]:
        """Where the gateway keeps its shared state (for ``/duetime/instances``)."""
        ...
