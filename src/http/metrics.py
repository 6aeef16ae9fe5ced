"""Prometheus metrics for /metrics: counters and histograms the handlers feed, gauges read from the actors."""

from __future__ import annotations

import bisect
import itertools
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """One registry a server (no module-level state): request counters and latency histograms, plus the
    lane core's statistics read at scrape time; every series carries the served model's `model_name`."""

    def __init__(self, model_name: str, core_stats: Callable[[], object],
                 ranks: Callable[[], tuple[int, object | None]] = lambda: (1, None),
                 pass_times: Callable[[], object] | None = None) -> None:
        self.registry = CollectorRegistry()
        named = {"registry": self.registry, "labelnames": ["model_name"]}
        requests = Counter("lanes_requests", "Requests answered, by endpoint and status.",
                           ["model_name", "endpoint", "status"], registry=self.registry)
        self.requests = _Named(requests, model_name)
        self.prompt_tokens = Counter("lanes_prompt_tokens", "Prompt tokens of answered requests.", **named).labels(model_name)
        self.completion_tokens = Counter("lanes_completion_tokens", "Tokens generated.", **named).labels(model_name)
        self.ttft = Histogram("lanes_time_to_first_token_seconds", "Time from request to its first token.",
                              buckets=LATENCY_BUCKETS, **named).labels(model_name)
        self.inter_token = Buckets("lanes_inter_token_seconds", "Time between a stream's tokens.", LATENCY_BUCKETS,
                                   model_name)
        self.registry.register(self.inter_token)
        self.duration = Histogram("lanes_request_seconds", "Time to answer a request.", buckets=LATENCY_BUCKETS,
                                  **named).labels(model_name)
        self.registry.register(_CoreCollector(model_name, core_stats, ranks, pass_times))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Buckets:
    """A histogram fed a request's values at once (its tokens' gaps, at its end): counts a bucket, one
    writer, read at scrape time. A bisection a value, where prometheus_client's `observe` takes 0.7 us,
    once for every streamed token."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...], model_name: str) -> None:
        self.name, self.doc, self.bounds, self.model_name = name, doc, bounds, model_name
        self.counts = [0] * (len(bounds) + 1)  # the last: past every bound (+Inf)
        self.sum = 0.0

    def observe_all(self, values) -> None:
        counts, bounds, place = self.counts, self.bounds, bisect.bisect_left  # a bucket holds values <= its bound
        for value in values:
            counts[place(bounds, value)] += 1
        self.sum += sum(values)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative = list(itertools.accumulate(self.counts))
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family.add_metric([self.model_name], buckets, self.sum)
        yield family


class _Named:
    """A counter with the model's name put first among its labels."""

    def __init__(self, counter: Counter, model_name: str) -> None:
        self.counter, self.model_name = counter, model_name

    def labels(self, *values: str):
        return self.counter.labels(self.model_name, *values)


def _family(kind, name: str, doc: str, model_name: str, value: float):
    family = kind(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


class _CoreCollector:
    def __init__(self, model_name, core_stats, ranks, pass_times) -> None:
        self.model_name = model_name
        self.core_stats = core_stats
        self.pass_times = pass_times
        self.ranks = ranks

    def collect(self):
        stats = self.core_stats()
        gauges = {
            "lanes_lanes": ("Lanes in all.", stats.lanes),
            "lanes_lanes_busy": ("Lanes holding a stream.", stats.lanes_busy),
            "lanes_queue_length": ("Requests waiting for a lane.", stats.queued),
            "lanes_kv_blocks_total": ("KV blocks in the pool.", stats.blocks_total),
            "lanes_kv_blocks_free": ("KV blocks free.", stats.blocks_free),
            "lanes_kv_usage_fraction": ("Fraction of KV blocks not free (lanes, decisions and the prompt cache).",
                                        1 - stats.blocks_free / stats.blocks_total if stats.blocks_total else 0.0),
        }
        name_ = self.model_name
        for name, (doc, value) in gauges.items():
            yield _family(GaugeMetricFamily, name, doc, name_, value)
        counters = {
            "lanes_passes": ("Passes run.", stats.passes),
            "lanes_prefill_rows": ("Prompt rows run.", stats.prefill_rows),
            "lanes_decode_rows": ("Decode rows run.", stats.decode_rows),
            "lanes_streams_cancelled": ("Streams cancelled (clients gone or cancelled).", stats.streams_cancelled),
        }
        for name, (doc, value) in counters.items():
            yield _family(CounterMetricFamily, name, doc, name_, value)
        if self.pass_times is not None:
            times = self.pass_times()
            yield _family(CounterMetricFamily, "lanes_backend_pass_seconds", "Wall time of the backend's passes.", name_,
                          times.seconds_total)
            yield _family(GaugeMetricFamily, "lanes_backend_pass_seconds_max", "The longest pass so far.", name_,
                          times.seconds_max)
        world, followers = self.ranks()
        yield _family(GaugeMetricFamily, "lanes_world_size", "Tensor-parallel ranks.", name_, world)
        if followers is not None:
            yield _family(GaugeMetricFamily, "lanes_followers_up", "1 while the follower ranks answer.", name_,
                          float(followers.state == "up"))
            yield _family(CounterMetricFamily, "lanes_follower_plans", "Plans broadcast to the followers.", name_,
                          followers.plans)
        drafts = stats.drafts
        if drafts is not None:
            yield _family(CounterMetricFamily, "lanes_draft_tokens", "Draft tokens proposed in passes.", name_, drafts.drafted)
            yield _family(CounterMetricFamily, "lanes_draft_accepted_tokens", "Draft tokens accepted.", name_,
                          drafts.accepted)
            yield _family(CounterMetricFamily, "lanes_drafted_pieces", "Lanes' drafts verified (one a lane a pass).",
                          name_, drafts.pieces)
            yield _family(GaugeMetricFamily, "lanes_draft_mean_accepted_length", "Draft tokens accepted a drafted piece.",
                          name_, drafts.mean_accepted)
        cache = stats.cache
        if cache is not None:
            for name, doc, value in (
                ("lanes_prompt_cache_hits", "Lookups that found a cached prefix.", cache.hits),
                ("lanes_prompt_cache_misses", "Lookups that found none.", cache.misses),
                ("lanes_prompt_cache_hit_tokens", "Prompt tokens restored instead of recomputed.", cache.hit_tokens),
                ("lanes_prompt_cache_evictions", "Cached blocks evicted.", cache.evictions),
            ):
                yield _family(CounterMetricFamily, name, doc, name_, value)
            yield _family(GaugeMetricFamily, "lanes_prompt_cache_held_bytes", "KV bytes the prompt cache holds.", name_,
                          cache.held_bytes)
            yield _family(GaugeMetricFamily, "lanes_prompt_cache_entries", "Cached blocks.", name_, cache.entries)
