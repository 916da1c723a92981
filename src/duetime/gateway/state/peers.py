"""The other gateway replicas, as an instance's state sees them: their flights on the instance
(each joins the shadow replica), their ejections, and this replica's own ejections told to
them. Redis carries them (:mod:`duetime.gateway.backends.redis_flights`); a gateway alone has
:data:`NO_PEERS`. State never imports a backend: it is given one that meets these protocols.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from duetime.gateway.state.flight import Flight


class PeerListener(Protocol):
    """What an instance does with the other replicas' flights (``now``: monotonic)."""

    def on_peer_dispatch(self, flight: Flight, now: float) -> None: ...

    def on_peer_first_token(self, flight: Flight, now: float) -> None: ...

    def on_peer_end(self, flight: Flight, now: float) -> None: ...

    def on_peer_eject(self, by: str) -> None:
        """Replica ``by`` ejected the instance."""
        ...

    def on_peer_readmit(self) -> None:
        """No replica holds the instance ejected now."""
        ...


class PeerFeed(Protocol):
    """The other replicas' view of the pool, per instance (by name)."""

    def remote(self, instance: str) -> Mapping[str, Flight]:
        """The other replicas' flights on ``instance``, as last synced."""
        ...

    def listen(self, instance: str, listener: PeerListener) -> None:
        """Hand ``listener`` every change of the others' flights and ejections there."""
        ...

    def eject(self, instance: str, ejected: bool) -> None:
        """This replica ejected (or readmitted) ``instance``: the others follow."""
        ...


class _NoPeers:
    """A gateway alone: no other replica."""

    def remote(self, instance: str) -> Mapping[str, Flight]:
        return {}

    def listen(self, instance: str, listener: PeerListener) -> None:
        pass

    def eject(self, instance: str, ejected: bool) -> None:
        pass


NO_PEERS: PeerFeed = _NoPeers()
