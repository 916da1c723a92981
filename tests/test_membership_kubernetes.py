"""``discover: kubernetes``: an InferencePool's ready pods as the members of a group, through
the official Kubernetes client's list and watch — against a stand-in API server
(tests/kube_api.py: no cluster runs here), the pods being emulators on 127.0.0.2-4 on the
pool's target port. ``duetime epp`` runs the same gateway, so it follows the same pods."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from duetime.gateway.config import ConfigError
from duetime.gateway.kubernetes import pool_target
from duetime.gateway.state.membership import Phase
from duetime.service import Service, pool_from_dict
from duetime.web.server import AppServer
from kube_api import KubeApi, kubeconfig
from test_membership import PRICE, chat, config, inst, run, wait_for
from test_membership_dns import replicas, shared_port

LABELS = {"app": "vllm-big"}


def group(**kw) -> dict:
    return {"name": "big", "model": "big", "profile": "qwen3-0.6b", "price_usd_per_mtok": PRICE,
            "discover": "kubernetes", "inference_pool": "ml/vllm-big", **kw}


def test_pool_target_and_config_errors():
    assert pool_target({"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}},
                                 "targetPorts": [{"number": 8000}]}}) == ("a=1,b=2", [8000])
    with pytest.raises(ValueError, match=r"no selector\.matchLabels or no targetPorts"):
        pool_target({"spec": {"selector": {"matchLabels": {"a": "1"}}}})
    with pytest.raises(ConfigError, match="inference_pool: required with discover"):
        pool_from_dict(config(inst("s", "small"), group(inference_pool=None)), "p.yaml")
    with pytest.raises(ConfigError, match="no url or emulate"):
        pool_from_dict(config(inst("s", "small"), group(url="http://x:1")), "p.yaml")
    with pytest.raises(ConfigError, match="inference_pool: only with discover: kubernetes"):
        pool_from_dict(config({**inst("s", "small"), "inference_pool": "a/b"}), "p.yaml")


def test_inference_pool_pods_are_the_members(tmp_path: Path):
    """Two ready pods: two members, both served; a pod that is not ready is not one until it
    is; a deleted pod drains and leaves; the API server gone: the members stay."""
    async def main() -> None:
        port = shared_port()
        api = KubeApi("ml", "vllm-big", LABELS, [port])
        await api.put("pod-a", "127.0.0.2")
        await api.put("pod-b", "127.0.0.3")
        await api.put("other", "127.0.0.4", labels={"app": "something-else"})
        server = await AppServer(api.app(), host="127.0.0.1", port=0).start()
        cfg = config(inst("s", "small"), group(), discovery={
            "kubeconfig": str(kubeconfig(tmp_path / "kubeconfig", server.url)), "watch_s": 0})
        try:
            async with replicas(port):
                svc = await Service(pool_from_dict(cfg, str(tmp_path / "pool.yaml"))).start()
                gw = svc.gateway
                assert gw is not None
                try:
                    async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                        want = {"big@pod-a", "big@pod-b"}
                        assert await wait_for(lambda: {s.name for s in gw.membership.serving}
                                              == want | {"s"})
                        assert gw.membership.get("big@pod-a").url == f"http://127.0.0.2:{port}"
                        assert {await chat(c) for _ in range(4)} == want
                        await api.put("pod-c", "127.0.0.4", ready=False)
                        await wait_for(lambda: False, 0.5)
                        assert gw.membership.get("big@pod-c") is None
                        await api.put("pod-c", "127.0.0.4")
                        assert await wait_for(lambda: getattr(gw.membership.get("big@pod-c"),
                                                              "phase", None) is Phase.SERVING)
                        await api.delete("pod-a")
                        assert await wait_for(lambda: gw.membership.get("big@pod-a") is None)
                        assert {await chat(c) for _ in range(4)} == {"big@pod-b", "big@pod-c"}
                        await server.stop(force=True)  # (the API server gone)
                        await wait_for(lambda: False, 0.5)
                        assert {s.name for s in gw.membership.serving} == {
                            "s", "big@pod-b", "big@pod-c"}
                finally:
                    await svc.stop()
        finally:
            await server.stop(force=True)

    run(main())


def test_the_picker_follows_the_pods(tmp_path: Path):
    """``duetime epp`` over the same group: the endpoints it answers Envoy with are the ready
    pods' ``ip:port``, and a deleted pod's endpoint is dropped once it left."""
    from duetime.service.epp import PickerService

    async def main() -> None:
        port = shared_port()
        api = KubeApi("ml", "vllm-big", LABELS, [port])
        await api.put("pod-a", "127.0.0.2")
        await api.put("pod-b", "127.0.0.3")
        server = await AppServer(api.app(), host="127.0.0.1", port=0).start()
        cfg = config(inst("s", "small"), group(), discovery={
            "kubeconfig": str(kubeconfig(tmp_path / "kubeconfig", server.url)), "watch_s": 0})
        try:
            async with replicas(port):
                svc = await PickerService(pool_from_dict(cfg, str(tmp_path / "pool.yaml")),
                                          host="127.0.0.1", port=0).start()
                try:
                    assert svc.picker is not None and svc.gateway is not None
                    eps = svc.picker.endpoints.by_name
                    assert await wait_for(lambda: eps.get("big@pod-a") == f"127.0.0.2:{port}"
                                          and eps.get("big@pod-b") == f"127.0.0.3:{port}")
                    await api.delete("pod-a")
                    assert await wait_for(lambda: "big@pod-a" not in eps)
                    assert svc.picker.endpoints.by_endpoint[f"127.0.0.3:{port}"].name == \
                        "big@pod-b"
                finally:
                    await svc.stop(grace_s=0)
        finally:
            await server.stop(force=True)

    run(main())
