"""``kvobs serve | demo``: the command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    from kvobs.sidecar.server import serve

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"kvobs serve: reading {args.dir}, serving http://{args.host}:{args.port}/metrics", flush=True)
    try:
        serve(Path(args.dir), args.host, args.port)
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"kvobs serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvobs.demo import run_demo

    return run_demo(args)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="kvobs", description="Make vLLM's KV-cache offloading explain itself.")
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the sidecar: Prometheus metrics and failure reports over HTTP")
    serve.add_argument("--dir", required=True, help="the kvobs directory the engines write (KVOBS_DIR)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=9464, help="port (default 9464)")
    serve.set_defaults(func=_serve)
    demo = sub.add_parser("demo", help="show kvobs explaining failed loads on vLLM's real offload manager (CPU)")
    demo.add_argument("--dir", default=None, help="kvobs directory (default: a new temporary one)")
    demo.add_argument("--port", type=int, default=9464, help="sidecar port (default 9464)")
    demo.add_argument("--requests", type=int, default=400, help="requests in the workload (default 400)")
    demo.add_argument("--seed", type=int, default=0, help="workload seed")
    demo.add_argument("--no-tiering", action="store_true", help="only the CPU spec, no tiering run")
    demo.add_argument("--keep-serving", action="store_true", help="keep the sidecar running afterwards")
    demo.set_defaults(func=_demo)
    return root


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
