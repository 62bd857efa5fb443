"""``GET /metrics`` of ``specpilot serve``: the Prometheus text exposition format (version 0.0.4).

Counters, gauges and histograms with the usual ``_total``, ``_bucket{le=...}``, ``_sum`` and
``_count`` names, prefixed ``specpilot_``. Latency histograms are observed by the HTTP layer;
engine totals (steps, rows, accepted draft tokens) are read from the batch decoder's stats when
the page is rendered.
"""

from __future__ import annotations

import bisect
import random
import threading

# samples kept per latency for the exit summary's percentiles: past it, a uniform reservoir of the
# whole run (Vitter's algorithm R), so late requests count as much as the first ones
MAX_SAMPLES = 200_000
# every label value the counters can take, exported at 0 from the start: a series that appears
# only when its first event happens reads as missing to rate() until then
OUTCOMES = ("length", "eos", "stop", "abort", "error")
COMPLETED = ("length", "eos", "stop")
REJECTIONS = ("bad_request", "queue_full", "draining")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def inter_token_gaps(token_times: list[tuple[float, int]]) -> list[float]:
    """Seconds per token between deliveries, SGLang's ``bench_serving`` way: a delivery of n tokens
    after a gap g counts n gaps of g / n (the first delivery, the first token, has no gap)."""
    out, prev = [], None
    for t, n in token_times:
        if prev is not None and n:
            out.extend([(t - prev) / n] * n)
        prev = t
    return out


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{le:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.9g}", f"{name}_count {self.count}"]
        return out


