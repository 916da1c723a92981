"""An InferencePool's pods, watched through the Kubernetes API: the members of a
``discover: kubernetes`` group.

The Gateway API Inference Extension's ``InferencePool``
(``inference.networking.k8s.io/v1``) names its model servers by a label ``selector``
(``matchLabels``) and the ``targetPorts`` they serve on. The watch reads the pool, then
lists and watches the pods its selector matches in its namespace (the official client's
``watch.Watch``, in a thread of its own: the client is synchronous); a pod is a member while
it is Running, Ready, has an IP and is not being deleted — one member per target port,
``group@pod`` (``group@pod:port`` with several ports). Each change is handed to the event
loop; the watch is re-opened (and the pool read again) when the server ends it, after a
failure every :data:`RETRY_S`.

Needs the ``kubernetes`` package (``pip install 'duetime[epp]'``); the API is reached with
the pod's service account (in-cluster) or a kubeconfig (``discovery.kubeconfig``, else
``$KUBECONFIG``). RBAC: ``get`` on ``inferencepools``, ``list`` and ``watch`` on ``pods``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from duetime.gateway.changes import Endpoint
from duetime.gateway.config import Instance

log = logging.getLogger("duetime.gateway")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
RETRY_S = 2.0  # after a failed read or watch
WATCH_S = 60  # the server ends each watch after this long (then it is re-opened)


def pod_ready(pod: Any) -> bool:
    """Running, Ready, with an IP, and not being deleted."""
    st = pod.status
    if pod.metadata.deletion_timestamp is not None or st is None or not st.pod_ip:
        return False
    ready = any(c.type == "Ready" and c.status == "True" for c in (st.conditions or []))
    return st.phase == "Running" and ready


def pool_target(body: dict[str, Any]) -> tuple[str, list[int]]:
    """An InferencePool's label selector (``k=v,...``) and target ports; ValueError if it
    has neither."""
    spec = body.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [int(p["number"]) for p in spec.get("targetPorts") or [] if "number" in p]
    if not labels or not ports:
        raise ValueError("its spec has no selector.matchLabels or no targetPorts")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), ports


class PodWatch:
    """The ready pods of ``group``'s InferencePool: ``on_change(endpoints)`` is called on the
    event loop that :meth:`start` ran on, with every member at each change."""

    def __init__(self, group: Instance, kubeconfig: str | None,
                 on_change: Callable[[list[Endpoint]], None]) -> None:
        assert group.inference_pool is not None
        ns, _, name = group.inference_pool.rpartition("/")
        self.namespace, self.name = ns or "default", name
        self.group = group.name
        self.kubeconfig = kubeconfig
        self.on_change = on_change
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self.pods: dict[str, tuple[str, bool]] = {}  # name -> (IP, ready)
        self._first = True  # (the first list is published even if empty)
        self.ports: list[int] = []

    def start(self) -> PodWatch:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"duetime-pods-{self.group}")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the thread ends at the watch's next event or timeout)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def endpoints(self) -> list[Endpoint]:
        multi = len(self.ports) > 1
        return sorted((f"{pod}:{port}" if multi else pod, ip, port)
                      for pod, (ip, ready) in self.pods.items() if ready
                      for port in self.ports)

    def _publish(self) -> None:
        if self._loop is not None and not self._stop.is_set():
            self._loop.call_soon_threadsafe(self.on_change, self.endpoints())

    def _clients(self) -> tuple[Any, Any, Any]:
        from kubernetes import client, config, watch

        if self.kubeconfig is not None:
            api = config.new_client_from_config(config_file=self.kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.ApiClient()
        return client.CustomObjectsApi(api), client.CoreV1Api(api), watch

    def _run(self) -> None:
        where = f"{self.namespace}/{self.name}"
        reported = ""
        while not self._stop.is_set():
            try:
                custom, core, watch = self._clients()
                body = custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                           PLURAL, self.name)
                selector, self.ports = pool_target(body)
                self._follow(core, watch, selector)
                reported = ""
            except Exception as e:  # (an API error, a bad pool, a dropped connection)
                if self._stop.is_set():
                    return
                if str(e) != reported:
                    reported = str(e)
                    log.warning("InferencePool not watched: members kept", extra={"fields": {
                        "event": "pods_failed", "group": self.group, "pool": where,
                        "error": reported[:300]}})
                self._stop.wait(RETRY_S)

    def _follow(self, core: Any, watch: Any, selector: str) -> None:
        """List the pods, then watch their changes from that list's version until the server
        ends the watch; each change that alters the members is published."""
        listed = core.list_namespaced_pod(self.namespace, label_selector=selector)
        self._set({p.metadata.name: _state(p) for p in listed.items})
        self._watch = w = watch.Watch()
        for event in w.stream(core.list_namespaced_pod, self.namespace,
                              label_selector=selector, timeout_seconds=WATCH_S,
                              resource_version=listed.metadata.resource_version):
            if self._stop.is_set():
                w.stop()
                return
            pod, kind = event["object"], event["type"]
            pods = dict(self.pods)
            if kind == "DELETED":
                pods.pop(pod.metadata.name, None)
            elif kind in ("ADDED", "MODIFIED"):
                pods[pod.metadata.name] = _state(pod)
            self._set(pods)

    def _set(self, pods: dict[str, tuple[str, bool]]) -> None:
        before = self.endpoints()
        self.pods = pods
        if self.endpoints() != before or self._first:
            self._first = False
            self._publish()


def _state(pod: Any) -> tuple[str, bool]:
    """A pod's (IP, whether it serves)."""
    return (pod.status.pod_ip or "") if pod.status else "", pod_ready(pod)
