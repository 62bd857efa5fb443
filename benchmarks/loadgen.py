"""A load generator for SGLang-native ``/generate`` servers (``specpilot serve``, SGLang itself) and
OpenAI-compatible ``/v1/completions`` ones (``--api openai``: vLLM, SGLang, ``specpilot serve``),
reporting what SGLang's ``bench_serving`` reports: request and token throughput, time to first
token, inter-token latency and end-to-end latency (mean, p50, p90, p99).

    python benchmarks/loadgen.py --url http://127.0.0.1:30000 --concurrency 1,8,32 --num-prompts 64 \
        --max-new-tokens 64 [--prompts FILE | --random-ids 32 --vocab 128256] [--rate 4] [--no-stream] \
        [--api openai --model NAME]

Closed loop (``--concurrency C``, 1 when not given): C clients, each sending its next request when
the last one is answered, until ``--num-prompts`` requests are done. Open loop (``--rate R``):
requests arrive as a Poisson process of R per second whatever the answers, with no cap on the
requests in flight unless ``--concurrency`` (or SGLang's name for it, ``--max-concurrency``) is
given, as SGLang's ``bench_serving`` caps them only with ``--max-concurrency``. Each run reports
the most requests it had in flight at once. Requests stream by default (TTFT and ITL from the
server-sent events, a chunk of n tokens after a gap g counting n gaps of g/n, as bench_serving
does); ``--no-stream`` measures end-to-end latency only. ``ignore_eos`` is set so every request generates ``--max-new-tokens`` tokens.
Library use: :func:`run_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Outcome:
    ok: bool
    status: int = 0
    error: str = ""
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def _stats(xs, scale=1e3) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(xs, [50, 90, 99]) * scale
    return {"mean": statistics.fmean(xs) * scale, "p50": float(p50), "p90": float(p90), "p99": float(p99)}


PATHS = {"sglang": "/generate", "openai": "/v1/completions"}


def _payload(api: str, prompt, max_new_tokens: int, model: str | None) -> dict:
    if api == "openai":
        return {"model": model or "default", "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0,
                "ignore_eos": True}
    return {("text" if isinstance(prompt, str) else "input_ids"): prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}


def _tokens_of(api: str, body: dict, seen: int) -> tuple[int | None, int | None, str | None]:
    """(completion tokens so far, prompt tokens, abort message) of an answer or a streamed event.
    OpenAI: the usage vLLM's continuous_usage_stats puts in every event with text; a server without
    it counts an event with text as one token, as bench_serving does (an event of usage alone, at
    the end, gives the answer's length, no gaps: :func:`_final_usage`)."""
    if api == "openai":
        use = body.get("usage")
        ch = body.get("choices") or [{}]
        if ch[0].get("finish_reason") == "abort":
            return None, None, "aborted"
        if use and ch[0].get("text") is not None:
            return use.get("completion_tokens"), use.get("prompt_tokens"), None
        return (seen + 1 if ch[0].get("text") else seen), None, None
    meta = body["meta_info"]
    fin = meta.get("finish_reason")
    if fin and fin.get("type") == "abort":
        return None, None, str(fin.get("message"))
    return meta["completion_tokens"], meta["prompt_tokens"], None


def _final_usage(api: str, body: dict) -> tuple[int, int | None] | None:
    """(completion tokens, prompt tokens) of an OpenAI stream's closing event of usage alone."""
    use = body.get("usage")
    if api != "openai" or not use or (body.get("choices") or [{}])[0].get("text") is not None:
        return None
    return use.get("completion_tokens") or 0, use.get("prompt_tokens")


def _finished(api: str, body: dict) -> bool:
    """Whether a streamed event says the answer is complete (its finish reason)."""
    if api == "openai":
        return bool((body.get("choices") or [{}])[0].get("finish_reason"))
    return bool((body.get("meta_info") or {}).get("finish_reason"))


async def _one(client, url: str, payload: dict, stream: bool, api: str = "sglang") -> Outcome:
    out = Outcome(ok=False, start=time.perf_counter())
    st = out.start
    path = url + PATHS[api]
    try:
        if not stream:
            r = await client.post(path, json=payload)
            out.status = r.status_code
            if r.status_code != 200:
                out.error = r.text[:200]
                return out
            n, prompt_n, abort = _tokens_of(api, r.json(), 0)
            if abort is not None:   # SGLang answers an aborted request with 200 and finish_reason abort
                out.error = abort
                return out
            if not n:   # every request sets ignore_eos: an answer without tokens was not answered
                out.error = "no tokens in the answer"
                return out
            out.e2e = time.perf_counter() - st
            out.tokens, out.prompt_tokens = n, prompt_n or 0
            out.ok = True
            return out
        last_n, last_t, ended, final = 0, st, False, None
        body = {**payload, "stream": True}
        if api == "openai":
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        async with client.stream("POST", path, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:200]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    ended = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:200]
                    return out
                usage = _final_usage(api, chunk)
                if usage is not None:
                    final = usage
                    out.prompt_tokens = usage[1] or out.prompt_tokens
                    continue
                ended = ended or _finished(api, chunk)
                n, prompt_n, abort = _tokens_of(api, chunk, last_n)
                if abort is not None:
                    out.error = abort
                    return out
                now = time.perf_counter()
                if n is not None and n > last_n:
                    if out.ttft is None:
                        out.ttft = now - st
                    else:
                        out.itl.extend([(now - last_t) / (n - last_n)] * (n - last_n))
                    last_n, last_t = n, now
                if prompt_n is not None:
                    out.prompt_tokens = prompt_n
        out.e2e = time.perf_counter() - st
        out.tokens = final[0] if final is not None else last_n
        if not ended:   # cut off: neither [DONE] nor a finish reason came
            out.error = "the stream ended before the answer did (no [DONE], no finish reason)"
        elif not out.tokens:
            out.error = "no tokens in the stream"
        else:
            out.ok = True
    except Exception as e:   # a failed request is a data point, not a crash of the generator
        out.error = f"{type(e).__name__}: {e}"[:200]
    return out


