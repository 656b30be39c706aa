"""Prometheus metrics (`GET /metrics`).

Counters and histograms are updated as events happen; gauges of the scheduler's state
(queue depth, V, reserved KV...) are read from the live scheduler at scrape time, so they
are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from server.runtime.agents import AgentStatus

if TYPE_CHECKING:
    from server.engine.base import Engine, EngineOutput
    from server.runtime.agents import AgentEntry
    from server.scheduler import Dispatcher

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Agent types are chosen by callers: past this many distinct ones, the rest share the label
# "other", so that a tenant inventing types cannot grow /metrics (and memory) without end.
MAX_TYPE_LABELS = 100
OTHER_TYPE = "other"


class Scraped(Protocol):
    """What a scrape reads from the live scheduler (server/runtime/live.py binds itself)."""

    @property
    def dispatcher(self) -> Dispatcher: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def agents(self) -> Mapping[str, AgentEntry]: ...

    def now(self) -> float: ...


class _SchedulerCollector:
    def __init__(self) -> None:
        self.scheduler: Scraped | None = None

    def collect(self):
        s = self.scheduler
        if s is None:
            return
        disp = s.dispatcher
        gps = disp.clock.peek(s.now())  # a scrape reads the clock; it must not advance it
        stats = s.engine.stats()
        values = {
            "justitia_pending_requests": ("Requests waiting in the scheduler.", disp.ledger.pending_count),
            "justitia_running_requests": ("Requests admitted to the engine.", disp.ledger.running_count),
            "justitia_reserved_kv_tokens": ("KV tokens reserved by admitted requests.", disp.ledger.reserved_kv),
            "justitia_kv_capacity_tokens": ("KV capacity M in tokens.", disp.kv_capacity),
            "justitia_virtual_time": ("The GPS virtual clock V.", gps.V),
            "justitia_gps_backlog": ("Agents backlogged in the GPS reference system.", gps.backlog),
            "justitia_iteration_time_seconds": ("Measured engine iteration time tau.", disp.tau),
            "justitia_engine_kv_usage": ("Engine KV cache usage (0-1).", stats.kv_usage),
            "justitia_engine_preemptions": ("Engine preemptions so far.", stats.preemptions_total),
            "justitia_prefix_cached_tokens": (
                "Prompt tokens the engine served from its prefix cache (finished requests).",
                disp.ledger.cached_tokens_total),
            "justitia_prefix_prompt_tokens": (
                "Prompt tokens of the finished requests the engine reported prefix-cache hits for.",
                disp.ledger.prompt_tokens_total),
            "justitia_prefix_hit_rate": (
                "Prefix-cache hit rate: cached over prompt tokens (0 before any report).",
                disp.ledger.prefix_hit_rate or 0.0),
            "justitia_kv_shared_tokens": (
                "KV tokens running requests share: not reserved again thanks to shared prefixes.",
                disp.ledger.kv_shared_now),
            "justitia_kv_saved_tokens": (
                "KV tokens not reserved again thanks to shared prefixes, summed over admissions.",
                disp.ledger.kv_saved_total),
        }
        history = getattr(s, "history", None)
        if history is not None:
            values["justitia_history_unwritten_rows"] = (
                "Finished agents whose history write failed and is being retried.",
                history.unwritten)
        for name, (doc, value) in values.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        states = GaugeMetricFamily("justitia_agents", "Agents known to the server.", labels=["state"])
        counts: dict[str, int] = {}
        for a in s.agents.values():
            counts[a.state] = counts.get(a.state, 0) + 1
        for state in AgentStatus:
            states.add_metric([state.value], counts.get(state, 0))
        yield states
        yield from _time_model_gauges(s)


def _time_model_gauges(s: Scraped):
    """The fitted step-time model of each engine: coefficients and recent error."""
    coef = GaugeMetricFamily("justitia_time_model_coefficient",
                             "Fitted engine step-time coefficient (seconds per unit of the term).",
                             labels=["engine", "term"])
    err = GaugeMetricFamily("justitia_time_model_error",
                            "Recent relative error of the fitted step time (p50, p90 per step; total: of the sum).",
                            labels=["engine", "stat"])
    samples = GaugeMetricFamily("justitia_time_model_samples", "Engine steps the time model learned from.",
                                labels=["engine"])
    bank = getattr(s, "time_models", None)  # a stand-in scheduler in tests may have none
    models = bank.models() if bank is not None else {}
    for engine, model in models.items():
        for term in ("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s"):
            coef.add_metric([engine, term], float(getattr(model, term)))
        for stat, value in (("p50", model.error_p50), ("p90", model.error_p90), ("total", model.total_error)):
            if value is not None:
                err.add_metric([engine, stat], float(value))
        samples.add_metric([engine], float(model.samples))
    yield coef
    yield err
    yield samples


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._collector = _SchedulerCollector()
        self.registry.register(self._collector)
        self.agents_total = Counter("justitia_agents_registered", "Agents registered.",
                                    ["type"], registry=self.registry)
        self.requests_total = Counter("justitia_requests", "Requests finished, by reason.",
                                      ["finish_reason"], registry=self.registry)
        self.tokens_total = Counter("justitia_tokens", "Tokens processed.", ["kind"],
                                    registry=self.registry)
        self.jct = Histogram("justitia_agent_jct_seconds", "Job completion time of finished agents.",
                             buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000),
                             registry=self.registry)
        self.prediction_error = Histogram(
            "justitia_prediction_relative_error", "|predicted - actual| / actual per finished agent.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=self.registry)
        self._type_labels: set[str] = set()

    def bind(self, scheduler: Scraped) -> None:
        self._collector.scheduler = scheduler

    def _type_label(self, agent_type: str) -> str:
        if agent_type in self._type_labels:
            return agent_type
        if len(self._type_labels) < MAX_TYPE_LABELS:
            self._type_labels.add(agent_type)
            return agent_type
        return OTHER_TYPE

    def agent_registered(self, entry: AgentEntry) -> None:
        self.agents_total.labels(self._type_label(entry.type)).inc()

    def agent_closed(self, entry: AgentEntry) -> None:
        if entry.state != "finished" or entry.finished_at is None:
            return
        self.jct.observe(entry.finished_at - entry.submitted_at)
        actual = entry.consumed_kv_cost
        if actual > 0:
            self.prediction_error.observe(abs(entry.predicted_cost - actual) / actual)

    def request_finished(self, out: EngineOutput) -> None:
        self.requests_total.labels(out.finish_reason or "error").inc()
        self.tokens_total.labels("prompt").inc(out.prompt_tokens)
        self.tokens_total.labels("output").inc(out.output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metric_value(text: str, name: str, labels: dict[str, Any] | None = None) -> float | None:
    """Read one sample from an exposition text (used by tests and the CLI)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(
                    sample.labels.get(k) == str(v) for k, v in labels.items())):
                return float(sample.value)
    return None
