"""Prometheus metrics of one server, as the ingress stage sees them.

Two kinds of numbers end up on /metrics:
- what ingress measures itself: HTTP requests by route and status, time to first token,
  inter-token latency, requests in flight, stage restarts it was told about;
- the latest status each trainer pushed (step, version, loss, reward, staleness histogram);
- snapshots of the other stages' own counters (engine and detokenizer stats, polled by ingress
  every `STATS_PERIOD_S`), exported through a custom collector so the values are exactly the
  stage's, never re-counted here. A restarted stage starts its counters from zero again, which
  Prometheus' rate() treats as a counter reset.

Nothing here imports ZeroMQ, Starlette or MLX.
"""

from __future__ import annotations

import time
import collections
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from parallm.protocol import DetokenizerStats, EngineStats, PolicyStats

PREFIX = "parallm"
CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _Snapshots:
    """Custom collector over the last stats dicts reported by the engine and detokenizer."""

    def __init__(self, server: "ServerMetrics") -> None:
        self.server = server

    def collect(self) -> Iterable[Metric]:
        engine = self.server.engine_stats
        detok = self.server.detok_stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))

        yield from _engine_metrics([engine, *engine.replicas])
        yield counter("rollouts_published", "Finished samples published to trainers", detok.rollouts_published)
        yield counter("rollouts_dropped", "Finished samples dropped because a trainer could not keep up",
                      detok.rollouts_dropped)
        yield counter("client_disconnect_aborts", "Requests aborted because their ZeroMQ client went away",
                      detok.client_gone_aborts)
        yield counter("stop_string_aborts", "Sequences ended by a stop string", detok.stop_string_aborts)
        dropped = GaugeMetricFamily(f"{PREFIX}_dropped_frames", "Malformed ZeroMQ frames dropped, per stage",
                                    labels=["stage"])
        dropped.add_metric(["engine"], float(sum(e.dropped_frames for e in [engine, *engine.replicas])))
        dropped.add_metric(["detokenizer"], float(detok.dropped_frames))
        for stage, count in sorted(self.server.dropped_frames.items()):
            dropped.add_metric([stage], float(count))
        yield dropped
        yield from _training_metrics(self.server.training)
        if self.server.policy_stats is not None:
            yield from _policy_metrics(self.server.policy_stats)
        age = GaugeMetricFamily(f"{PREFIX}_stats_age_seconds", "Seconds since each stage last reported stats",
                                labels=["stage"])
        now = time.monotonic()
        for stage, at in (("engine", self.server.engine_stats_at), ("detokenizer", self.server.detok_stats_at)):
            age.add_metric([stage], now - at if at else float("inf"))
        yield age


def _disk(field: str) -> Callable[[EngineStats], float]:
    """One of the disk tier's numbers (EngineStats.kv_disk; 0 without a disk tier)."""
    return lambda e: getattr(e.kv_disk, field) if e.kv_disk is not None else 0


def _spec(field: str) -> Callable[[EngineStats], float]:
    """One of speculative decoding's counters (EngineStats.spec; 0 with spec.mode none)."""
    return lambda e: getattr(e.spec, field) if e.spec is not None else 0


