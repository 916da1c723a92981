"""The gateway's Prometheus metrics (``duetime_`` names), one registry per gateway.

Who keeps them: the attempts' series (decisions, TTFT, forecasts, upstream errors, in flight)
the lifecycle's :class:`~duetime.gateway.observe.attempt_metrics.AttemptMetrics`; requests and
disconnects the completion handler and the picker; health the health trackers; admission the
admission queue and rule; the shared store its backend; the dashboard its feed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5,
                5.0, 10.0, 30.0, 60.0)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
ERROR_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0)
OVERHEAD_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)


WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0)


class AttainedService(Collector):
    """``duetime_attained_service_tokens{key}``: each key's attained service as of the scrape
    (it decays between the admission queue's updates, so it is read, not set); ``read`` is
    the admission queue's (none: no series)."""

    NAME = "duetime_attained_service_tokens"
    HELP = ("Tokens served to the key recently (prompt + output, exponentially decayed with "
            "admission.fairness_half_life_s): what orders the admission queue across keys "
            "(key empty: clients without an API key).")

    def __init__(self) -> None:
        self.read: Callable[[], Mapping[str, float]] = dict

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=["key"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(self.NAME, self.HELP, labels=["key"])
        for key, tokens in sorted(self.read().items()):
            g.add_metric([key], tokens)
        yield g


class GatewayMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series (process-wide; vLLM has none either)
        r = self.registry = CollectorRegistry()
        self._requests(r)
        self._outcomes(r)
        self._health(r)
        self._admission_and_tokens(r)
        self._store_and_reads(r)

    def _requests(self, r: CollectorRegistry) -> None:
        self.requests = Counter("duetime_requests", "Client requests by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.decisions = Counter("duetime_decisions",
                                 "Routing decisions (upstream attempts) per instance and model.",
                                 ["instance", "model"], registry=r)
        self.ttft = Histogram("duetime_ttft_seconds",
                              "Observed time to first token at the gateway (arrival to first "
                              "upstream chunk), per instance that served it.", ["instance"],
                              buckets=TTFT_BUCKETS, registry=r)

    def _outcomes(self, r: CollectorRegistry) -> None:
        self.forecast_ratio = Histogram(
            "duetime_forecast_ttft_ratio",
            "Observed / forecast TTFT of the serving attempt (from the routing decision).",
            ["instance"], buckets=RATIO_BUCKETS, registry=r)
        self.forecast_error = Histogram(
            "duetime_forecast_ttft_error_seconds",
            "Observed - forecast TTFT of the serving attempt (seconds).", ["instance"],
            buckets=ERROR_BUCKETS, registry=r)
        # a histogram with negative buckets has no _sum in the exposition format (OpenMetrics;
        # prometheus_client leaves it out), so the signed sum is its own gauge: mean bias =
        # this / duetime_forecast_ttft_error_seconds_count
        self.forecast_error_sum = Gauge(
            "duetime_forecast_ttft_error_sum_seconds",
            "Sum of observed - forecast TTFT over the serving attempts (seconds; divide by "
            "duetime_forecast_ttft_error_seconds_count for the mean bias).", ["instance"],
            registry=r)
        self.target = Counter("duetime_ttft_target",
                              "Requests with a first token by TTFT-target outcome "
                              "(on_time / late); on-time rate = on_time / total.",
                              ["instance", "outcome"], registry=r)
        self.upstream_errors = Counter("duetime_upstream_errors",
                                       "Failed upstream attempts by instance and kind "
                                       "(connect, timeout, status_5xx, status_429, broken).",
                                       ["instance", "kind"], registry=r)
        self.retries = Counter("duetime_retries", "Upstream attempts after the first.",
                               registry=r)
        self.stream_breaks = Counter(
            "duetime_stream_breaks", "Streams that broke after the client got part of the "
            "answer, by what followed: continued (on another instance of the model), ended "
            "(its answer had ended: the stream was closed), not_resumable (the answer could "
            "not continue exactly), exhausted (no instance could continue it; the stream "
            "ended with an error event).", ["outcome"],
            registry=r)
        self.cancelled = Counter("duetime_client_disconnects",
                                 "Requests whose client went away before the response ended "
                                 "(the upstream request was cancelled).", registry=r)
        self.overhead = Histogram("duetime_routing_seconds",
                                  "Gateway time from a request's arrival to its first upstream "
                                  "send (parsing, state, policy).", buckets=OVERHEAD_BUCKETS,
                                  registry=r)

    def _health(self, r: CollectorRegistry) -> None:
        self.healthy = Gauge("duetime_instance_healthy", "1 if the instance is in rotation.",
                             ["instance"], registry=r)
        self.in_flight = Gauge("duetime_in_flight", "Upstream requests in flight.",
                               ["instance"], registry=r)
        self.ejections = Counter("duetime_ejections", "Times an instance was ejected.",
                                 ["instance"], registry=r)
        self.ejections_refused = Counter(
            "duetime_ejections_refused", "Ejections not made because the pool's budget "
            "(health.max_ejected_fraction) was spent.", ["instance"], registry=r)
        self.membership = Counter(
            "duetime_membership_changes", "Changes of the pool's membership while serving: "
            "join (an instance added, out of rotation), ready (its first health probe passed: "
            "in rotation), update (its URL or spec changed), drain (removed: no new requests), "
            "leave (drained: its state dropped).", ["change"], registry=r)
        self.config_reloads = Counter(
            "duetime_config_reloads", "Pool config files read while serving: applied, or "
            "refused (the running pool kept).", ["outcome"], registry=r)
        self.desired_replicas = Gauge(
            "duetime_desired_replicas", "Replicas the gateway's autoscaler wants for the "
            "model (pool config: autoscale), from the last tick; an actuator (KEDA) scales on "
            "it.", ["model"], registry=r)
        self.members = Gauge("duetime_instances", "The pool's instances by phase (joining, "
                             "serving, draining).", ["phase"], registry=r)

    def _admission_and_tokens(self, r: CollectorRegistry) -> None:
        self.queued = Gauge("duetime_admission_queued",
                            "Critical requests waiting in the gateway for an instance that can "
                            "meet their target.", registry=r)
        self.admission_wait = Histogram(
            "duetime_admission_wait_seconds", "Time critical requests waited in the gateway's "
            "admission queue (released, timed out or displaced), by API key name (empty: "
            "clients without one).", ["key"], buckets=WAIT_BUCKETS, registry=r)
        self.attained = AttainedService()
        r.register(self.attained)
        self.admission = Counter(
            "duetime_admission", "Requests by priority and admission outcome: on_time (a "
            "forecast met the target), queued (waited in the gateway), shed (429), late (sent "
            "to the best forecast, which misses the target).", ["priority", "outcome"],
            registry=r)
        self.tpot_target = Counter(
            "duetime_tpot_target", "Requests with a time-per-output-token target "
            "(x-duetime-tpot-ms, or llm-d's or SGLang's header) by outcome "
            "(on_time / late): mean time per output token after the first.", ["outcome"],
            registry=r)
        self.fail_open = Counter(
            "duetime_fail_open", "Attempts sent to an ejected instance because none of the "
            "request's candidates was in rotation (health.fail_open).", ["instance"],
            registry=r)
        self.cached_tokens = Counter(
            "duetime_prefix_cached_tokens",
            "Prompt tokens the gateway believed cached at the instance when it dispatched "
            "there, by the source of that view (kv-events, estimated); compare with vLLM's "
            "vllm:prefix_cache_hits_total.", ["instance", "source"], registry=r)
        self.prompt_tokens = Counter(
            "duetime_prompt_tokens", "Prompt tokens dispatched to the instance (as counted by "
            "the gateway).", ["instance"], registry=r)
        self.ttft_correction = Gauge(
            "duetime_ttft_correction",
            "The online correction factor of the instance's TTFT forecasts (median observed / "
            "raw forecast over its recent first tokens; 1 while learning or off).",
            ["instance"], registry=r)

    def _store_and_reads(self, r: CollectorRegistry) -> None:
        self.store_up = Gauge("duetime_store_up",
                              "1 while the shared store (Redis) answers; 0 while this replica "
                              "routes on its local state only.", registry=r)
        self.store_errors = Counter("duetime_store_errors",
                                    "Failed calls to the shared store, by operation (sync, "
                                    "limits).", ["op"], registry=r)
        self.store_sync = Histogram("duetime_store_sync_seconds",
                                    "Duration of one sync with the shared store (its round "
                                    "trips).", buckets=OVERHEAD_BUCKETS, registry=r)
        self.store_staleness = Histogram(
            "duetime_store_staleness_seconds",
            "Age of another replica's dispatch when this replica first sees it.",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 5.0),
            registry=r)
        self.store_remote = Gauge("duetime_in_flight_remote",
                                  "Upstream requests in flight that other replicas dispatched, "
                                  "as last synced.", ["instance"], registry=r)
        self.dashboard = Counter("duetime_dashboard_seconds",
                                 "CPU time the gateway spent for its dashboards, by part: "
                                 "update (building an update: one per tick however many "
                                 "watch), explain (explaining the decisions sampled for "
                                 "them).", ["part"], registry=r)
        self.state_source = Counter("duetime_state_reads",
                                    "Instance state reads for routing by source (published, "
                                    "shadow, metrics).", ["instance", "source"], registry=r)
