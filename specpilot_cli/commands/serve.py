"""``specpilot serve``: the embedded engine behind SGLang's native HTTP API, batched."""

from __future__ import annotations

import click

from specpilot.engine_options import engine_options, spec_from_cli
from specpilot.errors import InputError
from specpilot.options import FiniteRange
from specpilot.output import Report, Section, emit, output_options, render

SERVE_BATCH = 8


@click.command("serve")
@engine_options(defaults={"batch": SERVE_BATCH},
                help_texts={"batch": "Requests decoded together (continuous batching: each has its own cache slot, "
                                     "one step verifies all of them); more wait in the queue (--max-queue)."})
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 or :: for every interface; an IPv6 address works too).")
@click.option("--port", type=click.IntRange(0, 65535), default=30000, show_default=True,
              help="0 picks a free port (printed on stderr).")
@click.option("--max-queue", type=click.IntRange(0, 1_000_000), default=1024, show_default=True,
              help="Requests that may wait for a slot when every slot is taken (0: none); beyond it /generate "
                   "answers 503 with Retry-After.")
@click.option("--backlog", type=click.IntRange(1, 65535), default=2048, show_default=True,
              help="Connections the listen socket holds before the server accepts them.")
@click.option("--grace", type=FiniteRange(0, 86400), default=30.0, show_default=True,
              help="Seconds the requests in flight get to finish after SIGTERM before they are failed.")
@click.option("--log-requests", is_flag=True, help="One line per finished request on stderr (TTFT, ITL, e2e).")
@output_options
def command(host, port, max_queue, backlog, grace, log_requests, fmt, out, **kw):
    """Serve the engine over HTTP: POST /generate (SGLang-native), the OpenAI-compatible
    /v1/completions and /v1/chat/completions (streaming too), GET /metrics.

    \b
    Example:
      specpilot serve --model smollm2 --mode tree --nodes 16 --batch 8 --port 30000
      curl -s localhost:30000/generate -d '{"text": "Hi", "sampling_params": {"max_new_tokens": 16}}'
      curl -s localhost:30000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

    Concurrent requests are decoded together (--batch of them at a time, each lossless: its
    output equals its own greedy decoding). Greedy only: sampling parameters that would change
    the answer are refused with 400. SIGTERM or Ctrl-C stops admitting, lets the requests in
    flight finish (--grace), then prints what it served and exits 0.
    """
    spec = spec_from_cli(kw)
    from specpilot.engine.api import load_engine, resolve_model
    from specpilot.engine.listen import bind, url_host
    from specpilot.errors import EnvironmentMissing

    resolve_model(spec.model, spec.random)   # a bad model: said before the server's imports (torch, seconds)
    if out:   # the summary is written at exit: its model's files are refused now, not then
        from specpilot.fileio import check_output_path

        check_output_path(out, "--out", protect=spec.inputs())
    sock = bind(host, port, backlog)         # and a port in use, or a host not this machine's

    try:   # declared dependencies, but an install without them should say so, not crash
        import uvicorn  # noqa: F401  (imported where the server starts, after the model loads)

        from specpilot.engine.server import SERVED_ALWAYS, Server, ServeOptions
    except ModuleNotFoundError as e:
        sock.close()
        raise EnvironmentMissing(f"serve needs {e.name}, which this Python lacks (pip install fastapi uvicorn "
                                 "httpx, or reinstall specpilot with its dependencies)") from None

    engine = load_engine(spec)
    log = (lambda m: click.echo(f"specpilot serve: {m}", err=True)) if log_requests else None
    srv = Server(engine, ServeOptions(host=host, port=port, backlog=backlog, max_queue=max_queue, grace=grace, log=log),
                 sock=sock)
    click.echo(f"specpilot serve: {engine.model_name} {spec.mode} on http://{url_host(host)}:{srv.port} "
               f"({engine.info['dtype']}, {spec.device}, "
               f"{'Q pass ' + str(engine.info.get('qview')) + ', ' if spec.mode == 'tlv' else ''}"
               f"batch {srv.state.decoder.batch}; load "
               f"{engine.info['load_seconds']:.1f} s, warm-up {engine.info['warmup_seconds']:.1f} s); "
               f"{spec.text(always=SERVED_ALWAYS)}", err=True)
    st = srv.run()
    data = {"schema": "specpilot.serve/1", "engine": spec.text(always=SERVED_ALWAYS), "model": engine.model_name,
            "host": host, "port": srv.port, **st}
    pct = lambda k: st.get(k) if st.get(k) is None else round(st[k] * 1e3, 1)  # noqa: E731
    report = Report(data=data, sections=[
        Section("served", ["requests", "bad requests", "errors", "rejected", "aborted", "generated", "steps",
                           "request passes", "tau", "busy s"],
                [[st["requests"], st["bad_requests"], st["errors"], st["rejected"], st["aborted"],
                  st["completion_tokens"], st["spec_verify_ct"], st["request_passes"], st["tau"],
                  st["busy_seconds"]]]),
        Section("latency (ms)", ["", "p50", "p90", "p99"],
                [[name, pct(f"{k}_p50"), pct(f"{k}_p90"), pct(f"{k}_p99")]
                 for name, k in (("time to first token", "ttft"), ("inter-token", "itl"), ("end to end", "e2e"))])])
    try:
        emit(report, fmt, out, protect=spec.inputs())
    except InputError:   # --out unwritable at exit (its folder gone): the session's summary goes to stdout
        click.echo(render(report, fmt), nl=False)
        raise
    return 0
