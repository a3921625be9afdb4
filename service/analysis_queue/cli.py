"""The ``analysis-queue`` command: serve, migrate, token, core-sim, demo."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from importlib import metadata

from aiohttp import web

from analysis_queue import logs
from analysis_queue.app import build_app, resolve_dsn
from analysis_queue.config import Settings
from analysis_queue.http.auth import mint_token
from analysis_queue.store.migrate import apply_migrations


def _serve(_args: argparse.Namespace) -> int:
    settings = Settings()
    logs.configure(settings.log_level)

    def on_fatal(_loop: str) -> None:
        # A dead background loop must not leave a half-working instance behind.
        os.kill(os.getpid(), signal.SIGTERM)

    app = build_app(settings, on_fatal=on_fatal)
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        shutdown_timeout=settings.shutdown_timeout_s,
        print=lambda _msg: print(
            f"analysis-queue listening on http://{settings.host}:{settings.port}", flush=True
        ),
        access_log=None,
    )
    return 0


def _migrate(_args: argparse.Namespace) -> int:
    settings = Settings()
    logs.configure(settings.log_level)

    async def run() -> list[int]:
        return await apply_migrations(await resolve_dsn(settings))

    applied = asyncio.run(run())
    print(f"applied migrations: {applied or 'none (up to date)'}")
    return 0


def _token(args: argparse.Namespace) -> int:
    settings = Settings().with_generated_secrets()
    if args.admin:
        print(settings.admin_token)
    else:
        token = mint_token(
            args.user,
            settings.jwt_secret,
            ttl_s=args.ttl,
            issuer=settings.jwt_issuer or None,
            audience=settings.jwt_audience or None,
        )
        print(token)
    return 0


def _core_sim(args: argparse.Namespace) -> int:
    from analysis_queue.core.sim import run_standalone

    settings = Settings().with_generated_secrets()
    logs.configure(settings.log_level)
    run_standalone(
        args.host,
        args.port,
        args.callback_url or [settings.callback_base_url.rstrip("/") + "/v1/core/events"],
        settings.core_callback_secret,
        args.judge_time,
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from analysis_queue.demo import run_demo

    return asyncio.run(run_demo(theses=args.theses, judge_time_s=args.judge_time))


def _version() -> str:
    try:
        return metadata.version("analysis-queue")
    except metadata.PackageNotFoundError:  # a bare checkout on sys.path, not installed
        return "unknown"


def _use_uvloop() -> None:
    """uvloop where it is installed (Linux, macOS): the same asyncio, markedly less CPU per
    request and per query, which is this service's limit (see docs/benchmarks.md)."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="analysis-queue", description=__doc__)
    parser.add_argument("--version", action="version", version=f"analysis-queue {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the service (AQ_* settings)").set_defaults(fn=_serve)
    sub.add_parser("migrate", help="apply database migrations").set_defaults(fn=_migrate)
    token = sub.add_parser("token", help="print a user token for local use")
    token.add_argument("user", nargs="?", default="")
    token.add_argument("--admin", action="store_true", help="print the admin token instead")
    token.add_argument("--ttl", type=int, default=24 * 3600, help="lifetime in seconds")
    token.set_defaults(fn=_token)
    sim = sub.add_parser("core-sim", help="run the Core simulator alone")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8090)
    sim.add_argument("--callback-url", action="append", help="repeatable; default the service")
    sim.add_argument("--judge-time", type=float, default=2.0, help="seconds per run")
    sim.set_defaults(fn=_core_sim)
    demo = sub.add_parser("demo", help="replay the write-up: one lecturer, five theses")
    demo.add_argument("--theses", type=int, default=5)
    demo.add_argument("--judge-time", type=float, default=1.0)
    demo.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    if args.command == "token" and not args.admin and not args.user:
        parser.error("token needs a USER (or --admin)")
    if args.command in ("serve", "core-sim", "demo"):
        _use_uvloop()
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