class ServeMetrics:
    """What the server counts itself (requests by outcome, rejections, latencies)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.finished: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.rejected: dict[str, int] = dict.fromkeys(REJECTIONS, 0)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        self.samples: dict[str, list[float]] = {"ttft": [], "itl": [], "e2e": []}   # for percentiles (bounded)
        self.seen: dict[str, int] = dict.fromkeys(self.samples, 0)
        self._rng = random.Random(0)

    def _sample(self, key: str, x: float) -> None:
        xs = self.samples[key]
        self.seen[key] += 1
        if len(xs) < MAX_SAMPLES:
            xs.append(x)
        else:   # the n-th sample replaces a kept one with probability MAX_SAMPLES / n
            j = self._rng.randrange(self.seen[key])
            if j < MAX_SAMPLES:
                xs[j] = x

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def request_done(self, r, reason: str) -> None:
        """A finished engine request: outcome, tokens, and the latencies (queue time, TTFT, inter-token
        gaps, end to end) of a completed request that asked for tokens. Its prompt tokens count once
        the prompt was served: a completed request's, or an aborted (or failed) one's whose prefill
        ran."""
        completed = reason in COMPLETED
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if completed or r.prefilled >= len(r.prompt_ids):
                self.prompt_tokens += len(r.prompt_ids)
            self.completion_tokens += len(r.output)
            # an aborted request's latencies end where the client left or the server stopped it, not
            # where it would have finished: they would skew the percentiles (it has its own counter)
            if not completed:
                return
            if r.t_admitted is not None:
                self.queue.observe(r.t_admitted - r.t_arrival)
            if r.t_first is not None:
                self.ttft.observe(r.t_first - r.t_arrival)
                self._sample("ttft", r.t_first - r.t_arrival)
            for gap in inter_token_gaps(r.token_times):
                self.itl.observe(gap)
                self._sample("itl", gap)
            # a request for no token (max_new_tokens 0: a prompt scored or cached) is answered without
            # the engine in no time; it counts as a finished request, but its ~0 s would only pull the
            # end-to-end percentiles of generating requests down (SGLang 0.5.23 observes its latencies,
            # but there it runs a prefill)
            if r.t_done is not None and r.max_new_tokens > 0:
                self.e2e.observe(r.t_done - r.t_arrival)
                self._sample("e2e", r.t_done - r.t_arrival)

    def render(self, decoder) -> str:
        st = decoder.stats
        running, waiting = decoder.load()
        with self.lock:
            out: list[str] = []

            def metric(name, kind, help_text, lines):
                out.append(f"# HELP specpilot_{name} {help_text}")
                out.append(f"# TYPE specpilot_{name} {kind}")
                out.extend(lines)

            def labelled(name, values: dict, label: str):
                return [f'specpilot_{name}{{{label}="{k}"}} {v}' for k, v in sorted(values.items())]

            metric("requests_total", "counter", "Finished requests by outcome (length, eos, stop, abort, error).",
                   labelled("requests_total", self.finished, "outcome"))
            metric("rejected_requests_total", "counter", "Requests refused before they reached the engine.",
                   labelled("rejected_requests_total", self.rejected, "reason"))
            metric("prompt_tokens_total", "counter", "Prompt tokens of completed requests, and of others prefilled.",
                   [f"specpilot_prompt_tokens_total {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter",
                   "Tokens generated, of requests aborted or cut by a drain too (as SGLang counts them).",
                   [f"specpilot_generation_tokens_total {st.tokens}"])
            metric("verify_steps_total", "counter", "Verify passes of the target (all requests of a step count once).",
                   [f"specpilot_verify_steps_total {st.verify_steps}"])
            metric("prefill_passes_total", "counter", "Passes that ran prompt rows only.",
                   [f"specpilot_prefill_passes_total {st.prefill_passes}"])
            metric("overlapped_steps_total", "counter",
                   "AR steps fed on the device while the host took the previous step's tokens.",
                   [f"specpilot_overlapped_steps_total {st.overlapped_steps}"])
            metric("eager_steps_total", "counter",
                   "Verify steps run eagerly although the decoder has bucket graphs (prompt rows in them).",
                   [f"specpilot_eager_steps_total {st.eager_steps}"])
            metric("eager_step_seconds_total", "counter", "Wall time of those eager steps.",
                   [f"specpilot_eager_step_seconds_total {st.eager_seconds:.6f}"])
            metric("mixed_steps_total", "counter",
                   "Verify steps with a prompt chunk replayed from a mixed bucket graph.",
                   [f"specpilot_mixed_steps_total {st.mixed_steps}"])
            metric("prefill_replays_total", "counter",
                   "Prefill passes of one prompt chunk replayed from a mixed bucket graph.",
                   [f"specpilot_prefill_replays_total {st.prefill_replays}"])
            metric("rows_total", "counter", "Rows run through the target (verify and prompt rows).",
                   [f"specpilot_rows_total {st.rows}"])
            metric("draft_tokens_total", "counter", "Draft tokens verification checked (tree nodes, chain drafts).",
                   [f"specpilot_draft_tokens_total {st.proposed}"])
            metric("accepted_draft_tokens_total", "counter", "Draft tokens accepted by verification.",
                   [f"specpilot_accepted_draft_tokens_total {st.accepted}"])
            tau = st.tau()
            metric("tau", "gauge", "Tokens committed per request per verify pass (accepted + 1), since start.",
                   [f"specpilot_tau {tau if tau is not None else 0:.6g}"])
            metric("running_requests", "gauge", "Requests holding a cache slot.", [f"specpilot_running_requests {running}"])
            metric("queue_depth", "gauge", "Requests waiting for a slot.", [f"specpilot_queue_depth {waiting}"])
            metric("step_seconds", "histogram", "Wall time of one scheduler step.",
                   st.step_hist.lines("specpilot_step_seconds"))
            metric("time_to_first_token_seconds", "histogram", "Arrival to first token.",
                   self.ttft.lines("specpilot_time_to_first_token_seconds"))
            metric("inter_token_latency_seconds", "histogram", "Gap between delivered tokens.",
                   self.itl.lines("specpilot_inter_token_latency_seconds"))
            metric("e2e_request_latency_seconds", "histogram", "Arrival to last token.",
                   self.e2e.lines("specpilot_e2e_request_latency_seconds"))
            metric("queue_time_seconds", "histogram", "Arrival to a cache slot.",
                   self.queue.lines("specpilot_queue_time_seconds"))
        return "\n".join(out) + "\n"
