"""The ``kvturn`` command."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvturn_server._settings import field_help, plain_warnings
from kvturn_server.bench import (
    add_fleet_bench_parser,
    add_reuse_bench_parser,
    add_router_bench_parser,
    add_sdk_bench_parser,
)
from kvturn_server.bench.agent import add_agent_bench_parser
from kvturn_server.bench.trace import add_trace_bench_parser
from kvturn_server.connector import ConnectorConfig
from kvturn_server.local import (
    SIZES,
    STOCK_ROUTER_ARGS,
    Backoff,
    ProgressLine,
    Stack,
    StackConfig,
    StackError,
    build_model,
    log_tail,
    read_running,
    stop_running,
)
from kvturn_server.router import add_router_args
from kvturn_server.sim import add_simulate_parser

# The connector keys `kvturn up` sets, by flag: their help and defaults are the connector's
# own (StackConfig's fields take ConnectorConfig's defaults); the flags use the router's name
# for the lease (--retention-ttl), the connector keeps vLLM's (decoder_kv_blocks_ttl).
CONNECTOR_FLAGS = (("--kv-read-timeout", "kv_read_timeout"),
                   ("--retention-ttl", "decoder_kv_blocks_ttl"),
                   ("--retention-budget", "retention_budget"))


def _add_stack_args(p: argparse.ArgumentParser) -> None:
    d = StackConfig()
    p.add_argument("--state-dir", type=Path, default=d.state_dir,
                   help="where the stack keeps its model, logs and stack.json "
                        "(default: %(default)s)")
    p.add_argument("--size", choices=sorted(SIZES), default=d.model_size,
                   help="which locally built model to serve (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="serve this model directory instead of <state-dir>/models/<size>")
    for member in ("router", "prefill", "decode"):
        p.add_argument(f"--{member}-host", default=None, metavar="ADDRESS",
                       help=f"loopback address the {member} listens on (default: {d.host}); "
                            "an own 127.0.0.x each runs the stack as on separate hosts, every "
                            "address passed explicitly (docs/deploy.md, \"Addresses\")")
    p.add_argument("--router-port", type=int, default=d.router_port, help="default: %(default)s")
    p.add_argument("--prefill-port", type=int, default=d.prefill_port, help="default: %(default)s")
    p.add_argument("--decode-port", type=int, default=d.decode_port, help="default: %(default)s")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help="KV cache per vLLM instance in GiB (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context length (default: %(default)s)")
    for flag, key in CONNECTOR_FLAGS:
        p.add_argument(flag, type=float, default=getattr(d, key),
                       help=f"the connectors' {key}: " + field_help(ConnectorConfig, key))
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout,
                   help="seconds to wait for the servers to become healthy (default: %(default)s)")
    p.add_argument("--kv-offload-gib", type=float, default=d.kv_offload_gib, metavar="GIB",
                   help="host tier per instance: host memory for vLLM's CPU KV offloading under "
                        "kvturn's lease (retentions evicted from the decode's KV cache are "
                        "continued from there; beside kvturn's connector in a MultiConnector, "
                        "on the prefill and the decode; docs/connector.md, \"The host tier\"); "
                        "0: off (default: %(default)s)")


def _stack_config(args: argparse.Namespace) -> StackConfig:
    return StackConfig(
        state_dir=args.state_dir, model_size=args.size, model_dir=args.model_dir,
        router_host=args.router_host, prefill_host=args.prefill_host,
        decode_host=args.decode_host, router_port=args.router_port, prefill_port=args.prefill_port,
        decode_port=args.decode_port, kv_cache_gib=args.kv_cache_gib,
        # Each instance's control endpoint sits on its HTTP port + 1 (the router's default).
        prefill_control_port=args.prefill_port + 1, decode_control_port=args.decode_port + 1,
        max_model_len=args.max_model_len, kv_read_timeout=args.kv_read_timeout,
        decoder_kv_blocks_ttl=args.retention_ttl, retention_budget=args.retention_budget,
        startup_timeout=args.startup_timeout, served_model_name=f"kvturn-{args.size}",
        kv_offload_gib=args.kv_offload_gib)


def _print_endpoints(cfg: StackConfig) -> None:
    print(f"router   {cfg.router_url}/v1   (OpenAI-compatible; model {cfg.served_model_name!r})")
    print(f"prefill  {cfg.prefill_url}   decode {cfg.decode_url}")
    print(f"logs     {cfg.state_dir / 'logs'}")


def cmd_model_build(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = build_model(args.size, args.dir)
    print(f"built {args.size} model in {out} ({time.monotonic() - started:.1f} s)")
    return 0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _backoff(args: argparse.Namespace) -> Backoff:
    return Backoff(initial=args.restart_backoff, maximum=args.restart_backoff_max)


def cmd_up(args: argparse.Namespace) -> int:
    cfg = _stack_config(args)
    if args.detach:
        return _up_detached(args, cfg)
    # The members die with this process (no orphans); while it runs it restarts any that die.
    stack = Stack(cfg, die_with_parent=True, supervise=not args.no_supervise, say=_say,
                  backoff=_backoff(args))
    stack.check()
    print(f"starting prefill + decode vLLM and the router ({cfg.model_size} model); "
          "this takes 1-2 minutes on a small CPU host", file=sys.stderr)
    stack.start(progress=ProgressLine())
    _print_endpoints(cfg)
    if args.supervised_child:
        print("kvturn: stack healthy", flush=True)  # what the detaching parent waits for
    else:
        print("press Ctrl-C to stop")
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stopping and read_running(cfg.state_dir) is not None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopping the stack", file=sys.stderr)
        stack.stop()
    return 0


def _up_detached(args: argparse.Namespace, cfg: StackConfig) -> int:
    """Run the supervising ``kvturn up`` in the background (its own session, so that closing
    the terminal does not end it) and return once the stack is healthy."""
    Stack(cfg).check()
    argv = [a for a in args.argv if a != "--detach"]
    log_path = cfg.state_dir / "logs" / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting prefill + decode vLLM and the router ({cfg.model_size} model) in the "
          f"background; this takes 1-2 minutes on a small CPU host (log: {log_path})",
          file=sys.stderr)
    with open(log_path, "ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "kvturn_server.cli", *argv, "--supervised-child"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + cfg.startup_timeout + 30
    while time.monotonic() < deadline:
        if child.poll() is not None:
            print(f"kvturn: the stack did not start (exit {child.returncode}); last lines of "
                  f"{log_path}:\n{log_tail(log_path)}", file=sys.stderr)
            return 1
        if b"kvturn: stack healthy" in log_path.read_bytes()[-65536:]:
            _print_endpoints(cfg)
            print("running in the background, supervised (pid "
                  f"{child.pid}); stop it with `kvturn down"
                  + (f" --state-dir {cfg.state_dir}`" if cfg.state_dir
                     != StackConfig().state_dir else "`"))
            return 0
        time.sleep(0.5)
    stop_running(cfg.state_dir)
    print(f"kvturn: the stack was not healthy within {cfg.startup_timeout:.0f} s; see "
          f"{log_path}", file=sys.stderr)
    return 1


def cmd_down(args: argparse.Namespace) -> int:
    running = stop_running(args.state_dir)
    if running is None:
        print(f"no kvturn stack is running from {args.state_dir}")
    else:
        print(f"stopped {', '.join(sorted(running.pids))}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    running = read_running(args.state_dir)
    if running is None:
        print(f"no kvturn stack is running from {args.state_dir}")
        return 1
    _print_endpoints(running.config)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from kvturn_server.router import RouterConfigError, router_config_from_args, serve

    try:
        serve(router_config_from_args(args))
    except RouterConfigError as exc:
        print(f"kvturn router: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvturn_server.local import run_demo

    return run_demo(_stack_config(args), turns=args.turns, tool_latency=args.tool_latency,
                    plot=args.plot, api=args.api)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvturn",
        description="Multi-turn KV reuse for disaggregated vLLM: local stack, router, tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="build the local test/benchmark model",
                           description="Build the locally generated model (no downloads).")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    build = model_sub.add_parser(
        "build", help="build a model directory",
        description="Build a Llama-architecture model with seeded random weights, a locally "
                    "trained tokenizer and a tool-calling chat template. Deterministic: building "
                    "twice gives identical files.")
    build.add_argument("--size", choices=sorted(SIZES), default="tiny",
                       help="tiny: tests (fast); bench: heavier per token, 32k context "
                            "(default: %(default)s)")
    build.add_argument("dir", type=Path, help="output directory (created if needed)")
    build.set_defaults(func=cmd_model_build)

    up = sub.add_parser(
        "up", help="start the local prefill/decode/router stack",
        description="Start one prefill and one decode vLLM (CPU) with the kvturn connector and "
                    "the router, on 127.0.0.1 or a loopback address each (--prefill-host ...). "
                    "Runs until Ctrl-C unless --detach.")
    _add_stack_args(up)
    up.add_argument("--detach", action="store_true",
                    help="return once healthy and leave the stack running, supervised by a "
                         "background process (stop: kvturn down)")
    up.add_argument("--no-supervise", action="store_true",
                    help="do not restart members that die (by default one that dies is "
                         "stopped with its whole process group and restarted, with backoff)")
    up.add_argument("--restart-backoff", type=float, default=Backoff().initial,
                    metavar="SECONDS",
                    help="wait before restarting a member that died; doubles per restart in "
                         "a row (default: %(default)s)")
    up.add_argument("--restart-backoff-max", type=float, default=Backoff().maximum,
                    metavar="SECONDS", help="cap on that wait (default: %(default)s)")
    up.add_argument("--supervised-child", action="store_true", help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the local stack",
                          description="Stop the stack recorded in the state directory.")
    down.add_argument("--state-dir", type=Path, default=StackConfig().state_dir,
                      help="default: %(default)s")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="show the running local stack",
                            description="Print the endpoints of the running stack (exit 1 if "
                                        "none runs).")
    status.add_argument("--state-dir", type=Path, default=StackConfig().state_dir,
                        help="default: %(default)s")
    status.set_defaults(func=cmd_status)

    router = sub.add_parser(
        "router", help="run the router in the foreground",
        description="OpenAI-compatible, conversation-aware router: each turn pins the "
                    "conversation's retained KV on its decode, runs a prefill leg "
                    "(max_tokens=1) that reads the verified part of it, then a decode leg that "
                    "reads the prefill's KV and retains the new turn. See docs/http-api.md.")
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    demo = sub.add_parser(
        "demo", help="run the demo: stack up, a tool agent as stock P/D, stock conditional "
                     "disaggregation and kvturn, per-turn table and plot, stack down",
        description="Build the tiny model, start the stack (vLLM's defaults: prefix caching "
                    "on, on the prefill and the decode) and a stock router beside its router "
                    f"(kvturn router {' '.join(STOCK_ROUTER_ARGS)}, on the same prefill and "
                    "decode), and run a LangGraph tool-calling agent three ways: "
                    "stock-pd (a stock client without conversation ids, through the stock "
                    "router: stock P/D), stock-cond (the stock client sending X-Conversation-ID, "
                    "through the stock router: stock conditional disaggregation, as llm-d and "
                    "NVIDIA Dynamo ship it: a short follow-up runs on the decode that served "
                    "the conversation, from its plain prefix cache) and kvturn (the thread is a "
                    "kvturn conversation, through the stack's router). Prints per turn the time "
                    "to first token, the route (the decode alone, or prefill then decode), "
                    "where the prompt's KV came from (the prefill's cache, the decode, "
                    "computed) and kvturn's reuse report; per mode the median TTFT and the "
                    "prompt tokens computed on turns 2 and on, against kvturn's; writes a PNG "
                    "plot and stops what it started. Uses a running stack (kvturn up) as it "
                    "is. A few minutes on a 2-core machine. --api picks the API the agent "
                    "talks through the routers (every mode runs on each).")
    _add_stack_args(demo)
    demo.add_argument("--turns", type=int, default=6,
                      help="model turns of the agent, all but the last call a tool "
                           "(default: %(default)s)")
    demo.add_argument("--tool-latency", type=float, default=0.5,
                      help="seconds each tool call takes (default: %(default)s)")
    demo.add_argument("--api", choices=("chat", "responses", "messages"), default="chat",
                      help="the API the agent talks: chat (Chat Completions), responses "
                           "(/v1/responses) or messages (Anthropic's /v1/messages) "
                           "(default: %(default)s)")
    demo.add_argument("--plot", type=Path, default=None,
                      help="PNG path (default: <state-dir>/demo.png)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (print numbers, write JSON)",
                           description="Benchmarks that start their own servers on free "
                                       "loopback ports.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    add_reuse_bench_parser(bench_sub)
    add_router_bench_parser(bench_sub)
    add_sdk_bench_parser(bench_sub)
    add_agent_bench_parser(bench_sub)
    add_fleet_bench_parser(bench_sub)
    add_trace_bench_parser(bench_sub)
    add_simulate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with plain_warnings("kvturn"):
        args = build_parser().parse_args(argv)
        args.argv = argv  # `kvturn up --detach` runs itself again in the background
        try:
            return int(args.func(args))
        except StackError as exc:
            print(f"kvturn: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
