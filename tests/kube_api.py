"""A stand-in for the Kubernetes API server, for the InferencePool watch's tests: no cluster
runs here. It serves what the watch reads — one ``InferencePool``
(``inference.networking.k8s.io/v1``) and the pods of a namespace, listed (``PodList`` with
a ``resourceVersion``) and watched (newline-delimited ``{"type", "object"}`` events after a
``resourceVersion``, the stream ended after ``timeoutSeconds``) — as the API server's
documentation describes them, to the official ``kubernetes`` client over HTTP. What it does
not do (authentication, field selectors, bookmarks, ``410 Gone`` on an expired version) the
watch does not ask for."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class KubeApi:
    """Pods and one InferencePool; :meth:`app` serves them."""

    def __init__(self, namespace: str, pool: str, labels: dict[str, str],
                 ports: list[int]) -> None:
        self.namespace, self.pool_name, self.labels, self.ports = namespace, pool, labels, ports
        self.pods: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.version = 1
        self.changed = asyncio.Condition()
        self.watches = 0  # watch requests served (tests wait on it)

    def pod(self, name: str, ip: str, *, ready: bool = True, labels: dict | None = None,
            phase: str = "Running") -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": dict(self.labels if labels is None else labels),
                             "resourceVersion": str(self.version)},
                "status": {"phase": phase, "podIP": ip, "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False"}]}}

    async def put(self, name: str, ip: str, **kw: Any) -> None:
        """Create or change a pod."""
        async with self.changed:
            self.version += 1
            kind = "MODIFIED" if name in self.pods else "ADDED"
            self.pods[name] = self.pod(name, ip, **kw)
            self.events.append((self.version, kind, self.pods[name]))
            self.changed.notify_all()

    async def delete(self, name: str) -> None:
        async with self.changed:
            self.version += 1
            pod = self.pods.pop(name)
            self.events.append((self.version, "DELETED", pod))
            self.changed.notify_all()

    def _selected(self, pod: dict[str, Any], selector: str) -> bool:
        want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
        labels = pod["metadata"]["labels"]
        return all(labels.get(k) == v for k, v in want.items())

    def app(self) -> Starlette:
        async def pool(request: Request) -> Response:
            p = request.path_params
            if (p["ns"], p["name"]) != (self.namespace, self.pool_name):
                return JSONResponse({"kind": "Status", "code": 404, "reason": "NotFound"}, 404)
            return JSONResponse({
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": self.pool_name, "namespace": self.namespace},
                "spec": {"selector": {"matchLabels": self.labels},
                         "targetPorts": [{"number": n} for n in self.ports],
                         "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}})

        async def pods(request: Request) -> Response:
            q = request.query_params
            selector = q.get("labelSelector", "")
            if q.get("watch") not in ("true", "1"):
                return JSONResponse({
                    "apiVersion": "v1", "kind": "PodList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": [p for p in self.pods.values() if self._selected(p, selector)]})
            self.watches += 1
            since = int(q.get("resourceVersion") or 0)
            timeout = float(q.get("timeoutSeconds") or 60)
            return StreamingResponse(self._stream(since, selector, timeout),
                                     media_type="application/json")

        return Starlette(routes=[
            Route("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                  pool), Route("/api/v1/namespaces/{ns}/pods", pods)])

    async def _stream(self, since: int, selector: str, timeout: float):
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            for version, kind, pod in self.events:
                if version > since and self._selected(pod, selector):
                    yield (json.dumps({"type": kind, "object": pod}) + "\n").encode()
                since = max(since, version)
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.0, end - loop.time()))
                except TimeoutError:
                    return


def kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig whose current context is the API server at ``url``."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": url}}],
        "users": [{"name": "test", "user": {"token": "test"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    return path
