"""The ``analysis-queue`` command: serve, dev, migrate, token, grant, core-sim, demo.

Exit status: 0 after a clean stop (SIGTERM, SIGINT); 1 when the instance could not start (the
database did not answer in time, a migration failed) or a background loop died; 2 for a usage
error; 78 (EX_CONFIG) for a configuration that cannot run (a missing or unknown setting). A
failure is said in one line that names the setting or the host, not in a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from importlib import metadata

import aiohttp

from analysis_queue import logs, tracing
from analysis_queue.app import StartupError, build_app, resolve_dsns, serve
from analysis_queue.config import (
    EMBEDDED,
    REQUIRED_BECAUSE,
    SIMULATOR,
    Settings,
    missing_for_serve,
    safe_dsn,
    unknown_variables,
)
from analysis_queue.dev.sim_runs import PgRunStore
from analysis_queue.http.auth import TOKEN_TTL_S, mint_token
from analysis_queue.http.edge import raise_fd_limit
from analysis_queue.store.migrate import MigrationError, apply_migrations

log = logging.getLogger("analysis_queue")

EXIT_FAILED = 1
EXIT_USAGE = 2  # as argparse's own usage errors
EXIT_CONFIG = 78  # sysexits.h EX_CONFIG


class ConfigError(Exception):
    """The configuration cannot run; each line names a setting."""


def _settings() -> Settings:
    problems = unknown_variables(os.environ)
    if problems:
        raise ConfigError("\n".join(problems))
    return Settings()


def _run(settings: Settings, banner: Callable[[], None]) -> int:
    """Run the service until SIGTERM/SIGINT; 1 if it could not start or a loop died."""
    fatal: list[str] = []

    def on_fatal(loop: str) -> None:
        # A dead background loop must not leave a half-working instance behind: stop, and say
        # so in the exit status, so that a supervisor restarts the instance.
        fatal.append(loop)
        os.kill(os.getpid(), signal.SIGTERM)

    fds = raise_fd_limit()  # before the app: the default AQ_MAX_CONNECTIONS is computed from it
    log.info(
        "file descriptor limit",
        extra={"action": "start", "soft": fds.soft, "hard": fds.hard, "soft_before": fds.before},
    )
    try:
        traced = tracing.configure(os.environ, instance_id=settings.instance_id, version=_version())
    except tracing.TracingUnavailable as exc:
        raise ConfigError(str(exc)) from exc
    if traced:
        log.info(
            "tracing on: OpenTelemetry, as the OTEL_* variables say", extra={"action": "start"}
        )
    try:
        app = build_app(settings, on_fatal=on_fatal)
        asyncio.run(serve(app, settings, banner))
    except (StartupError, MigrationError) as exc:
        log.critical("cannot start: %s", exc, extra={"action": "start"})
        return EXIT_FAILED
    finally:
        tracing.shutdown()  # what is left goes to the exporter
    if fatal:
        log.critical("stopped: a background loop died", extra={"loops": fatal})
        return EXIT_FAILED
    return 0


def _serve(_args: argparse.Namespace) -> int:
    settings = _settings()
    logs.configure(settings.log_level)
    missing = missing_for_serve(settings)
    if missing:
        usual = "serve needs it; `analysis-queue dev` runs without"
        lines = [f"{name}: not set ({REQUIRED_BECAUSE.get(name, usual)})" for name in missing]
        raise ConfigError("\n".join(lines))

    def banner() -> None:
        print(f"analysis-queue listening on http://{settings.host}:{settings.port}", flush=True)

    return _run(settings, banner)


def _dev(_args: argparse.Namespace) -> int:
    """The service for development: whatever is not set is a stand-in, asked for by name."""
    settings = _settings().for_development()
    # The stand-ins' start (initdb, migrations) is not news on a developer's terminal: its
    # first lines are the banner. AQ_LOG_LEVEL, when set, still wins.
    logs.configure(settings.log_level if "log_level" in settings.model_fields_set else "WARNING")
    base = f"http://{settings.host}:{settings.port}"
    cmd = _command()

    def banner() -> None:
        lines = [
            f"analysis-queue {_version()} in development mode, on {base}",
            f"  dashboard:  {base}/  (sign in with a token)",
            f"  a token:    {cmd} token lecturer",
            f"  credits:    {cmd} grant lecturer 10",
            f"  the demo:   {cmd} demo  (beside this one, in a database of its own)",
            f"  database:   {_shown_database(settings)}",
            f"  Core:       {_shown_core(settings)}",
            "  logs:       warnings and errors (AQ_LOG_LEVEL=INFO for every step); Ctrl-C stops",
        ]
        print("\n".join(lines), flush=True)

    return _run(settings, banner)


def _shown_database(settings: Settings) -> str:
    if settings.database_url == EMBEDDED:
        return f"embedded PostgreSQL, kept under {settings.data_dir}"
    return safe_dsn(settings.database_url or "")


def _shown_core(settings: Settings) -> str:
    if settings.core_url == SIMULATOR:
        return "the simulator, in-process (it invents verdicts; its runs are kept in the database)"
    return settings.core_url or ""


def _command() -> str:
    """How the user can run this command again, as they started it."""
    exe = sys.argv[0] if sys.argv else ""
    if os.path.basename(exe) != "analysis-queue":
        return f"{os.path.basename(sys.executable)} -m analysis_queue"
    if shutil.which("analysis-queue") == os.path.abspath(exe):
        return "analysis-queue"
    relative = os.path.relpath(exe)
    return exe if relative.startswith("..") else relative


def _migrate(_args: argparse.Namespace) -> int:
    settings = _settings()
    logs.configure(settings.log_level)

    async def run() -> list[int]:
        return await apply_migrations((await resolve_dsns(settings)).direct)

    try:
        applied = asyncio.run(run())
    except (StartupError, MigrationError) as exc:
        log.critical("cannot migrate: %s", exc, extra={"action": "migrate"})
        return EXIT_FAILED
    print(f"applied migrations: {applied or 'none (up to date)'}")
    return 0


def _token(args: argparse.Namespace) -> int:
    settings = _settings().with_generated_secrets()
    if args.admin:
        print(settings.secret("admin_token"))
    else:
        max_ttl_s = int(settings.jwt_max_ttl_s)
        ttl_s = min(TOKEN_TTL_S, max_ttl_s) if args.ttl is None else args.ttl
        if not 0 < ttl_s <= max_ttl_s:
            # The service would refuse such a token (401): say so now, not at the first request.
            print(
                f"analysis-queue token: --ttl must be between 1 and {max_ttl_s} seconds "
                f"(AQ_JWT_MAX_TTL_S); got {ttl_s}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        token = mint_token(
            args.user,
            settings.secret("jwt_secret"),
            ttl_s=ttl_s,
            issuer=settings.jwt_issuer or None,
            audience=settings.jwt_audience or None,
        )
        print(token)
    return 0


def _grant(args: argparse.Namespace) -> int:
    """Grant credits through a running instance's admin API."""
    settings = _settings().with_generated_secrets()
    url = args.url or f"http://{settings.host}:{settings.port}"

    async def run() -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {settings.secret('admin_token')}"}
        body = {"user_id": args.user, "amount": args.amount}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.post(f"{url}/v1/admin/credits", json=body, headers=headers) as response,
        ):
            return response.status, await response.text()

    try:
        status, text = asyncio.run(run())
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"grant: no service answers at {url}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if status != 200:
        print(f"grant: {status} {text}", file=sys.stderr)
        return EXIT_FAILED
    print(text)
    return 0


