"""Wiring: build the aiohttp application and own the lifecycle of everything it runs.

Start order (``cleanup_ctx``): database (the development server when ``embedded`` is asked for;
waited for up to ``AQ_STARTUP_TIMEOUT_S``; migrations on the direct URL; the pool) -> Core (the
client, or the in-process simulator when ``simulator`` is asked for) -> queue services
(dispatcher, listener, sweep, event hub). Shutdown runs it backwards after aiohttp has stopped
taking requests and waited for in-flight ones; open event streams are woken first
(``on_shutdown``) so that wait is short. If a background loop dies, the instance reports it and
stops instead of limping on; a start that cannot complete raises :class:`StartupError`, which
says why in one line.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from analysis_queue import errors, tracing
from analysis_queue.config import (
    EMBEDDED,
    SIMULATOR,
    Settings,
    dsn_address,
    missing_for_serve,
    safe_dsn,
)
from analysis_queue.core.client import CoreClient
from analysis_queue.dev.core_sim import CoreSimulator
from analysis_queue.dev.embedded import EmbeddedUnavailable, start_embedded
from analysis_queue.dev.sim_runs import PgRunStore
from analysis_queue.http import dashboard, edge, events, openapi, problems
from analysis_queue.http import routes as api
from analysis_queue.http.auth import TokenCache
from analysis_queue.http.edge import Edge, EdgeSettings, EdgeSite
from analysis_queue.http.scrape import DatabaseGauges
from analysis_queue.http.state import SERVICES, Services
from analysis_queue.loops.dispatch import Dispatcher, DispatchSettings
from analysis_queue.loops.hub import EventHub, HubSettings
from analysis_queue.loops.listener import Listener, ListenerSettings
from analysis_queue.loops.promote import Promoter
from analysis_queue.loops.sweep import Sweeper, SweepSettings
from analysis_queue.metrics import Metrics
from analysis_queue.models import ChangeNotice
from analysis_queue.queue.admit import Admitter
from analysis_queue.queue.finish import Finisher
from analysis_queue.queue.followup import FollowUp, Trigger
from analysis_queue.store.database import Claim, Database, Timeouts
from analysis_queue.store.driver import StartupParametersRefused
from analysis_queue.store.migrate import apply_migrations

log = logging.getLogger(__name__)

CLIENT_MAX_SIZE = 1024 * 1024  # request bodies; a thesis is a URL, not the document


STARTUP_RETRY_MAX_S = 2.0  # cap of the backoff between attempts to reach the database


class StartupError(RuntimeError):
    """The instance cannot start; the message says why and what to set."""


@dataclass(frozen=True)
class Dsns:
    """Where the instance connects: the pool (``AQ_DATABASE_URL``, maybe a transaction pooler)
    and the connections that need a session (``AQ_DIRECT_DATABASE_URL``: LISTEN, migrations)."""

    pool: str
    direct: str

    def variable(self, dsn: str) -> str:
        """The setting that names ``dsn``, for messages."""
        return "AQ_DATABASE_URL" if dsn == self.pool else "AQ_DIRECT_DATABASE_URL"


async def resolve_dsns(settings: Settings) -> Dsns:
    if settings.database_url == EMBEDDED:
        try:
            dsn = await asyncio.to_thread(start_embedded, settings.data_dir)
        except EmbeddedUnavailable as exc:
            raise StartupError(str(exc)) from exc
        return Dsns(dsn, dsn)
    if not settings.database_url:
        raise StartupError("AQ_DATABASE_URL is not set")
    return Dsns(settings.database_url, settings.direct_url or settings.database_url)


async def open_database(settings: Settings, dsns: Dsns) -> Database:
    """Migrate (on the direct URL) and open the pool, waiting up to ``startup_timeout_s`` for a
    database that does not answer yet (a container starting beside it, a restart), with each
    attempt logged."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.startup_timeout_s
    delay, attempt = 0.2, 0
    while True:
        attempt += 1
        trying = dsns.direct
        try:
            await apply_migrations(dsns.direct)
            trying = dsns.pool
            return await Database.connect(
                dsns.pool,
                direct_dsn=dsns.direct,
                pooler=settings.database_pooler,
                min_size=settings.pool_min_size,
                max_size=settings.pool_max_size,
                application_name=f"analysis-queue {settings.instance_id}",
                timeouts=Timeouts(
                    acquire_s=settings.db_acquire_timeout_s,
                    statement_s=settings.db_statement_timeout_s,
                ),
            )
        except StartupParametersRefused as exc:
            raise StartupError(
                f"the database at {dsn_address(trying)} ({dsns.variable(trying)}) refused a "
                f"startup parameter ({exc}): it is a connection pooler; set "
                "AQ_DATABASE_POOLER=transaction and AQ_DIRECT_DATABASE_URL (docs/operations.md)"
            ) from exc
        except errors.DatabaseUnavailable as exc:
            cause = f"{type(exc.__cause__).__name__}: {exc.__cause__}" if exc.__cause__ else exc
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StartupError(
                    f"the database at {dsn_address(trying)} ({dsns.variable(trying)}) did not "
                    f"answer within {settings.startup_timeout_s:g} s: {cause}"
                ) from exc
            log.warning(
                "database unreachable; trying again",
                extra={
                    "action": "start",
                    "address": dsn_address(trying),
                    "attempt": attempt,
                    "reason": str(cause),
                },
            )
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, STARTUP_RETRY_MAX_S)


