"""Command line of mlflow_setup.

    python -m trainforge.mlflow_setup serve --home DIR [--host H] [--port P]   # foreground (containers)
        [--backend-store-uri sqlite:///PATH.db | postgresql://USER:PASSWORD@HOST:PORT/DB]
        [--artifacts-destination DIR | s3://BUCKET/PREFIX]   # S3 endpoint: MLFLOW_S3_ENDPOINT_URL
    python -m trainforge.mlflow_setup start --home DIR [--port 0]               # background; prints URL
    python -m trainforge.mlflow_setup stop --home DIR
    python -m trainforge.mlflow_setup wait --url URL --timeout-s 60
    python -m trainforge.mlflow_setup bootstrap --tracking-uri URL --experiment NAME \
        --registered-model NAME[=DESCRIPTION]
    python -m trainforge.mlflow_setup webhook --tracking-uri URL \
        --url AIRFLOW_API/trainforge-webhooks/mlflow --secret-env VAR   # alias changes -> assets

Exit codes: 0 ok, 1 the server failed or a store cannot be reached (message on stderr),
2 bad arguments (including a store URI of an unsupported scheme).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from trainforge.mlflow_setup.bootstrap import bootstrap
from trainforge.mlflow_setup.errors import MlflowSetupError, StoreArgumentError
from trainforge.mlflow_setup.server import (
    ServerConfig,
    build_server_command,
    client_url,
    server_env,
    start_server,
    stop_server,
    wait_healthy,
)
from trainforge.mlflow_setup.processes import free_port
from trainforge.mlflow_setup.stores import check_stores
from trainforge.mlflow_setup.webhook import register_webhook


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home", required=True, type=Path, help="state dir (db, artifacts, pid, log)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", default=5000, type=int, help="port (default 5000; 0 = any free)")
    parser.add_argument(
        "--backend-store-uri", default=os.environ.get("MLFLOW_BACKEND_STORE_URI") or None,
        help="sqlite:///PATH.db or postgresql://USER:PASSWORD@HOST:PORT/DB "
        "(default $MLFLOW_BACKEND_STORE_URI, else sqlite:///HOME/mlflow.db; the environment "
        "keeps a password off the command line)",
    )
    parser.add_argument(
        "--artifacts-destination", default=os.environ.get("MLFLOW_ARTIFACTS_DESTINATION") or None,
        help="folder or s3://BUCKET/PREFIX, proxied by the server (default "
        "$MLFLOW_ARTIFACTS_DESTINATION, else HOME/artifacts; "
        "S3 endpoint from MLFLOW_S3_ENDPOINT_URL or AWS_ENDPOINT_URL)",
    )
    parser.add_argument("--workers", default=1, type=int, help="uvicorn workers (default 1)")
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        help="Host headers the server accepts besides localhost and private IPs "
        "(needed when clients use a DNS name, e.g. 'mlflow,mlflow:5000')",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainforge.mlflow_setup", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_server_args(commands.add_parser("serve", help="run the server in the foreground"))
    start = commands.add_parser("start", help="start in the background, wait until healthy")
    _add_server_args(start)
    start.add_argument("--timeout-s", default=60.0, type=float, help="health deadline (s)")
    stop = commands.add_parser("stop", help="stop the server started from --home")
    stop.add_argument("--home", required=True, type=Path)
    stop.add_argument("--grace-s", default=10.0, type=float, help="SIGTERM→SIGKILL grace (s)")
    wait = commands.add_parser("wait", help="wait until GET URL/health answers 200")
    wait.add_argument("--url", required=True)
    wait.add_argument("--timeout-s", default=60.0, type=float)
    wait.add_argument("--interval-s", default=0.5, type=float)
    boot = commands.add_parser("bootstrap", help="create experiments and registered models")
    boot.add_argument("--tracking-uri", required=True)
    boot.add_argument("--experiment", action="append", default=[], metavar="NAME")
    boot.add_argument(
        "--registered-model", action="append", default=[], metavar="NAME[=DESCRIPTION]"
    )
    hook = commands.add_parser("webhook", help="register the alias-change webhook to Airflow")
    hook.add_argument("--tracking-uri", required=True)
    hook.add_argument("--url", required=True,
                      help="the receiver: <Airflow API server>/trainforge-webhooks/mlflow")
    hook.add_argument("--secret-env", required=True, metavar="VAR",
                      help="environment variable holding the secret (the password of Airflow "
                           "connection trainforge_mlflow_webhook)")
    return parser


def _serve(args: argparse.Namespace) -> None:
    """Replace this process with ``mlflow server`` so signals reach it directly."""
    home = args.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(
        home=home,
        host=args.host,
        port=args.port,
        backend_store_uri=args.backend_store_uri,
        artifacts_destination=args.artifacts_destination,
        workers=args.workers,
        allowed_hosts=args.allowed_hosts,
    )
    check_stores(config.store_uri, config.artifacts_uri)
    if "://" not in config.artifacts_uri:
        Path(config.artifacts_uri).mkdir(parents=True, exist_ok=True)
    port = args.port or free_port(args.host)
    argv = build_server_command(config, port)
    print(client_url(args.host, port), flush=True)
    os.chdir(home)
    os.execve(argv[0], argv, server_env(os.environ, config))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            _serve(args)
        elif args.command == "start":
            handle = start_server(
                args.home,
                args.host,
                args.port,
                backend_store_uri=args.backend_store_uri,
                artifacts_destination=args.artifacts_destination,
                workers=args.workers,
                allowed_hosts=args.allowed_hosts,
                timeout_s=args.timeout_s,
            )
            print(handle.url, flush=True)
        elif args.command == "stop":
            stopped = stop_server(args.home, grace_s=args.grace_s)
            logging.getLogger("mlflow_setup").info(
                "%s", "stopped" if stopped else f"no running server for {args.home}"
            )
        elif args.command == "wait":
            wait_healthy(args.url, args.timeout_s, args.interval_s)
        elif args.command == "bootstrap":
            models = [
                (name, description or None)
                for name, _, description in (m.partition("=") for m in args.registered_model)
            ]
            result = bootstrap(args.tracking_uri, args.experiment, models)
            print(" ".join(f"{k}={v}" for k, v in result.experiment_ids.items()), flush=True)
        elif args.command == "webhook":
            print(register_webhook(args.tracking_uri, args.url,
                                   os.environ.get(args.secret_env, "")), flush=True)
    except StoreArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except MlflowSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
