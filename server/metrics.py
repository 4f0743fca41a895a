"""Prometheus metrics on a private registry per app (never the global one, so several apps can live
in one process, as in tests). Names follow vLLM's with an `xpulora:` prefix; `xpulora:lora_requests_info`
has vLLM's labels (running_lora_adapters, waiting_lora_adapters, max_lora) for LoRA-aware routers."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import AsyncEngine, RequestOutput

P = "xpulora:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)


class _EngineCollector(Collector):
    """Gauges and engine-side counters read at scrape time from the step thread's latest snapshot."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        llm = self.engine.engine
        s = self.engine.stats()
        yield GaugeMetricFamily(P + "num_requests_running", "Requests in the running batch.", s.num_running)
        yield GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily(P + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_usage)
        yield CounterMetricFamily(P + "num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions)
        for prefix in (P, "vllm:"):  # vLLM's names too, for dashboards built on them
            yield CounterMetricFamily(prefix + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      s.prefix_cache_queries)
            yield CounterMetricFamily(prefix + "prefix_cache_hits", "Of those, tokens found in the prefix cache.",
                                      s.prefix_cache_hits)
        yield GaugeMetricFamily(P + "engine_healthy", "1 while the step loop is alive.", float(self.engine.healthy))
        lora = llm.lora
        if lora is None:
            return
        yield CounterMetricFamily(P + "lora_adapter_loads", "Adapters registered (loads).", lora.num_loads)
        yield CounterMetricFamily(P + "lora_adapter_unloads", "Adapters unregistered.", lora.num_unloads)
        yield CounterMetricFamily(P + "lora_slot_evictions", "Adapters evicted from a device slot.",
                                  lora.num_evictions)
        yield GaugeMetricFamily(P + "lora_adapters_loaded", "Registered adapters.", len(lora.list_adapters()))
        info = GaugeMetricFamily(P + "lora_requests_info", "Running and waiting adapters (value: update time).",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(s.running_adapters), ",".join(s.waiting_adapters), str(llm.config.lora.max_loras)],
                        s.timestamp)
        yield info


class Metrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(P + "request_success", "Requests ended, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token.", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens.", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.", registry=r,
                             buckets=_E2E_BUCKETS)
        r.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Latency and token accounting of one engine request (one choice)."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.arrival = self.last = time.monotonic()
        self.first = True
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        n = len(out.new_token_ids)
        if n:
            if self.first:
                self.m.ttft.observe(now - self.arrival)
                self.m.prompt_tokens.inc(out.num_prompt_tokens)
                self.first = False
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    self.m.itl.observe(gap)
            self.m.generation_tokens.inc(n)
            self.last = now
        if out.finished:
            self.done = True
            self.m.e2e.observe(now - self.arrival)
            self.m.request_success.labels(out.finish_reason or "stop").inc()

    def close(self) -> None:
        """The request ended without a final output (client gone, cancelled): count it as aborted."""
        if not self.done:
            self.done = True
            self.m.request_success.labels("abort").inc()