def _core_sim(args: argparse.Namespace) -> int:
    from analysis_queue.dev.core_sim import run_standalone

    settings = _settings().with_generated_secrets()
    logs.configure(settings.log_level)
    run_standalone(
        args.host,
        args.port,
        args.callback_url or [settings.callback_base_url.rstrip("/") + "/v1/core/events"],
        settings.secret("core_callback_secret"),
        args.judge_time,
        store=PgRunStore(args.database_url) if args.database_url else None,
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from analysis_queue.demo import run_demo

    return asyncio.run(run_demo(_settings(), theses=args.theses, judge_time_s=args.judge_time))


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


# Container allocations between two collections of the youngest generation (CPython's default
# is 700). A serving process allocates a request's objects (its task, futures, headers, rows)
# and drops them within milliseconds; at 700 a collection caught hundreds of them in flight,
# promoted them, and the older generations' collections then walked the whole heap: 14 % of
# the service's CPU in the drain (perf), and 12 % of the simulator's. At 20,000 they die young
# and uncollected (docs/benchmarks.md). The older generations keep their defaults.
GC_YOUNG_THRESHOLD = 20_000


def _tune_gc() -> None:
    """Collect the youngest generation less often, in the processes that serve."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="analysis-queue", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"analysis-queue {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve", help="run the service (AQ_* settings; database, Core and secrets required)"
    ).set_defaults(fn=_serve)
    sub.add_parser(
        "dev", help="run the service with the embedded database and the Core simulator"
    ).set_defaults(fn=_dev)
    sub.add_parser("migrate", help="apply database migrations").set_defaults(fn=_migrate)
    token = sub.add_parser("token", help="print a user token for local use")
    token.add_argument("user", nargs="?", default="")
    token.add_argument("--admin", action="store_true", help="print the admin token instead")
    token.add_argument(
        "--ttl",
        type=int,
        default=None,
        help="lifetime in seconds: 24 h by default, at most AQ_JWT_MAX_TTL_S (24 h)",
    )
    token.set_defaults(fn=_token)
    grant = sub.add_parser("grant", help="grant a user credits through a running instance")
    grant.add_argument("user")
    grant.add_argument("amount", type=int)
    grant.add_argument("--url", help="the instance; default http://AQ_HOST:AQ_PORT")
    grant.set_defaults(fn=_grant)
    sim = sub.add_parser("core-sim", help="run the Core simulator alone")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8090)
    sim.add_argument("--callback-url", action="append", help="repeatable; default the service")
    sim.add_argument("--judge-time", type=float, default=2.0, help="seconds per run")
    sim.add_argument(
        "--database-url", help="keep the runs in this database (schema core_simulator)"
    )
    sim.set_defaults(fn=_core_sim)
    demo = sub.add_parser("demo", help="replay the write-up: one lecturer, five theses")
    demo.add_argument("--theses", type=int, default=5)
    demo.add_argument("--judge-time", type=float, default=1.0)
    demo.set_defaults(fn=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "token" and not args.admin and not args.user:
        parser.error("token needs a USER (or --admin)")
    if args.command in ("serve", "dev", "core-sim", "demo"):
        _use_uvloop()
        _tune_gc()
    try:
        return int(args.fn(args))
    except ConfigError as exc:
        print(f"analysis-queue {args.command}: cannot run:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