# Every engine number: under its name the sum over the engine replicas (engine.replicas; one engine:
# its own), and per replica in parallm_replica_<name>{replica="i"} (replica 0's stats carry the
# others', parallm/routing.py). (name, help, gauge or counter, value of one replica's EngineStats)
_ENGINE: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("num_requests_waiting", "Sequences waiting for a row or KV memory in the engine (queue depth)", "gauge",
     lambda e: e.waiting),
    ("num_requests_running", "Sequences decoding in the engine", "gauge", lambda e: e.running),
    ("num_requests_prefilling", "Sequences being prefilled in the engine", "gauge", lambda e: e.prefilling),
    ("kv_blocks_used", "KV blocks referenced by live sequences", "gauge", lambda e: e.kv_blocks_used),
    ("kv_blocks_free", "KV blocks free and holding nothing reusable", "gauge", lambda e: e.kv_blocks_free),
    ("kv_blocks_cached", "KV blocks free but still holding a reusable cached prefix", "gauge",
     lambda e: e.kv_blocks_cached),
    ("kv_blocks_total", "KV blocks in the block store (live sequences and prefix cache)", "gauge", lambda e: e.kv_blocks_total),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "counter",
     lambda e: e.prefix_queried_tokens),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", "counter", lambda e: e.prefix_hit_tokens),
    ("prefix_cache_partial_hits", "Admissions whose prompt started from a copy of a partly matching cached block",
     "counter", lambda e: e.prefix_partial_hits),
    ("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since the engine started", "rate",
     lambda e: e.prefix_hit_tokens),
    ("preemptions", "Sequences preempted (row freed, recomputed later) for KV memory or priority", "counter",
     lambda e: e.preemptions),
    ("priority_preemptions", "Preemptions that made room for a request of better priority", "counter",
     lambda e: e.priority_preemptions),
    ("admissions_delayed", "Engine steps that admitted nothing so that waiting prompts fill a fuller prefill pass "
     "(engine.admit_delay_factor)", "counter", lambda e: e.admissions_delayed),
    ("engine_steps", "Engine steps run", "counter", lambda e: e.steps),
    ("mixed_passes", "Engine steps whose prompt chunks ran in the decode pass", "counter", lambda e: e.mixed_passes),
    ("generation_tokens", "Tokens generated by the engine", "counter", lambda e: e.generated_tokens),
    ("prompt_tokens_computed", "Prompt tokens prefilled (not served from the cache)", "counter",
     lambda e: e.prompt_tokens_computed),
    ("adapter_swaps", "Adapter versions loaded while serving", "counter", lambda e: e.adapters.publishes),
    ("pooling_requests", "Pooling requests answered (embeddings, rewards, classifications)", "counter",
     lambda e: e.pooled_requests),
    ("pooling_tokens", "Prompt tokens of the pooling requests answered", "counter", lambda e: e.pooled_tokens),
    ("pooling_passes", "Batched pooling passes run", "counter", lambda e: e.pooling_batches),
    ("pooling_waiting", "Pooling requests waiting for a pass", "gauge", lambda e: e.pooling_waiting),
    ("engine_integrity_failures", "Engine integrity checks (run each time the engine goes idle) that failed",
     "counter", lambda e: e.integrity_failures),
    ("kv_capacity_tokens", "Tokens the KV block store holds (live and cached blocks) at the KV dtype and bits",
     "gauge",
     lambda e: e.kv_capacity_tokens),
    ("kv_live_tokens", "Tokens running and prefilling sequences hold", "gauge", lambda e: e.kv_live_tokens),
    ("kv_waiting_tokens", "Tokens the sequences waiting for a row need", "gauge", lambda e: e.kv_waiting_tokens),
    ("kv_pressure_rejections", "Requests refused with 503 because the KV demand was past kv.pressure_threshold",
     "counter", lambda e: e.kv_pressure_rejections),
    ("kv_disk_hits", "Prefix-cache blocks read back from the disk tier instead of recomputed", "counter",
     _disk("hits")),
    ("kv_disk_misses", "Prefix-cache blocks looked up in the disk tier and not found", "counter",
     _disk("misses")),
    ("kv_disk_read_bytes", "Bytes read back from the disk tier", "counter",
     _disk("read_bytes")),
    ("kv_disk_written_bytes", "Bytes written to the disk tier", "counter",
     _disk("written_bytes")),
    ("kv_disk_bytes", "Bytes of block files the disk tier holds", "gauge", _disk("bytes")),
    ("kv_disk_files", "Block files the disk tier holds", "gauge", _disk("files")),
    ("kv_disk_corrupt_files", "Torn or corrupt block files found, deleted and never served", "counter",
     _disk("corrupt_files")),
    ("kv_disk_dropped", "Blocks not written because the disk writer's queue was full", "counter",
     _disk("dropped")),
    ("kv_disk_errors", "Block files that could not be written (disk full, permissions)", "counter",
     _disk("errors")),
    ("training_phases", "Trainers' update phases the engine heard begin (engine.training_share rests in them)",
     "counter", lambda e: e.training_phases),
    ("training_rest_seconds", "Seconds the engine rested to leave a trainer's update its engine.training_share",
     "counter", lambda e: e.training_rest_s),
    ("spec_verify_passes", "Target passes that verified speculative proposals", "counter", _spec("verify_passes")),
    ("spec_rows_verified", "Rows (per verify pass) that had a proposal", "counter", _spec("rows_verified")),
    ("spec_proposed_tokens", "Speculative tokens proposed and verified", "counter", _spec("proposed_tokens")),
    ("spec_accepted_tokens", "Proposed tokens equal to the target's own sample (accepted)", "counter",
     _spec("accepted_tokens")),
    ("spec_emitted_tokens", "Tokens speculating rows emitted (accepted, plus the target's one per row and pass)",
     "counter", _spec("emitted_tokens")),
)


