"""``ddtree serve``: the OpenAI-compatible server (also ``python -m ddtree.server``).

Wire into ``ddtree/cli.py`` with ``add_serve_parser(sub)`` on its subparsers. Heavy imports
(torch, fastapi, uvicorn) happen in the handler only.
"""
from __future__ import annotations

import argparse
import logging
import signal
import time
import sys

from ddtree.engine.args import add_engine_args, llm_from_args


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    add_engine_args(p)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: from the target)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=10.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are ended with "
                        "an error (default: 10)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API (default 127.0.0.1:8000)",
                              description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("ddtree.server")
    from ddtree.engine.llm import frozen_heap
    from ddtree.server.app import build_app
    from ddtree.server.serving import make_server

    llm = llm_from_args(args)
    if llm.engine.runner.use_graphs:
        # Every graph the configured method may replay, captured before serving (a capture while
        # serving stalls every stream); a request choosing another method or budget captures its
        # own on first use.
        t0 = time.perf_counter()
        cfg, modes = llm.engine.config, ("greedy", "sample", "filtered")
        if cfg.budget == "auto":
            llm.engine.profile_auto(modes=modes)
            log.info("auto budget: start-up cost curve measured in %.1f s", time.perf_counter() - t0)
        else:
            llm.engine.capture_graphs([(cfg.method, cfg.budget, False)], modes)  # (round_graph drops a non-tree budget)
            log.info("CUDA graphs captured in %.1f s", time.perf_counter() - t0)
    app = build_app(llm, served_model_name=args.served_model_name,
                    shutdown_grace_s=args.timeout_graceful_shutdown)
    server = make_server(app, args.host, args.port, log_level=args.log_level,
                         grace_s=args.timeout_graceful_shutdown)
    name = app.state.server.model_name
    log.info("serving %s (%s%s) on http://%s:%d/v1", name, args.method,
             f", budget {args.budget}" if args.method == "ddtree" else "", args.host, args.port)

    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
    # place that re-raise is a no-op, so a SIGTERM/SIGINT shutdown exits 0.
    signals = []

    def _note(sig, frame):
        signals.append(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _note)
    with frozen_heap() as frozen:  # start-up objects stay out of the collector's full passes
        log.info("froze %d start-up objects for the garbage collector", frozen)
        server.run()
    if not server.started:
        return 1  # e.g. the port is taken (uvicorn logged why)
    log.info("server stopped%s", f" by signal {signals[0]}" if signals else "")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree.server", description=__doc__.split("\n")[0])
    _add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