async def _run(url, payloads, concurrency, rate, stream, seed, timeout, api):
    """The outcomes, the seconds taken and the most requests in flight at once. Closed loop
    (``rate`` None): ``concurrency`` clients. Open loop: Poisson arrivals, at most ``concurrency``
    in flight when given, else no cap (bench_serving's ``--max-concurrency``)."""
    import httpx

    # no cap: a connection per request in flight (a pool of a few would be a cap of its own)
    limits = httpx.Limits(max_connections=(concurrency + 8) if concurrency else None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        outcomes: list[Outcome] = []
        flight = {"now": 0, "peak": 0}

        async def one(p):
            flight["now"] += 1
            flight["peak"] = max(flight["peak"], flight["now"])
            try:
                outcomes.append(await _one(client, url, p, stream, api))
            finally:
                flight["now"] -= 1

        t0 = time.perf_counter()
        if rate is None:
            it = iter(payloads)

            async def worker():
                for p in it:
                    await one(p)

            await asyncio.gather(*[worker() for _ in range(concurrency)])
        else:
            rnd = random.Random(seed)
            sem = asyncio.Semaphore(concurrency) if concurrency else None
            tasks = []

            async def fire(p):
                if sem is None:
                    await one(p)
                    return
                async with sem:
                    await one(p)

            for i, p in enumerate(payloads):
                if i:   # the gaps between arrivals only: a wait after the last would count as load time
                    await asyncio.sleep(rnd.expovariate(rate))
                tasks.append(asyncio.ensure_future(fire(p)))
            await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - t0, flight["peak"]


def run_load(url: str, prompts: list, *, max_new_tokens: int, concurrency: int | None = None,
             rate: float | None = None, num_prompts: int | None = None, stream: bool = True, seed: int = 0,
             timeout: float = 3600, api: str = "sglang", model: str | None = None) -> dict:
    """Send ``num_prompts`` requests (prompts cycled: text or token-id lists) and summarize them.
    ``api``: ``sglang`` (``/generate``) or ``openai`` (``/v1/completions``, ``model`` named).
    ``concurrency``: closed loop, the clients (None: 1); open loop (``rate``), the most requests in
    flight (None: no cap)."""
    n = num_prompts or len(prompts)
    if rate is None and concurrency is None:
        concurrency = 1
    payloads = [_payload(api, prompts[i % len(prompts)], max_new_tokens, model) for i in range(n)]
    outcomes, secs, peak = asyncio.run(_stoppable(_run(url.rstrip("/"), payloads, concurrency, rate, stream, seed,
                                                       timeout, api)))
    good = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in good)
    itl = [x for o in good for x in o.itl]
    tpot = [(o.e2e - o.ttft) / (o.tokens - 1) for o in good if o.ttft is not None and o.tokens > 1]
    return {"api": api, "concurrency": concurrency, "rate": rate, "max_in_flight": peak, "requests": n,
            "completed": len(good),
            "failed": len(outcomes) - len(good), "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
            "duration_s": secs, "request_throughput": len(good) / secs,
            "output_tokens": tokens, "output_throughput": tokens / secs,
            "input_tokens": sum(o.prompt_tokens for o in good), "stream": stream,
            "ttft_ms": _stats([o.ttft for o in good if o.ttft is not None]), "itl_ms": _stats(itl),
            "tpot_ms": _stats(tpot), "e2e_ms": _stats([o.e2e for o in good if o.e2e is not None])}