def _engine_metrics(replicas: list[EngineStats]) -> Iterable[Metric]:
    """The engine's numbers, summed over `replicas` and per replica (see _ENGINE)."""
    queried = {e.replica: e.prefix_queried_tokens for e in replicas}
    for name, doc, kind, value in _ENGINE:
        family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        if kind == "rate":  # hits / queries, of the sums and of each replica
            total = sum(queried.values())
            yield family(f"{PREFIX}_{name}", doc, value=sum(value(e) for e in replicas) / total if total else 0.0)
            each = family(f"{PREFIX}_replica_{name}", f"{doc}, per engine replica", labels=["replica"])
            for e in replicas:
                each.add_metric([str(e.replica)], value(e) / queried[e.replica] if queried[e.replica] else 0.0)
        else:
            yield family(f"{PREFIX}_{name}", doc, value=float(sum(value(e) for e in replicas)))
            each = family(f"{PREFIX}_replica_{name}", f"{doc}, per engine replica", labels=["replica"])
            for e in replicas:
                each.add_metric([str(e.replica)], float(value(e)))
        yield each
    slots = sum(e.live_token_slots for e in replicas)
    for name, doc, held in (("kv_utilization", "Tokens live sequences hold over the live KV's token slots",
                             lambda e: e.kv_live_tokens),
                            ("kv_demand", "Tokens live and waiting sequences hold or need over the live KV's token "
                             "slots (what kv.pressure_threshold bounds)",
                             lambda e: e.kv_live_tokens + e.kv_waiting_tokens)):
        yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=sum(held(e) for e in replicas) / slots if slots else 0.0)
        each = GaugeMetricFamily(f"{PREFIX}_replica_{name}", f"{doc}, per engine replica", labels=["replica"])
        for e in replicas:
            each.add_metric([str(e.replica)], held(e) / e.live_token_slots if e.live_token_slots else 0.0)
        yield each
    hist: dict[int, int] = {}
    for e in replicas:
        for size, count in e.decode_batch_hist.items():
            hist[size] = hist.get(size, 0) + count
    yield _histogram(f"{PREFIX}_decode_batch_size", "Sequences per decode step", hist, BATCH_BUCKETS)
    yield from _spec_metrics(replicas)
    family = GaugeMetricFamily(f"{PREFIX}_adapter_version", "Loaded version of each LoRA adapter (with engine "
                               "replicas, the version every replica has)", labels=["adapter"])
    each = GaugeMetricFamily(f"{PREFIX}_replica_adapter_version", "Loaded version of each LoRA adapter, per engine "
                             "replica", labels=["adapter", "replica"])
    for name in sorted({name for e in replicas for name in e.adapters.latest}):
        family.add_metric([name], float(min(e.adapters.latest.get(name, 0) for e in replicas)))
        for e in replicas:
            each.add_metric([name, str(e.replica)], float(e.adapters.latest.get(name, 0)))
    yield family
    yield each


def _spec_metrics(replicas: list[EngineStats]) -> Iterable[Metric]:
    """Speculative decoding's rates and its k distribution, over the replicas' sums."""
    proposed = sum(_spec("proposed_tokens")(e) for e in replicas)
    accepted = sum(_spec("accepted_tokens")(e) for e in replicas)
    rows = sum(_spec("rows_verified")(e) for e in replicas)
    yield GaugeMetricFamily(f"{PREFIX}_spec_acceptance_rate", "spec_accepted_tokens / spec_proposed_tokens",
                            value=accepted / proposed if proposed else 0.0)
    yield GaugeMetricFamily(f"{PREFIX}_spec_mean_accepted_tokens", "spec_accepted_tokens / spec_rows_verified",
                            value=accepted / rows if rows else 0.0)
    ks = GaugeMetricFamily(f"{PREFIX}_spec_k", "Rows verified with a proposal of k tokens", labels=["k"])
    counts: dict[str, int] = {}
    for e in replicas:
        for k, n in (e.spec.k_distribution if e.spec is not None else {}).items():
            counts[k] = counts.get(k, 0) + n
    for k in sorted(counts, key=int):
        ks.add_metric([k], float(counts[k]))
    yield ks


STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
_TRAINING_GAUGES = (("step", "step", "Optimizer steps the trainer has taken"),
                    ("version", "version", "Adapter version the trainer published last"),
                    ("loss", "last.loss", "GRPO loss of the latest step"),
                    ("reward_mean", "last.reward_mean", "Mean reward of the latest step's rollouts"),
                    ("reward_std", "last.reward_std", "Reward standard deviation of the latest step"),
                    ("kl", "last.kl", "Mean per-token KL to the base model at the latest step"),
                    ("rollout_tokens_per_second", "last.rollout_tokens_per_s",
                     "Completion tokens per second while the latest batch was sampled"),
                    ("train_tokens_per_second", "last.train_tokens_per_s",
                     "Completion tokens per second through the latest GRPO update"))
_TRAINING_COUNTERS = (("rollouts_trained", "rollouts_trained", "Rollouts trained on"),
                      ("rollouts_stale_dropped", "rollouts_dropped_stale",
                       "Rollouts not trained on because they were older than max_staleness versions"))