def build_app(
    settings: Settings,
    *,
    on_fatal: Callable[[str], None] | None = None,
) -> web.Application:
    """The service as an aiohttp application. ``on_fatal`` is called if a loop dies. The
    settings must be complete (``config.missing_for_serve``): nothing is generated here."""
    missing = missing_for_serve(settings)
    if missing:
        raise StartupError(f"not set: {', '.join(missing)}")
    app = web.Application(
        middlewares=[
            edge.head_middleware,
            # Traced (tracing.configure before the app is built): a server span per request.
            *([api.tracing_middleware] if tracing.active() else []),
            api.request_id_middleware,
            problems.problem_middleware,
            api.single_headers_middleware,
        ],
        client_max_size=CLIENT_MAX_SIZE,
    )
    app.add_routes(api.routes)
    app.add_routes(events.routes)
    app.add_routes(dashboard.routes)
    app.add_routes(openapi.routes)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        dsns = await resolve_dsns(settings)
        db = await open_database(settings, dsns)
        simulator: CoreSimulator | None = None
        core_url = settings.core_url or ""
        if core_url == SIMULATOR:
            simulator = CoreSimulator(
                callback_urls=[settings.callback_base_url.rstrip("/") + "/v1/core/events"],
                callback_secret=settings.secret("core_callback_secret"),
                judge_time_s=settings.sim_judge_time_s,
                # Beside the jobs that wait for them: a restart keeps both.
                store=PgRunStore(dsns.direct),  # one long session, its statements cached
            )
            core_url = await simulator.start()
        core = CoreClient(core_url, timeout_s=settings.core_timeout_s)
        await core.start()
        services = _make_services(settings, db, core, simulator)
        await _apply_ceiling(services)
        app[SERVICES] = services
        services.migrated = not await db.pending_migrations()
        services.events.start()
        _start_loops(services, on_fatal)
        log.info(
            "service started",
            extra={
                "action": "start",
                "instance": settings.instance_id,
                "mode": settings.mode,
                "database": safe_dsn(dsns.pool),
                "direct_database": safe_dsn(dsns.direct),
                "pooler": settings.database_pooler,
                "core": "the simulator (it invents verdicts)" if simulator else core_url,
            },
        )
        try:
            yield
        finally:
            services.stopping = True
            await services.events.stop()
            if services.listener is not None:
                await services.listener.stop()
            await services.sweeper.stop()
            await services.promoter.stop()
            await services.dispatcher.stop(settings.shutdown_timeout_s)
            await core.close()
            if simulator is not None:
                await simulator.stop()
            await db.close()
            log.info("service stopped", extra={"action": "stop", "instance": settings.instance_id})

    async def end_event_streams(app: web.Application) -> None:
        # on_shutdown runs before aiohttp waits for open requests: wake the event streams so
        # they end now instead of holding shutdown until its timeout.
        services = app.get(SERVICES)
        if services is not None:
            services.events.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(end_event_streams)
    return app


async def start_site(runner: web.AppRunner, host: str, port: int) -> EdgeSite:
    """Listen on host:port through the instance's edge (after ``runner.setup()``)."""
    site = EdgeSite(runner, runner.app[SERVICES].edge, host, port)
    await site.start()
    return site