def print_summary(res: dict) -> None:
    if res["rate"]:
        cap = (f"at most {res['concurrency']} in flight" if res["concurrency"] else "no cap on requests in flight")
        mode = f"rate {res['rate']}/s ({cap}; {res['max_in_flight']} at most seen)"
    else:
        mode = f"concurrency {res['concurrency']}"
    print(f"== {mode}: {res['completed']}/{res['requests']} ok in {res['duration_s']:.1f} s, "
          f"{res['output_throughput']:.2f} tok/s, {res['request_throughput']:.3f} req/s")
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = res[key]
        if s["mean"] is not None:
            print(f"   {name:5s} ms  mean {s['mean']:9.1f}  p50 {s['p50']:9.1f}  p90 {s['p90']:9.1f}  p99 {s['p99']:9.1f}")
    if res["failed"]:
        print(f"   failed {res['failed']}: {res['errors']}")


def read_prompts(path: str) -> list:
    """Text lines, or JSONL rows (the lines that start with '{') with ``text`` (a non-empty string) or
    ``prompt_ids`` (a non-empty list of token ids); a row that is neither is a ValueError naming its
    line (checked before any load is sent: the server would refuse every such request)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            out.append(line)
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"line {i}: a line that starts with '{{' is a JSONL row, and this one is not JSON ({e}); "
                             "give a text prompt that starts with '{' as a row: {\"text\": \"...\"}") from None
        ids, text = row.get("prompt_ids"), row.get("text")
        if ids is not None:
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in ids)):
                raise ValueError(f"line {i}: 'prompt_ids' must be a non-empty list of token ids (integers >= 0)")
            out.append(ids)
        elif isinstance(text, str) and text:
            out.append(text)
        else:
            raise ValueError(f"line {i}: a JSONL row needs 'text' (a non-empty string) or 'prompt_ids' (a non-empty "
                             "list of token ids)")
    return out


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v > 0 or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return v
    return parse


def _counts(text: str) -> list[int]:
    return [_positive(int)(x) for x in text.split(",")]


_stop = {"signal": None, "loop": None, "task": None}   # main()'s signal, the level running now


async def _stoppable(coro):
    """``coro`` as the running level, which a signal main() caught cancels (a signal raising in the
    middle of the event loop's own code, as Python's default does, left a half-made loop whose
    teardown printed a traceback)."""
    _stop.update(loop=asyncio.get_running_loop(), task=asyncio.current_task())
    try:
        if _stop["signal"] is not None:   # caught while the level started
            coro.close()
            raise asyncio.CancelledError
        return await coro
    finally:
        _stop.update(loop=None, task=None)


def _on_signal(signum, frame):  # noqa: ARG001
    """SIGINT or SIGTERM: stop the level running (if any) and run no more."""
    _stop["signal"] = signum
    loop, task = _stop["loop"], _stop["task"]
    if loop is not None and task is not None:
        loop.call_soon_threadsafe(task.cancel)


def main(argv=None):
    """Exit 0 when every request of every run was answered, 1 when some failed, 2 on bad input."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", "--max-concurrency", type=_counts, default=None,
                    help="comma list: closed loop, the client counts (default 1); with --rate, the most requests "
                         "in flight (default: no cap, as bench_serving's --max-concurrency)")
    ap.add_argument("--rate", type=_positive(float), default=None, help="open loop: requests per second (Poisson)")
    ap.add_argument("--num-prompts", type=_positive(int), default=None)
    ap.add_argument("--max-new-tokens", type=_positive(int), default=64)
    ap.add_argument("--prompts", default=None, help="text lines or JSONL (text / prompt_ids)")
    ap.add_argument("--random-ids", type=_positive(int), default=None, help="random token-id prompts of this length")
    ap.add_argument("--vocab", type=_positive(int), default=32000)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--api", choices=sorted(PATHS), default="sglang",
                    help="sglang: POST /generate; openai: POST /v1/completions (vLLM, SGLang, specpilot serve)")
    ap.add_argument("--model", default=None, help="--api openai: the model name the server serves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the summaries as JSON")
    args = ap.parse_args(argv)
    import httpx

    from specpilot.errors import InputError
    from specpilot.fileio import check_output_path, same_file, write_text_atomic

    try:   # refused before any load is sent, not counted as failed requests after it
        url = httpx.URL(args.url)
    except httpx.InvalidURL as e:
        print(f"loadgen: --url {args.url}: {e}", file=sys.stderr)
        return 2
    if url.scheme not in ("http", "https") or not url.host:
        print(f"loadgen: --url {args.url}: give an http:// or https:// URL with a host", file=sys.stderr)
        return 2
    if args.out is not None:   # what the writer would refuse after the load: refused before it
        if args.prompts and Path(args.out).exists() and same_file(args.out, args.prompts):
            print(f"loadgen: --out {args.out}: is the --prompts file; give another file for the summaries",
                  file=sys.stderr)
            return 2
        try:
            if not args.out.strip():
                raise InputError("--out: an empty path; give a file name, or leave --out out")
            check_output_path(args.out, "--out")
        except InputError as e:
            print(f"loadgen: {e}", file=sys.stderr)
            return 2
    if args.prompts and args.random_ids:
        print("loadgen: give --prompts FILE or --random-ids N, not both", file=sys.stderr)
        return 2
    if args.prompts:
        try:
            prompts = read_prompts(args.prompts)
        except (OSError, ValueError) as e:
            print(f"loadgen: --prompts {args.prompts}: {e}", file=sys.stderr)
            return 2
        if not prompts:
            print(f"loadgen: --prompts {args.prompts}: no prompts", file=sys.stderr)
            return 2
    elif args.random_ids:
        rnd = random.Random(args.seed)
        prompts = [[rnd.randrange(args.vocab) for _ in range(args.random_ids)] for _ in range(64)]
    else:
        print("loadgen: give --prompts FILE or --random-ids N", file=sys.stderr)
        return 2
    results = []
    # a signal stops the level running and keeps the finished ones (written to --out)
    _stop["signal"] = None
    old = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for c in args.concurrency or [None]:
            if _stop["signal"] is not None:
                break
            try:
                res = run_load(args.url, prompts, max_new_tokens=args.max_new_tokens, concurrency=c, rate=args.rate,
                               num_prompts=args.num_prompts, stream=not args.no_stream, seed=args.seed,
                               api=args.api, model=args.model)
            except asyncio.CancelledError:
                break
            print_summary(res)
            results.append(res)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    caught, _stop["signal"] = _stop["signal"], None   # a library call after main() runs its load
    if caught is not None:
        name = signal.Signals(caught).name
        kept = f"; the {len(results)} finished level(s) written to {args.out}" if args.out and results else ""
        if args.out and results:
            write_text_atomic(args.out, json.dumps(results, indent=2) + "\n")
        print(f"loadgen: interrupted by {name}{kept}", file=sys.stderr)
        return 128 + caught
    if args.out:
        write_text_atomic(args.out, json.dumps(results, indent=2) + "\n")
    failed = sum(r["failed"] for r in results)
    if failed:
        print(f"loadgen: {failed} of {sum(r['requests'] for r in results)} requests failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
