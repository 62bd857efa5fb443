"""``specpilot serve``: the embedded engine behind SGLang's native HTTP API subset."""

from __future__ import annotations

import signal
import threading

import click

from specpilot.engine_options import engine_options, spec_from_cli
from specpilot.errors import EnvironmentMissing, InputError
from specpilot.output import Report, Section, emit, output_options


@click.command("serve")
@engine_options()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=30000, show_default=True)
@click.option("--log-requests", is_flag=True, help="Log each HTTP request on stderr.")
@output_options
def command(host, port, log_requests, fmt, out, **kw):
    """Serve the engine over HTTP: POST /generate (SGLang-native subset), GET /health.

    \b
    Example:
      specpilot serve --model smollm2 --mode tree --nodes 32 --port 30000
      curl -s localhost:30000/generate -d '{"text": "Hi", "sampling_params": {"max_new_tokens": 16}}'

    Greedy decoding only (temperature 0); requests run one at a time. Stops cleanly on SIGTERM or
    Ctrl-C and then prints what it served.
    """
    spec = spec_from_cli(kw)
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be 0..65535, got {port}")
    from specpilot.engine.api import load_engine
    from specpilot.engine.server import make_server

    engine = load_engine(spec)
    try:
        srv = make_server(engine, host, port, log=(lambda m: click.echo(m, err=True)) if log_requests else None)
    except OSError as e:
        raise EnvironmentMissing(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port") from None
    stop = threading.Event()

    def _stop(signum, frame):
        if not stop.is_set():
            stop.set()
            threading.Thread(target=srv.shutdown, daemon=True).start()

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            old[s] = signal.signal(s, _stop)
    click.echo(f"specpilot serve: {engine.model_name} {spec.mode} on http://{host}:{srv.server_address[1]} "
               f"({engine.info['dtype']}, {spec.device}; load {engine.info['load_seconds']:.1f} s, warm-up "
               f"{engine.info['warmup_seconds']:.1f} s); {spec}", err=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    finally:
        srv.server_close()
        for s, h in old.items():
            signal.signal(s, h)
    st = srv.stats
    data = {"schema": "specpilot.serve/1", "engine": str(spec), "model": engine.model_name, "host": host,
            "port": srv.server_address[1], "requests": st.requests, "errors": st.errors,
            "completion_tokens": st.completion_tokens, "spec_verify_ct": st.verify_steps,
            "tau": (st.completion_tokens - st.requests) / st.verify_steps if st.verify_steps else None,
            "busy_seconds": st.busy_seconds}
    emit(Report(data=data, sections=[Section("served", ["requests", "errors", "tokens", "verify passes", "busy s"],
                                             [[st.requests, st.errors, st.completion_tokens, st.verify_steps,
                                               st.busy_seconds]])]), fmt, out)
    return 0