async def serve(app: web.Application, settings: Settings, on_started: Callable[[], None]) -> None:
    """Run ``app`` on AQ_HOST:AQ_PORT until SIGTERM or SIGINT, then stop it: what
    ``web.run_app`` does, through :func:`start_site` (``run_app`` makes its own sites)."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    stop = asyncio.Event()
    started = False

    def signalled() -> None:
        stop.set()
        if not started and main is not None:
            main.cancel()  # a start still waiting (for the database, say) ends now

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=settings.shutdown_timeout_s)
    try:
        try:
            await runner.setup()
        except asyncio.CancelledError:
            if not stop.is_set() or main is None:
                raise
            main.uncancel()  # ours: a stop asked for during the start, a clean exit
            return
        try:
            await start_site(runner, settings.host, settings.port)
        except asyncio.CancelledError:
            # A stop asked for while the port opened: as clean as one during the setup.
            if not stop.is_set() or main is None:
                raise
            main.uncancel()
        else:
            started = True
            on_started()
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _make_services(
    settings: Settings, db: Database, core: CoreClient, simulator: CoreSimulator | None
) -> Services:
    metrics = Metrics()
    followup = FollowUp(metrics)
    # What a batch of admits or completions, or a promotion, starts is claimed for this
    # instance in the same transaction: it releases them at once, with no claim statement in
    # between.
    claim = Claim(settings.instance_id, settings.claim_lease_s)
    finisher = Finisher(db, core, followup, metrics, claim)
    dispatcher = Dispatcher(
        db,
        core,
        DispatchSettings(
            instance_id=settings.instance_id,
            claim_lease_s=settings.claim_lease_s,
            release_window_s=settings.release_window_s,
            backoff_base_s=settings.release_backoff_base_s,
            backoff_max_s=settings.release_backoff_max_s,
            concurrency=settings.dispatch_concurrency,
        ),
        finisher,
        metrics,
    )
    promoter = Promoter(db, followup, claim=claim)
    followup.bind(releases=dispatcher, passes=promoter)
    sweeper = Sweeper(
        db,
        core,
        dispatcher,
        promoter,
        finisher,
        SweepSettings(
            interval_s=settings.sweep_interval_s,
            running_quiet_s=settings.running_quiet_s,
            reservation_stale_s=settings.reservation_stale_s,
        ),
        metrics,
    )
    hub = EventHub(
        db,
        HubSettings(
            max_streams_per_user=settings.event_streams_per_user,
            max_streams=settings.event_streams_max,
            max_stream_s=settings.event_stream_max_s,
        ),
        metrics,
    )
    listener = None
    if settings.listen_enabled:

        def heard(notice: ChangeNotice, own: bool) -> None:  # jobs changed, through any instance
            if notice.overflow:  # too many users to name: as after a reconnect
                hub.wake_all()
                if not own:
                    sweeper.kick()
                return
            for user_id in notice.users:
                hub.notify(user_id)
            if not own:  # this instance followed up its own decisions where it made them
                for user_id in notice.wakes():
                    promoter.wake(user_id)

        def connected() -> None:  # notifications were lost while the connection was down
            sweeper.kick()
            hub.wake_all()

        listener = Listener(
            db,
            ListenerSettings(ping_interval_s=settings.listener_ping_s),
            metrics,
            on_notice=heard,
            on_connected=connected,
        )
    return Services(
        settings=settings,
        metrics=metrics,
        db=db,
        core=core,
        admitter=Admitter(
            db,
            core,
            followup,
            metrics,
            analysis_cost=settings.analysis_cost,
            recheck_cost=settings.recheck_cost,
            job_max_bytes=settings.job_max_bytes,
            claim=claim,
        ),
        finisher=finisher,
        dispatcher=dispatcher,
        promoter=promoter,
        sweeper=sweeper,
        listener=listener,
        tokens=TokenCache(
            settings.secret("jwt_secret"),
            issuer=settings.jwt_issuer or None,
            audience=settings.jwt_audience or None,
            max_ttl_s=settings.jwt_max_ttl_s,
        ),
        events=hub,
        gauges=DatabaseGauges(db, metrics, settings.metrics_cache_s),
        edge=Edge(EdgeSettings.from_settings(settings), metrics),
        simulator=simulator,
    )


async def _apply_ceiling(services: Services) -> None:
    """Write this instance's AQ_GLOBAL_MAX_RUNNING into the database, which all instances obey,
    then fill what the change freed (a raise, or turning it off)."""
    ceiling = services.settings.global_max_running or None
    await services.db.set_ceiling(ceiling)
    services.promoter.ceiling = ceiling
    log.info("provider ceiling", extra={"action": "ceiling", "global_max_running": ceiling})
    for user_id in await services.db.users_to_promote(10_000):
        await services.promoter.promote((user_id,), Trigger.CEILING)
    await services.promoter.run_pass(Trigger.CEILING)


def _start_loops(services: Services, on_fatal: Callable[[str], None] | None) -> None:
    loops: list[tuple[str, Callable[[], asyncio.Task[None] | None]]] = []
    if services.listener is not None:
        services.listener.start()
        listener = services.listener
        loops.append(("listener", lambda: listener.task))
    services.sweeper.start()
    if services.listener is None:
        services.sweeper.kick()  # the catch-up pass the listener would have asked for
    loops.append(("sweeper", lambda: services.sweeper.task))
    loops.append(("events-resync", lambda: services.events.task))
    if services.settings.sweep_interval_s <= 0 and services.listener is None:
        log.warning("both LISTEN and the sweep are off: queued jobs wait for tail promotions")

    for name, get_task in loops:
        task = get_task()
        if task is None:
            continue

        def died(t: asyncio.Task[None], name: str = name) -> None:
            if services.stopping or t.cancelled():
                return
            exc = t.exception()
            log.critical(
                "background loop died", extra={"action": "fatal", "loop": name}, exc_info=exc
            )
            if on_fatal is not None:
                on_fatal(name)

        task.add_done_callback(died)