_POLICY: tuple[tuple[str, str, str], ...] = (
    ("requests", "Policy act and predict requests answered by the policy stage", "counter"),
    ("rejected", "Policy requests refused (unknown model, bad tensor)", "counter"),
    ("failed", "Policy requests whose forward failed", "counter"),
    ("batches", "Policy forwards run", "counter"),
    ("rows", "Observation rows run through policy forwards", "counter"),
    ("episodes", "Episodes whose recurrent state the policy stage keeps", "gauge"),
    ("episodes_expired", "Episodes dropped after policies.episode_ttl_s unused", "counter"),
    ("weights_updates", "Policy weight updates applied", "counter"),
    ("weights_rejected", "Policy weight updates refused", "counter"),
)


def _policy_metrics(stats: PolicyStats) -> Iterable[Metric]:
    """The policy stage's counters (parallm_policy_*), and each policy's weights version."""
    for name, doc, kind in _POLICY:
        family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        yield family(f"{PREFIX}_policy_{name}", doc, value=float(getattr(stats, name)))
    version = GaugeMetricFamily(f"{PREFIX}_policy_version", "Weights version each policy serves", labels=["model"])
    for model, v in sorted(stats.versions.items()):
        version.add_metric([model], float(v))
    yield version


def _training_metrics(trainers: dict[str, dict[str, Any]]) -> Iterable[Metric]:
    """Each trainer's latest TrainingStatus (as pushed to ingress), labelled by trainer and adapter."""
    if not trainers:
        return
    labels = ["trainer", "adapter"]
    for name, path, doc in _TRAINING_GAUGES:
        family = GaugeMetricFamily(f"{PREFIX}_training_{name}", doc, labels=labels)
        for trainer, status in trainers.items():
            value: Any = status
            for part in path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                family.add_metric([trainer, str(status.get("adapter", ""))], float(value))
        yield family
    for name, key, doc in _TRAINING_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}_training_{name}", doc, labels=labels)
        for trainer, status in trainers.items():
            family.add_metric([trainer, str(status.get("adapter", ""))],
                              float((status.get("totals") or {}).get(key, 0) or 0))
        yield family
    staleness = HistogramMetricFamily(f"{PREFIX}_training_staleness",
                                      "Versions between sampling and training, per rollout", labels=labels)
    for trainer, status in trainers.items():
        buckets, total = _buckets(status.get("staleness_hist") or {}, STALENESS_BUCKETS)
        staleness.add_metric([trainer, str(status.get("adapter", ""))], buckets, total)
    yield staleness


def _buckets(counts: dict, bounds: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets and the sum of an exact {value: count} table."""
    items = sorted((float(k), int(v)) for k, v in counts.items())
    buckets = []
    for bound in (*bounds, float("inf")):
        buckets.append(("+Inf" if bound == float("inf") else str(bound), sum(c for v, c in items if v <= bound)))
    return buckets, sum(v * c for v, c in items)


def _histogram(name: str, doc: str, counts: dict, bounds: tuple[float, ...]) -> HistogramMetricFamily:
    buckets, total = _buckets(counts, bounds)
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class ServerMetrics:
    """Every metric of one server, in its own registry (so tests can build many apps)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by route and status code",
                                     ["route", "method", "status"], registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Generation requests admitted and not finished",
                               registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Generation requests refused at admission",
                                ["reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from submission to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between tokens of one sequence",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds", "Time from submission to the last token",
                             buckets=TTFT_BUCKETS, registry=r)
        self.stage_restarts = Counter(f"{PREFIX}_stage_restarts", "Stage restarts announced by the supervisor",
                                      ["stage"], registry=r)
        self.stages_down = Gauge(f"{PREFIX}_stages_down", "Stages currently down (restarting)", registry=r)
        self.dropped_frames: collections.Counter[str] = collections.Counter()  # malformed frames ingress dropped
        self.engine_stats = EngineStats()
        self.detok_stats = DetokenizerStats()
        self.engine_stats_at = 0.0
        self.detok_stats_at = 0.0
        self.training: dict[str, dict[str, Any]] = {}   # trainer name -> its latest TrainingStatus
        self.policy_stats: PolicyStats | None = None       # the policy stage's, when it runs
        self.policy_latency = Histogram(f"{PREFIX}_policy_request_seconds", "Policy requests' time in ingress",
                                        ["route"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                            0.25, 1), registry=r)
        r.register(_Snapshots(self))

    def set_stats(self, stats: EngineStats | DetokenizerStats | PolicyStats) -> None:
        """The latest stats a stage reported."""
        if isinstance(stats, PolicyStats):
            self.policy_stats = stats
        elif isinstance(stats, EngineStats):
            self.engine_stats, self.engine_stats_at = stats, time.monotonic()
        else:
            self.detok_stats, self.detok_stats_at = stats, time.monotonic()

    def set_training_status(self, status: dict[str, Any]) -> None:
        self.training[str(status.get("trainer", ""))] = dict(status)

    def render(self) -> bytes:
        return generate_latest(self.registry)
