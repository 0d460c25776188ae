"""The wrapper's own Prometheus families (all `llama_wrapper_`), one set for the process: counters only grow,
across reloads too. GET /metrics serves them after llama-server's own (wrapper/http/listener.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from wrapper.lifecycle import State

DURATIONS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Tally:
    """One consumer's counts (`consumers:`), for the status; /metrics has them as labelled families."""

    hits: int = 0
    misses: int = 0
    evictions: dict[str, int] = field(default_factory=dict)  # tier -> conversations removed to make room
    waits: int = 0
    wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {"hits": self.hits, "misses": self.misses, "evictions": dict(self.evictions), "waits": self.waits,
                "wait_seconds": round(self.wait_seconds, 3)}


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.state = Gauge("llama_wrapper_state", "1 for the state the wrapper is in", ["state"], registry=r)
        self.starts = Counter("llama_wrapper_starts", "Starts, by outcome (ready, failed, aborted)", ["outcome"],
                              registry=r)
        self.server_restarts = Counter("llama_wrapper_server_restarts", "llama-server started again: after a crash, "
                                       "a hang, or dying under a restore (`restore`)", ["reason"], registry=r)
        self.reloads = Counter("llama_wrapper_reloads", "Reloads, by outcome (success, rolled_back)", ["outcome"],
                               registry=r)
        self.reload_downtime = Histogram("llama_wrapper_reload_downtime_seconds",
                                         "How long a reload held requests", buckets=DURATIONS, registry=r)
        self.slot_ops = Counter("llama_wrapper_slot_operations", "Slot saves and restores, by outcome",
                                ["operation", "outcome"], registry=r)
        self.slot_tokens = Counter("llama_wrapper_slot_tokens", "Tokens saved or restored", ["operation"],
                                   registry=r)
        self.slot_bytes = Counter("llama_wrapper_slot_bytes", "Bytes of KV saved or restored", ["operation"],
                                  registry=r)
        self.slot_seconds = Histogram("llama_wrapper_slot_operation_seconds", "How long one slot's save or restore "
                                      "took", ["operation"], buckets=DURATIONS, registry=r)
        self.reused_tokens = Counter("llama_wrapper_reused_tokens",
                                     "Tokens the first request after a restore took from the cache", registry=r)
        self.hook_runs = Counter("llama_wrapper_hook_runs", "Hook actions run, by hook and outcome",
                                 ["hook", "outcome"], registry=r)
        self.hook_seconds = Histogram("llama_wrapper_hook_seconds", "How long a hook action took", ["hook"],
                                      buckets=DURATIONS, registry=r)
        self.requests = Counter("llama_wrapper_requests", "Proxied requests answered, by status class",
                                ["status_class"], registry=r)
        self.in_flight = Gauge("llama_wrapper_requests_in_flight", "Requests being served", registry=r)
        self.held = Gauge("llama_wrapper_requests_held", "Requests held while starting or reloading", registry=r)
        self.conv_entries = Gauge("llama_wrapper_conversation_cache_entries", "Conversations in the cache on disk",
                                  registry=r)
        self.conv_bytes = Gauge("llama_wrapper_conversation_cache_bytes", "Bytes of the cache on disk", registry=r)
        self.conv_unkept = Gauge("llama_wrapper_conversation_cache_unkept_tokens", "Tokens the slots hold that the "
                                 "cache does not keep (a crash now would prefill them again)", registry=r)
        self.conv_lookups = Counter("llama_wrapper_conversation_cache_lookups", "Requests that looked for their "
                                    "conversation in the cache: hits and misses by reason", ["result", "reason"],
                                    registry=r)
        self.conv_bytes_written = Counter("llama_wrapper_conversation_cache_written_bytes",
                                          "Bytes written into the cache", registry=r)
        self.conv_checkpoints = Counter("llama_wrapper_conversation_cache_checkpoints", "Conversations kept again "
                                        "while in their slots: after a quiet moment (idle) or right after an answer "
                                        "(busy)", ["when"], registry=r)
        self.conv_purged = Counter("llama_wrapper_conversation_cache_purged_tokens", "Tokens llama-server erased "
                                   "from an idle slot to make room in the shared KV that the cache did not keep (a "
                                   "loss the wrapper did not prevent)", registry=r)
        self.conv_room = Counter("llama_wrapper_conversation_cache_room_takes", "Slots the wrapper kept and erased "
                                 "to make room in the shared KV before a prompt or a restore", registry=r)
        self.conv_checkpoint_stall = Counter("llama_wrapper_conversation_cache_checkpoint_stall_seconds", "Seconds "
                                             "llama-server's loop spent writing checkpoints taken while busy "
                                             "(every slot's decoding waits meanwhile)", registry=r)
        self.store_entries = Gauge("llama_wrapper_store_entries", "Conversations each tier holds", ["tier"],
                                   registry=r)
        self.store_bytes = Gauge("llama_wrapper_store_bytes", "Bytes each tier holds (the bucket's: the states' "
                                 "sizes)", ["tier"], registry=r)
        self.store_pending = Gauge("llama_wrapper_store_uploads_pending", "Conversations committed to the folder "
                                   "and not yet uploaded", registry=r)
        self.store_uploaded_bytes = Counter("llama_wrapper_store_uploaded_bytes", "Bytes uploaded to the object "
                                            "store", registry=r)
        self.store_fetched_bytes = Counter("llama_wrapper_store_fetched_bytes", "Bytes fetched from the object "
                                           "store", registry=r)
        self.store_fetch_rate = Gauge("llama_wrapper_store_fetch_bytes_per_second", "The measured fetch rate",
                                      registry=r)
        self.store_errors = Counter("llama_wrapper_store_errors", "Requests to the object store that failed",
                                    registry=r)
        self.store_up = Gauge("llama_wrapper_store_up", "1 while the object store answers", registry=r)
        self.degrade_rung = Gauge("llama_wrapper_degrade_rung", "1 for the rung of the ladder that runs",
                                  ["rung"], registry=r)
        self.degrade_context = Gauge("llama_wrapper_degrade_context_tokens", "The context the rung runs with",
                                     registry=r)
        self.degrade_budget = Gauge("llama_wrapper_degrade_budget_bytes", "The memory budget", registry=r)
        self.projector_loaded = Gauge("llama_wrapper_projector_loaded", "1 while llama-server runs with the "
                                      "projector (--mmproj)", registry=r)
        self.spec_running = Gauge("llama_wrapper_spec_running", "1 while llama-server runs with its speculative "
                                  "decoding (spec.when: alone drops it for a crowd)", registry=r)
        self.spec_switches = Counter("llama_wrapper_spec_switches", "Reloads that switched the draft on or off",
                                     ["draft"], registry=r)
        self.projector_changes = Counter("llama_wrapper_projector_changes", "Reloads that loaded or dropped the "
                                         "projector, and media requests refused without one", ["change"], registry=r)
        self.pool_total = Gauge("llama_wrapper_pool_total_bytes", "The memory the pool's members share (degrade.pool)",
                                registry=r)
        self.pool_used = Gauge("llama_wrapper_pool_used_bytes", "What the pool's members' shares add up to",
                               registry=r)
        self.pool_share = Gauge("llama_wrapper_pool_share_bytes", "This member's share of the pool", registry=r)
        self.pool_members = Gauge("llama_wrapper_pool_members", "The pool's living members", registry=r)
        self.pool_moves = Counter("llama_wrapper_pool_moves", "Memory moves between pool members this member took "
                                  "part in: as the asker (asked) or as a giver (gave)", ["role"], registry=r)
        self.paused = Counter("llama_wrapper_priority_paused", "Background generations paused for an interactive "
                              "request", registry=r)
        self.resumed = Counter("llama_wrapper_priority_resumed", "Paused background generations resumed",
                               registry=r)
        self.interactive_wait = Histogram("llama_wrapper_priority_interactive_wait_seconds", "How long an "
                                          "interactive request waited for a slot", buckets=DURATIONS, registry=r)
        self.not_paused = Counter("llama_wrapper_priority_not_paused", "Running requests an interactive request found "
                                  "no free slot behind and that were not paused for it, by why (interactive, "
                                  "preempt_off, max_pauses, between, begun, tools, api, choices, logprobs, no_keep)",
                                  ["reason"], registry=r)
        self.background_queue = Gauge("llama_wrapper_priority_background_waiting", "Background requests waiting "
                                      "for a slot (paused ones included)", registry=r)
        self.asleep = Gauge("llama_wrapper_asleep", "1 while asleep: llama-server stopped, its memory free (sleep:)",
                            registry=r)
        self.consumer_lookups = Counter("llama_wrapper_consumer_lookups", "Each consumer's requests that looked for "
                                        "its conversation (consumers:): hits and misses", ["consumer", "result"],
                                        registry=r)
        self.consumer_evictions = Counter("llama_wrapper_consumer_evictions", "Each consumer's conversations removed "
                                          "to make room, by tier (folder, bucket)", ["consumer", "tier"], registry=r)
        self.consumer_waits = Counter("llama_wrapper_consumer_waits", "Each consumer's requests that waited for a "
                                      "slot", ["consumer"], registry=r)
        self.consumer_wait_seconds = Counter("llama_wrapper_consumer_wait_seconds", "How long each consumer's "
                                             "requests waited for a slot, in all", ["consumer"], registry=r)
        self.consumer_bytes = Gauge("llama_wrapper_consumer_kept_bytes", "What is kept for each consumer, by tier "
                                    "(folder, bucket): its conversations' sizes", ["consumer", "tier"], registry=r)
        self.tallies: dict[str, Tally] = {}  # each consumer's counts, for the status
        for state in State:
            self.state.labels(state=str(state)).set(0)

    def tally(self, consumer: str) -> Tally:
        return self.tallies.setdefault(consumer, Tally())

    def looked_up(self, consumer: str | None, hit: bool) -> None:
        if consumer is not None:
            tally = self.tally(consumer)
            tally.hits += hit
            tally.misses += not hit
            self.consumer_lookups.labels(consumer=consumer, result="hit" if hit else "miss").inc()

    def evicted(self, consumer: str | None, tier: str) -> None:
        if consumer is not None:
            self.tally(consumer).evictions[tier] = self.tally(consumer).evictions.get(tier, 0) + 1
            self.consumer_evictions.labels(consumer=consumer, tier=tier).inc()

    def waited(self, consumer: str | None, seconds: float) -> None:
        if consumer is not None:
            tally = self.tally(consumer)
            tally.waits += 1
            tally.wait_seconds += seconds
            self.consumer_waits.labels(consumer=consumer).inc()
            self.consumer_wait_seconds.labels(consumer=consumer).inc(seconds)

    def follow(self, state: State) -> None:
        for each in State:
            self.state.labels(state=str(each)).set(1 if each is state else 0)

    def answered(self, status: int) -> None:
        self.requests.labels(status_class=f"{status // 100}xx").inc()

    def degrade(self, rung: str | None, n_ctx: int | None, budget: int | None) -> None:
        self.degrade_rung.clear()
        if rung is not None:
            self.degrade_rung.labels(rung=rung).set(1)
        self.degrade_context.set(n_ctx or 0)
        self.degrade_budget.set(budget or 0)

    def text(self, off: tuple[str, ...] = ()) -> bytes:
        """The exposition, without the families whose names begin with one of `off` (a feature that is off)."""
        out = generate_latest(self.registry)
        if not off:
            return out
        prefixes = tuple(prefix.encode() for prefix in off)
        kept = []
        for line in out.split(b"\n"):
            name = line.split(b" ", 3)[2] if line.startswith(b"# ") and line.count(b" ") >= 2 else line
            if not name.startswith(prefixes):
                kept.append(line)
        return b"\n".join(kept)


METRICS = Metrics()
