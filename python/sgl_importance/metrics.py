"""Prometheus series of the ``importance`` policy, on SGLang's ``/metrics``.

Built only with ``--enable-metrics`` (nothing is allocated otherwise), in the
scheduler process, under the same rank labels as SGLang's radix-cache series.
SGLang serves every process's series through prometheus_client's multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher before the scheduler
starts), so ``prometheus_client`` is imported only when the first series is built,
counters and histograms need nothing more, and the gauge names its multiprocess
mode.

| series                                          | what                                            |
|-------------------------------------------------|-------------------------------------------------|
| `sgl_importance:evicted_tokens_total{tier}`     | tokens evicted from the device / host tier      |
| `sgl_importance:evicted_node_importance{tier}`  | normalised importance of each evicted node      |
| `sgl_importance:attended_node_importance`       | normalised importance of nodes after each fold  |
| `sgl_importance:folded_steps_total`             | decode steps folded into node importance        |
| `sgl_importance:importance_scale`               | the normaliser (largest recent node importance) |
| `sgl_importance:storage_tokens_total{decision}` | L3 admission: tokens written / deferred / written late |
| `sgl_importance:prefetch_tokens_total{reason,outcome}` | host→device prefetch: tokens issued / used / wasted, for waiting requests or warming |
| `sgl_importance:hot_set_*_total`                | per-request hot set (``HotSetMetrics``): steps, promotions, hits, late arrivals, guard fallbacks, pages attended vs dense |
| `sgl_importance:hot_set_{guard,range}_rows_in_use`, `..._borrowed_pages`, `..._device_bytes`, `..._tracked_requests` | the key-code and key-range rows in use and the KV pages borrowed for them (each step); what the running hot-set requests hold (F(request), summed) |
| `sgl_importance:storage_corrupt_pages_total{reason}` | storage-tier pages refused on read (checksum, short, format, layout, unreadable) |
| `sgl_importance:storage_write_pauses_total` | times storage-tier writes were paused after repeated failures |
| `sgl_importance:storage_pages_total{op,precision}` | storage-tier pages written / read per stored class (full, int8, int4; all full with `--importance-storage-precision off`) |
| `sgl_importance:storage_page_bytes_total{op,precision}` | the same pages' stored bytes (trailer excluded) |
| `sgl_importance:shared_importance_pages_total{event}` | Mooncake tier: importance records published / fetched / restored |

The two storage series are counted by the storage tier's I/O threads, which run in
the scheduler process beside the tree cache; they carry the storage config's ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from sgl_importance.sglang_types.tree import TreeCache

TIERS = ("device", "host")
# Stored page classes by code, as storage/encoding.py numbers them.
PAGE_CLASSES = ("full", "int8", "int4")
# Normalised importance lives in [0, 1]; dense at the bottom, where eviction acts.
IMPORTANCE_BUCKETS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)


class _Series:
    """What every class of series shares: its labels, its registry and one constructor.

    Args:
        labels: the rank labels (SGLang's, for the cache's series), so series of
            several ranks stay apart.
        registry: prometheus_client's default registry (which SGLang's multiprocess
            collector reads) unless a test passes one.
    """

    def __init__(self, labels: Mapping[str, Any], registry: Optional[CollectorRegistry] = None) -> None:
        from prometheus_client import REGISTRY

        self.registry = REGISTRY if registry is None else registry
        self.labels = {k: str(v) for k, v in labels.items()}

    def _series(self, kind: str, name: str, help: str, *extra_labels: str, **options: Any) -> Any:
        """A ``prometheus_client`` series of ``kind`` (``Counter``, ``Gauge``, ``Histogram``)
        labelled by the rank labels and ``extra_labels``."""
        import prometheus_client

        series = getattr(prometheus_client, kind)
        return series(name, help, labelnames=[*self.labels, *extra_labels], registry=self.registry, **options)


class ImportanceMetrics(_Series):
    """The policy's series for one tree cache (one scheduler rank).

    Args:
        labels: SGLang's radix-cache labels (cache type and ranks), so these series
            line up with ``sglang:evicted_tokens_total`` of the same rank.
        registry: where the series register (prometheus_client's default registry,
            which SGLang's multiprocess collector reads, unless a test passes one).
    """

    def __init__(self, labels: Mapping[str, Any], registry: Optional[CollectorRegistry] = None) -> None:
        super().__init__(labels, registry)
        self.evicted_tokens = self._series(
            "Counter",
            "sgl_importance:evicted_tokens_total",
            "Tokens evicted under --radix-eviction-policy importance, by the tier they "
            "left (device: demoted to host or dropped; host: dropped from host memory).",
            "tier",
        )
        self.evicted_importance = self._series(
            "Histogram",
            "sgl_importance:evicted_node_importance",
            "Normalised importance (0..1) of each radix node when it was evicted, by tier.",
            "tier",
            buckets=IMPORTANCE_BUCKETS,
        )
        self.attended_importance = self._series(
            "Histogram",
            "sgl_importance:attended_node_importance",
            "Normalised importance (0..1) of each attended radix node after a fold.",
            buckets=IMPORTANCE_BUCKETS,
        )
        self.folded_steps = self._series(
            "Counter",
            "sgl_importance:folded_steps_total",
            "Recorded decode steps folded into radix-node importance.",
        )
        self.scale = self._series(
            "Gauge",
            "sgl_importance:importance_scale",
            "Largest recent raw node importance (the normaliser of the policy).",
            multiprocess_mode="mostrecent",
        )
        self.storage_tokens = self._series(
            "Counter",
            "sgl_importance:storage_tokens_total",
            "L3 admission decisions in tokens: admitted (written at the host-backup "
            "acknowledgement), deferred (kept off storage), late (written after earning "
            "importance or hits).",
            "decision",
        )
        self.prefetch_tokens = self._series(
            "Counter",
            "sgl_importance:prefetch_tokens_total",
            "Host-to-device prefetch in tokens, by reason (waiting: a queued request's "
            "host match; warm: an important demoted node) and outcome (issued; used: a "
            "running request attended it; wasted: evicted from the device before use).",
            "reason",
            "outcome",
        )
        self._by_tier = {
            tier: (
                self.evicted_tokens.labels(**self.labels, tier=tier),
                self.evicted_importance.labels(**self.labels, tier=tier),
            )
            for tier in TIERS
        }
        self._attended = self.attended_importance.labels(**self.labels)
        self._folded = self.folded_steps.labels(**self.labels)
        self._scale = self.scale.labels(**self.labels)

    def evicted(self, tier: str, tokens: int, normalised_importance: float) -> None:
        tokens_counter, histogram = self._by_tier[tier]
        tokens_counter.inc(tokens)
        histogram.observe(normalised_importance)

    def storage_decision(self, decision: str, tokens: int) -> None:
        self.storage_tokens.labels(**self.labels, decision=decision).inc(tokens)

    def prefetch(self, reason: str, outcome: str, tokens: int) -> None:
        self.prefetch_tokens.labels(**self.labels, reason=reason, outcome=outcome).inc(tokens)

    def folded(self, steps: int, scale: float, normalised: Iterable[float]) -> None:
        self._folded.inc(steps)
        self._scale.set(scale)
        for value in normalised:
            self._attended.observe(value)


class StorageIntegrityMetrics(_Series):
    """Series of the storage tier's integrity wrapper (``storage/wrapper.py``).

    Args:
        labels: the storage ranks (``tp_rank``, ``pp_rank``).
        registry: as for ``ImportanceMetrics``.
    """

    def __init__(self, labels: Mapping[str, Any], registry: Optional[CollectorRegistry] = None) -> None:
        super().__init__(labels, registry)
        self.corrupt_pages = self._series(
            "Counter",
            "sgl_importance:storage_corrupt_pages_total",
            "Storage-tier pages refused on read and recomputed, by reason (checksum: bytes "
            "changed; short: truncated; format: no integrity trailer, e.g. zero-filled; "
            "layout: written by another model, dtype, page size or layout; unreadable: I/O error).",
            "reason",
        )
        self.write_pauses = self._series(
            "Counter",
            "sgl_importance:storage_write_pauses_total",
            "Times storage-tier writes were paused after repeated write failures.",
        )

        self.pages = self._series(
            "Counter",
            "sgl_importance:storage_pages_total",
            "Storage-tier pages written and read, by operation and stored class (full: the "
            "model's dtype; int8, int4: quantised by --importance-storage-precision).",
            "op",
            "precision",
        )
        self.page_bytes = self._series(
            "Counter",
            "sgl_importance:storage_page_bytes_total",
            "Stored bytes (integrity trailer excluded) of the pages in storage_pages_total.",
            "op",
            "precision",
        )

    def corrupt(self, reason: str) -> None:
        self.corrupt_pages.labels(**self.labels, reason=reason).inc()

    def page(self, op: str, precision: str, nbytes: int) -> None:
        """One page written or read in class ``precision``, ``nbytes`` stored."""
        self.pages.labels(**self.labels, op=op, precision=precision).inc()
        self.page_bytes.labels(**self.labels, op=op, precision=precision).inc(nbytes)

    def page_of_class(self, op: str, cls: int, nbytes: int) -> None:
        """``page`` by class code (``storage/encoding.py``: 0 full, 1 int8, 2 int4)."""
        self.page(op, PAGE_CLASSES[cls], nbytes)

    def paused(self) -> None:
        self.write_pauses.labels(**self.labels).inc()


class SharedImportanceMetrics(_Series):
    """Series of the importance shared through the storage tier (``storage/shared_importance.py``)."""

    def __init__(self, labels: Mapping[str, Any], registry: Optional[CollectorRegistry] = None) -> None:
        super().__init__(labels, registry)
        self.pages = self._series(
            "Counter",
            "sgl_importance:shared_importance_pages_total",
            "Page importance records in the shared storage tier: published (written), "
            "fetched (read with a storage hit query), restored (pages of nodes rebuilt "
            "from storage that got importance another instance published).",
            "event",
        )

    def count(self, event: str, pages: int) -> None:
        if pages:
            self.pages.labels(**self.labels, event=event).inc(pages)


class Metrics:
    """The process's series, each built on first use (``prometheus_client`` registers a
    series name once per process; SGLang builds one tree cache and one storage backend
    per scheduler process). Owned by the runtime."""

    def __init__(self) -> None:
        self._importance: Optional[ImportanceMetrics] = None
        self._shared: Optional[SharedImportanceMetrics] = None
        self._storage: Optional[StorageIntegrityMetrics] = None

    def importance(self, cache: TreeCache) -> Optional[ImportanceMetrics]:
        """The series for ``cache``, or None when SGLang's metrics are off.

        Args:
            cache: SGLang's radix cache; its ``metrics_collector`` is None unless
                ``--enable-metrics``, and carries the rank labels.
        """
        collector = cache.metrics_collector
        if collector is None:
            return None
        if self._importance is None:
            self._importance = ImportanceMetrics(collector.labels or {})
        return self._importance

    def shared(self, labels: Mapping[str, Any]) -> SharedImportanceMetrics:
        """Series of the importance shared through the storage tier."""
        if self._shared is None:
            self._shared = SharedImportanceMetrics(labels)
        return self._shared

    def storage(self, labels: Mapping[str, Any]) -> StorageIntegrityMetrics:
        """The storage integrity series (one storage backend per scheduler)."""
        if self._storage is None:
            self._storage = StorageIntegrityMetrics(labels)
        return self._storage


# HotSetCounts field -> (series suffix, help). Counted per request and decode step.
HOT_SET_SERIES = {
    "steps": ("steps", "Request decode steps attended over a hot set."),
    "warmups": ("warmups", "Request decode steps attended densely as the request's first."),
    "promotions": ("promotions", "Pages the hot-set plan added that the previous step did not attend."),
    "hits": ("hits", "Planned hot-set pages the previous step already attended."),
    "late_arrivals": (
        "late_arrivals",
        "Pages some layer's selection wanted that the hot set had left out, per request step (promotion "
        "candidates; where they were released, misses: pages_missed).",
    ),
    "guard_checks": ("guard_checks", "Request layer-steps whose attention output error the guard bounded."),
    "guard_reads": ("guard_reads", "Request layer-steps in which the selection read rest pages exactly."),
    "guard_flagged": (
        "guard_flagged",
        "Request layer-steps whose bound exceeded --hot-set-guard-threshold (flagged: that layer's read cap rises).",
    ),
    "pages_attended": ("pages_attended", "Pages read exactly by hot-set requests, summed over layers."),
    "pages_guard_read": ("pages_guard_read", "Rest pages the selection read exactly, summed over layers."),
    "guard_refused": (
        "guard_refused",
        "Hot-set requests refused a guard (no KV page could be lent for their key codes); decoded unguarded.",
    ),
    "ranges_refused": (
        "ranges_refused",
        "Hot-set requests refused key ranges (no KV page could be lent for them): decoded dense, every page kept.",
    ),
    "ranges_regained": (
        "ranges_regained",
        "Hot-set requests refused key ranges that got them once pages could be lent again: back on their hot set.",
    ),
    "pages_estimated": (
        "pages_estimated",
        "Unread pages accounted for by the guard's sampled estimate, summed over layers.",
    ),
    "pages_sampled": ("pages_sampled", "Sampled unread pages the guard read, summed over layers."),
    "pages_dense": ("pages_dense", "Pages dense attention would have read for the same steps and layers."),
    "pages_read_from_host": (
        "pages_read_from_host",
        "Attended pages read from their host copy (planned pages whose promotion was refused), over layers.",
    ),
    "pages_guard_from_host": (
        "pages_guard_from_host",
        "Released pages a guarded layer chose and read from their host copy in place (the CPU), over layers.",
    ),
    "pages_missed": (
        "pages_missed",
        "Rest pages a layer's selection wanted while they were released and did not read (misses: a GPU's "
        "kernels read no host copy), summed over layers.",
    ),
    "graph_steps": ("graph_steps", "Decode batches holding a hot-set request that replayed the captured step."),
    "graph_eager": (
        "graph_eager",
        "Decode batches holding a hot-set request that the captured step's buffers refused (run eagerly).",
    ),
    "pages_released": ("pages_released", "Device pages hot-set requests gave back to the allocator."),
    "pages_copied_out": ("pages_copied_out", "Pages copied device to host on their first release."),
    "pages_copied_in": ("pages_copied_in", "Pages promoted host to device."),
    "copies_out": (
        "copies_out",
        "Device-to-host copy calls of released pages: one per step that releases, whatever the batch.",
    ),
    "copies_in": (
        "copies_in",
        "Host-to-device copy calls of promoted pages: one per step that promotes, whatever the batch.",
    ),
    "promotions_refused": (
        "promotions_refused",
        "Planned pages left on the host: no device page free, none the tree could evict.",
    ),
    "releases_refused": ("releases_refused", "Pages kept on the device for lack of a free host page."),
    "admitted_by_footprint": (
        "admitted_by_footprint",
        "Hot-set requests admitted charging what they keep on the device, not their whole length.",
    ),
    "release_waits": (
        "release_waits",
        "Decode steps short of device room that waited for in-flight release copies before SGLang could retract.",
    ),
    "retracted_to_host": (
        "retracted_to_host",
        "Retracted hot-set requests whose full pages entered the radix tree host-only, so their prefill again "
        "loads them back instead of computing them.",
    ),
    "hot_sets_shrunk": (
        "hot_sets_shrunk",
        "Hot sets the guard had grown past their budget (its selection wanted released pages), put back to it "
        "by a decode step short of device room before SGLang could retract.",
    ),
    "prefill_chunks_released": (
        "prefill_chunks_released",
        "Prefill chunks after which a streamed long prompt's full pages left the device for the host pool "
        "(--hot-set-prefill stream).",
    ),
    "history_pages_on_host": (
        "history_pages_on_host",
        "Pages of returning turns' histories matched in the host pool and read from there by their prefill "
        "and first decode step, never loaded back whole (--hot-set-prefix host with streamed prefill).",
    ),
    "footprint_refused": (
        "footprint_refused",
        "Hot-set requests admitted at their whole length: the host pool could not take their pages, or their rows could not be borrowed.",
    ),
    "finished_reinserted": (
        "finished_reinserted",
        "Finished hot-set requests whose released pages came back to the device and entered the radix tree.",
    ),
    "finished_uncached": (
        "finished_uncached",
        "Finished hot-set requests left out of the radix tree: no device room for their released pages, "
        "and no host insert (host pool full, or SGLang's Rust tree core).",
    ),
    "finished_on_host": (
        "finished_on_host",
        "Finished hot-set requests whose pages entered the radix tree host-only: no device room to take them back.",
    ),
    "prefix_pages_lent": (
        "prefix_pages_lent",
        "Matched-prefix pages running hot-set requests took over, with the radix tree's host copies (--hot-set-prefix host).",
    ),
    "prefix_pages_released": (
        "prefix_pages_released",
        "Lent prefix pages a request's plan left out: read from the host copy, no longer from the device.",
    ),
    "prefix_pages_owned": (
        "prefix_pages_owned",
        "Lent prefix pages a request's plan kept, copied host to device into pages of its own so the tree's could go.",
    ),
    "prefix_holds": (
        "prefix_holds",
        "Hot-set requests whose matched prefix stopped pinning the radix tree's device pages.",
    ),
    "prefix_relocked": (
        "prefix_relocked",
        "Finished requests holding their prefix on the host whose tree pages were still on the device: taken back, nothing copied.",
    ),
}


# The hot set's gauges: name after ``hot_set_`` -> help.
HOT_SET_GAUGES = {
    "guard_rows_in_use": "Key-code rows of guarded requests' full pages, after the last decode step.",
    "range_rows_in_use": "Key-range rows of tracked requests' full pages, after the last decode step.",
    "borrowed_pages": "KV pages the hot set has borrowed from the allocator for those rows (tokens = pages x "
    "--page-size; in use for SGLang's own counts too), after the last decode step.",
    "device_bytes": "Device bytes the running hot-set requests hold, summed (F(request): the KV pages their rows "
    "read from the device and their key-range and key-code rows), after the last decode step.",
    "tracked_requests": "Requests the hot set decoded in the last decode step.",
}


class HotSetMetrics(_Series):
    """``sgl_importance:hot_set_*_total`` counters and the borrowed rows' gauges
    (``--enable-metrics`` only).

    Args:
        labels: rank labels, so series of several ranks stay apart.
        registry: prometheus_client's default registry unless a test passes one.
    """

    def __init__(self, labels: Mapping[str, Any], registry: Optional[CollectorRegistry] = None) -> None:
        super().__init__(labels, registry)
        self._counters = {
            field: self._series("Counter", f"sgl_importance:hot_set_{suffix}_total", text).labels(**self.labels)
            for field, (suffix, text) in HOT_SET_SERIES.items()
        }
        # Plain values, set by the scheduler (the scrape runs in another process).
        self._gauges = {
            name: self._series("Gauge", f"sgl_importance:hot_set_{name}", text, multiprocess_mode="mostrecent").labels(
                **self.labels
            )
            for name, text in HOT_SET_GAUGES.items()
        }

    def after_step(self, code_rows: int, range_rows: int, borrowed: int, device_bytes: int, tracked: int) -> None:
        """What the borrowed rows and the running requests hold, after each step."""
        for name, value in (
            ("guard_rows_in_use", code_rows),
            ("range_rows_in_use", range_rows),
            ("borrowed_pages", borrowed),
            ("device_bytes", device_bytes),
            ("tracked_requests", tracked),
        ):
            self._gauges[name].set(value)

    def add(self, counts: Mapping[str, int]) -> None:
        """Add one step's counts (``HotSetCounts.as_dict()``)."""
        for field, value in counts.items():
            if value:
                self._counters[field].inc(value)
