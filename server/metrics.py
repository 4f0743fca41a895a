"""Prometheus metrics on a private registry per app (never the global one, so several apps can live
in one process, as in tests). Every series carries a `model_name` label (the first served name).

Two names per series where vLLM has one: our `xpulora:` series, and the same samples under vLLM's
`vllm:` names (num_requests_running, num_requests_waiting, kv_cache_usage_perc, lora_requests_info,
prompt_tokens_total, ...), so that routers and dashboards built for vLLM (the Gateway API Inference
Extension, Grafana boards) read them unchanged. `lora_requests_info` has vLLM's labels
(running_lora_adapters, waiting_lora_adapters, max_lora) and the update time as its value."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import GC_PAUSES, EngineClient, RequestOutput

P = "xpulora:"
VLLM = "vllm:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)
# Our series that vLLM exports too, under the same name after the prefix (vllm:<name>).
VLLM_ALIASES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions", "lora_requests_info",
    "prefix_cache_queries", "prefix_cache_hits",
    "prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds"})
MODEL = "model_name"


class _EngineCollector(Collector):
    """Gauges and engine-side counters read at scrape time from the step thread's latest snapshot."""

    def __init__(self, engine: EngineClient, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self) -> Iterator[Metric]:
        m = [self.model]
        s = self.engine.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=[MODEL])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=[MODEL])
            c.add_metric(m, value)
            return c

        yield gauge(P + "num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge(P + "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge(P + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_usage)
        yield counter(P + "num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions)
        yield counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter(P + "prefix_cache_hits", "Of those, tokens found in the prefix cache.", s.prefix_cache_hits)
        yield gauge(P + "engine_healthy", "1 while the step loop is alive.", float(self.engine.healthy))
        yield counter(P + "engine_steps", "Steps the engine core ran.", s.steps.steps)
        yield counter(P + "engine_step_tokens", "Tokens those steps computed (prompt chunks + one per decode).",
                      s.steps.tokens)
        yield counter(P + "engine_step_sequences", "Sequences in those steps (summed over steps).", s.steps.sequences)
        yield counter(P + "engine_mixed_steps", "Steps that held a prompt chunk.", s.steps.mixed)
        yield counter(P + "engine_step_seconds", "Engine-core time in steps: scheduling, launch, read-back wait.",
                      s.steps.seconds)
        yield counter(P + "engine_admitted", "Requests whose first step the engine core launched.", s.steps.admitted)
        yield counter(P + "engine_queue_seconds", "Those requests' waits, summed: from the engine core's loop reading "
                      "them to their first step's launch.", s.steps.queue_seconds)
        yield counter(P + "engine_idle_seconds", "Engine-core time waiting for requests with nothing to run.",
                      s.idle_seconds)
        yield counter(P + "api_output_seconds", "API-process time turning engine outputs into text.",
                      self.engine.output_seconds)
        def per_process(fam: CounterMetricFamily | GaugeMetricFamily, api: float, core: float
                        ) -> CounterMetricFamily | GaugeMetricFamily:
            fam.add_metric([self.model, "api"], api)
            fam.add_metric([self.model, "engine_core"], core)
            return fam

        procs = [MODEL, "process"]
        yield per_process(CounterMetricFamily(P + "gc_seconds", "Time in Python garbage collection, per process "
                                              "(engine_core: 0 when the core runs on a thread of the API process).",
                                              labels=procs), GC_PAUSES.total_seconds, s.gc_seconds)
        yield per_process(CounterMetricFamily(P + "gc_full_collections", "Full (generation 2) garbage collections, "
                                              "per process.", labels=procs),
                          GC_PAUSES.collections[2], s.gc_full_collections)
        yield per_process(GaugeMetricFamily(P + "gc_frozen_objects", "Start-up objects frozen out of garbage "
                                            "collection, per process.", labels=procs),
                          GC_PAUSES.frozen_objects, s.gc_frozen_objects)
        g = self.engine.served.grammar
        yield counter(P + "grammar_compiles", "Structured-output grammars compiled (cache misses).", g.num_compiles)
        yield counter(P + "grammar_compile_seconds", "Time spent compiling grammars.", g.compile_seconds)
        yield counter(P + "grammar_cache_hits", "Requests whose grammar was already compiled.", g.num_cache_hits)
        kernels = GaugeMetricFamily(P + "kernel_info", "Kernel implementation chosen per op by the start-up checks "
                                    "(value 1); rejected: faster candidates that failed their check.",
                                    labels=[MODEL, "op", "implementation", "rejected"])
        for c in self.engine.served.kernels:
            kernels.add_metric([self.model, c.op, c.chosen, ",".join(n for n, _ in c.rejected)], 1.0)
        yield kernels
        lora = self.engine.lora_stats()
        if lora is None:
            return
        yield counter(P + "lora_adapter_loads", "Adapters registered (loads).", lora.num_loads)
        yield counter(P + "lora_adapter_unloads", "Adapters unregistered.", lora.num_unloads)
        yield counter(P + "lora_slot_evictions", "Adapters evicted from a device slot.", lora.num_evictions)
        yield gauge(P + "lora_adapters_loaded", "Registered adapters.", lora.num_loaded)
        info = GaugeMetricFamily(P + "lora_requests_info", "Running and waiting adapters (value: update time).",
                                 labels=[MODEL, "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([self.model, ",".join(s.running_adapters), ",".join(s.waiting_adapters),
                         str(lora.max_loras)], s.timestamp)
        yield info


class _VllmNames(Collector):
    """The registry's xpulora: families that vLLM has, again under vLLM's names (same samples)."""

    def __init__(self, sources: list[Collector]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for fam in source.collect():
                short = fam.name.removeprefix(P)
                if short not in VLLM_ALIASES:
                    continue
                alias = Metric(VLLM + short, fam.documentation, fam.type, fam.unit)
                alias.samples = [smp._replace(name=VLLM + smp.name.removeprefix(P)) for smp in fam.samples]
                yield alias


class Metrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = r = CollectorRegistry()
        self.model = engine.served.name
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", [MODEL], registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", [MODEL], registry=r)
        self.request_success = Counter(P + "request_success", "Requests ended, by finish reason.",
                                       [MODEL, "finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token.", [MODEL], registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens.", [MODEL], registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.", [MODEL], registry=r,
                             buckets=_E2E_BUCKETS)
        # The children of the single model label, looked up once: labels() takes a lock and hashes its
        # arguments, twice per streamed token otherwise.
        self.model_ttft = self.ttft.labels(self.model)
        self.model_itl = self.itl.labels(self.model)
        self.model_e2e = self.e2e.labels(self.model)
        self.model_prompt_tokens = self.prompt_tokens.labels(self.model)
        self.model_generation_tokens = self.generation_tokens.labels(self.model)
        collector = _EngineCollector(engine, self.model)
        r.register(collector)
        r.register(_VllmNames([collector, self.prompt_tokens, self.generation_tokens, self.request_success,
                               self.ttft, self.itl, self.e2e]))

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
        m = self.m
        if n:
            if self.first:
                m.model_ttft.observe(now - self.arrival)
                m.model_prompt_tokens.inc(out.num_prompt_tokens)
                self.first = False
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    m.model_itl.observe(gap)
            m.model_generation_tokens.inc(n)
            self.last = now
        if out.finished:
            self.done = True
            m.model_e2e.observe(now - self.arrival)
            m.request_success.labels(m.model, out.finish_reason or "stop").inc()

    def close(self) -> None:
        """The request ended without a final output (client gone, cancelled): count it as aborted."""
        if not self.done:
            self.done = True
            self.m.request_success.labels(self.m.model, "abort").inc()
