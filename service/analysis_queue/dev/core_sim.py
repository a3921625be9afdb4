"""An honest Core simulator: the real Core HTTP contract, real sockets, injectable faults.

Its runs live in memory, or, given a :class:`RunStore` (development: ``dev/sim_runs.py``), in
a database too, so that a restart finds every run it created: held runs can still be released,
and runs that were judging go on judging for what was left of their time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson
from aiohttp import ClientError, ClientSession, ClientTimeout, web

from analysis_queue.core.client import sign_callback

log = logging.getLogger(__name__)

JUDGE_TIME_S = 2.0
CALLBACK_ROUNDS = 3
CALLBACK_RETRY_S = 0.2
CALLBACK_TIMEOUT_S = 5.0
OFFLINE_DRAIN_S = 1.0
THESIS_TITLE_MAX_CHARS = 500
SOURCES_MAX = 200
DETAIL_SOURCE_MAX_CHARS = 200
THESIS_EXTENSIONS = (".pdf", ".docx", ".odt", ".tex", ".txt", ".md")
VERDICTS = ("supported", "partially_supported", "unsupported", "not_found")
DOI_RE = re.compile(r"(?:doi:|https://doi\.org/)?10\.\d{4,9}/\S+", re.IGNORECASE)
FAILED_RUN_ERROR = "provider_error"


@dataclass
class SimFaults:
    """Faults the simulator injects; all off by default."""

    create_status: int | None = None
    release_status: int | None = None
    drop_callbacks: bool = False
    duplicate_callbacks: bool = False
    fail_runs: bool = False
    budget_runs: int | None = None


@dataclass
class _SimRun:
    id: str
    run_id: str
    user_id: str
    title: str
    document_url: str
    sources: list[str]
    state: str
    created_at: float
    released_at: float | None = None
    finished_at: float | None = None
    verdicts: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None
    callbacks_sent: int = 0

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "verdicts": self.verdicts, "error": self.error}


class RunStore(Protocol):
    """Where the simulator keeps its runs beyond its memory."""

    async def load(self) -> list[dict[str, Any]]: ...

    async def save(self, run: dict[str, Any]) -> None: ...

    async def close(self) -> None: ...


class _BadRequest(Exception):
    """The create body is not JSON or has the wrong shape (400)."""


class _Refusal(Exception):
    """Core refuses the create (422 with a code)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


FAULT_TYPES: dict[str, tuple[type, ...]] = {
    "create_status": (int, type(None)),
    "release_status": (int, type(None)),
    "drop_callbacks": (bool,),
    "duplicate_callbacks": (bool,),
    "fail_runs": (bool,),
    "budget_runs": (int, type(None)),
}


def _faults_problem(body: dict[str, Any]) -> str | None:
    """Why a faults update is unusable, or None; a typo must not silently inject nothing."""
    for name, value in body.items():
        if name == "judge_time_s":
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                return "judge_time_s must be a non-negative number"
            continue
        allowed = FAULT_TYPES.get(name)
        if allowed is None:
            return f"unknown fault {name!r}"
        # bool is an int; a status of True is a typo, not a fault.
        if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
            return f"{name} has the wrong type"
    return None


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def verdict_for(source: str) -> str:
    """The deterministic verdict the simulator gives ``source``."""
    return VERDICTS[hashlib.sha256(source.encode("utf-8")).digest()[0] % len(VERDICTS)]


def _is_http_url(value: str) -> bool:
    if any(ch.isspace() for ch in value):
        return False
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises on a malformed port, which a real fetcher would choke on
    except ValueError:
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)


UNRESOLVABLE_DOI_PREFIX = "10.9999/"


def _is_source(value: str) -> bool:
    return DOI_RE.fullmatch(value) is not None or _is_http_url(value)


def _shown(value: str) -> str:
    return repr(value[:DETAIL_SOURCE_MAX_CHARS])


def _check_thesis(title: str, document_url: str) -> None:
    if not title.strip():
        raise _Refusal("unparseable_thesis", "thesis title is empty")
    if len(title) > THESIS_TITLE_MAX_CHARS:
        raise _Refusal(
            "unparseable_thesis", f"thesis title is longer than {THESIS_TITLE_MAX_CHARS} characters"
        )
    if not _is_http_url(document_url):
        raise _Refusal("unparseable_thesis", "thesis document_url is not an http(s) URL")
    if not urlsplit(document_url).path.lower().endswith(THESIS_EXTENSIONS):
        raise _Refusal(
            "unparseable_thesis",
            "thesis document must be one of " + ", ".join(THESIS_EXTENSIONS),
        )


def _doi_resolves(value: str) -> bool:
    """Core resolves every DOI it is given. The simulator's registry knows every registrant
    except ``10.9999``, which stands for a DOI that does not resolve: a source that is
    well-formed (so the service's edge lets it through) but that Core refuses."""
    match = DOI_RE.fullmatch(value)
    return match is None or UNRESOLVABLE_DOI_PREFIX not in value


def _check_sources(sources: list[str]) -> None:
    if not sources:
        raise _Refusal("invalid_source", "no sources given")
    if len(sources) > SOURCES_MAX:
        raise _Refusal("invalid_source", f"more than {SOURCES_MAX} sources")
    for index, source in enumerate(sources):
        if not _is_source(source):
            raise _Refusal(
                "invalid_source",
                f"source {index} {_shown(source)} is neither a DOI nor an http(s) URL",
            )
        if not _doi_resolves(source):
            raise _Refusal("invalid_source", f"source {index} {_shown(source)} does not resolve")


def _parse_create(raw: bytes) -> dict[str, Any]:
    """Shape check (400) then content check (422), the way a real engine reads a request."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _BadRequest("body is not JSON") from exc
    if not isinstance(body, dict):
        raise _BadRequest("body is not a JSON object")
    run_id, user_id, thesis = body.get("run_id"), body.get("user_id"), body.get("thesis")
    sources, hold = body.get("sources"), body.get("hold")
    if not isinstance(run_id, str) or not run_id:
        raise _BadRequest("run_id must be a non-empty string")
    if not isinstance(user_id, str):
        raise _BadRequest("user_id must be a string")
    if not isinstance(thesis, dict):
        raise _BadRequest("thesis must be an object")
    title, document_url = thesis.get("title"), thesis.get("document_url")
    if not isinstance(title, str) or not isinstance(document_url, str):
        raise _BadRequest("thesis.title and thesis.document_url must be strings")
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise _BadRequest("sources must be a list of strings")
    if not isinstance(hold, bool):
        raise _BadRequest("hold must be a boolean")
    _check_thesis(title, document_url)
    _check_sources(sources)
    return {
        "run_id": run_id,
        "user_id": user_id,
        "title": title,
        "document_url": document_url,
        "sources": sources,
        "hold": hold,
    }


class CoreSimulator:
    """Core's HTTP API over a real socket, with runs in memory (and ``store``) and faults to
    inject."""

    def __init__(
        self,
        *,
        callback_urls: list[str] | None = None,
        callback_secret: str = "",
        judge_time_s: float = JUDGE_TIME_S,
        store: RunStore | None = None,
    ) -> None:
        self.faults = SimFaults()
        self._store = store
        self.judge_time_s = judge_time_s
        self.callback_urls: list[str] = list(callback_urls or [])
        self._callback_secret = callback_secret
        self._runs: dict[str, _SimRun] = {}
        self._core_id_by_run_id: dict[str, str] = {}
        # One entry per run in state "judging": added when judging starts, removed when the run
        # completes, fails or is cancelled. Its size is the number judging now.
        self._judging: dict[str, asyncio.Task[None]] = {}
        self.max_judging = 0  # the most runs judging at once since start
        self._deliveries: set[asyncio.Task[None]] = set()
        self._callback_cursor = 0
        self._host = "127.0.0.1"
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: ClientSession | None = None
        # The W3C trace context of the latest requests that carried one, as (method and path,
        # traceparent): what Core's team would join a trace by.
        self.traceparents: collections.deque[tuple[str, str]] = collections.deque(maxlen=1000)
        self._app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._trace_middleware])
        app.router.add_post("/v1/runs", self._handle_create)
        app.router.add_post("/v1/runs/{id}/release", self._handle_release)
        app.router.add_post("/v1/runs/{id}/cancel", self._handle_cancel)
        app.router.add_get("/v1/runs/{id}", self._handle_get)
        app.router.add_post("/_sim/faults", self._handle_faults)
        app.router.add_get("/_sim/runs", self._handle_runs)
        app.router.add_get("/_sim/stats", self._handle_stats)
        app.router.add_post("/_sim/runs/{id}/finish", self._handle_finish)
        return app

    @web.middleware
    async def _trace_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:
            self.traceparents.append((f"{request.method} {request.path}", traceparent))
        return await handler(request)

    @property
    def app(self) -> web.Application:
        return self._app

    @property
    def base_url(self) -> str:
        if self._port is None:
            raise RuntimeError("CoreSimulator.start() must be awaited first")
        return f"http://{self._host}:{self._port}"

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self._runner is not None:
            return self.base_url
        self._session = ClientSession(timeout=ClientTimeout(total=CALLBACK_TIMEOUT_S))
        if self._store is not None:
            self._restore(await self._store.load())
        self._runner = web.AppRunner(self._app, access_log=None)
        await self._runner.setup()
        self._host = host
        self._port = port
        await self._open_site()
        log.info("core simulator listening", extra={"action": "sim_start", "url": self.base_url})
        return self.base_url

    def _restore(self, runs: list[dict[str, Any]]) -> None:
        """Take back the runs the store kept; a run that was judging goes on for what was left
        of its judging time (none, if that passed while the simulator was down)."""
        now = time.time()
        for values in runs:
            run = _SimRun(**values)
            self._runs[run.id] = run
            self._core_id_by_run_id[run.run_id] = run.id
            if run.state == "judging":
                left = max(0.0, (run.released_at or now) + self.judge_time_s - now)
                self._judging[run.id] = asyncio.create_task(
                    self._judge(run, left), name=f"judge-{run.id}"
                )
        log.info(
            "core simulator restored its runs",
            extra={"action": "sim_start", "runs": len(runs), "judging": len(self._judging)},
        )

    async def _save(self, run: _SimRun) -> None:
        if self._store is None:
            return
        try:
            await self._store.save(asdict(run))
        except Exception as exc:  # development only: go on in memory, say so
            log.warning(
                "core simulator could not keep a run",
                extra={"action": "sim_store", "run_id": run.run_id, "reason": str(exc)},
            )

    async def _open_site(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        self._site = site
        # Port 0 means "any": remember the one we got so go_online can come back on it.
        self._port = int(self._runner.addresses[0][1])

    async def quiesce(self) -> None:
        """Stop judging and calling back; the runs stay as they are and Core still answers.
        A harness does this first when it tears down, so that no callback is connecting to a
        service instance while that instance stops."""
        tasks = [*self._judging.values(), *self._deliveries]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._judging.clear()
        self._deliveries.clear()

    async def stop(self) -> None:
        await self.quiesce()
        runner, self._runner, self._site = self._runner, None, None
        if runner is not None:
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        if self._store is not None:
            await self._store.close()

    async def go_offline(self) -> None:
        """Refuse connections (listening socket closed, live ones dropped); keep all state."""
        site, self._site = self._site, None
        if site is None or self._runner is None:
            return
        await site.stop()
        # Pooled keep-alive connections would otherwise still reach us.
        server = self._runner.server
        if server is not None:
            server.pre_shutdown()  # wakes idle connections so shutdown need not wait them out
            await server.shutdown(OFFLINE_DRAIN_S)
        log.info("core simulator offline", extra={"action": "sim_offline", "port": self._port})

    async def go_online(self) -> None:
        if self._site is not None or self._runner is None:
            return
        await self._open_site()
        log.info("core simulator online", extra={"action": "sim_online", "port": self._port})

    def runs_snapshot(self) -> list[dict[str, Any]]:
        return [asdict(run) for run in self._runs.values()]

    @property
    def judging(self) -> int:
        """Runs judging now."""
        return len(self._judging)

    def stats(self) -> dict[str, int]:
        """What the provider saw: runs judging now and the most judging at once since start."""
        return {"judging": self.judging, "max_judging": self.max_judging}

    # --- Core API --------------------------------------------------------------------------

    async def _handle_create(self, request: web.Request) -> web.Response:
        if self.faults.create_status is not None:
            status = self.faults.create_status
            code = "provider_budget_exhausted" if status == 429 else "simulated_fault"
            return _json({"code": code, "detail": "injected fault"}, status)
        try:
            spec = _parse_create(await request.read())
        except _BadRequest as exc:
            return _json({"code": "bad_request", "detail": str(exc)}, 400)
        except _Refusal as exc:
            return _json({"code": exc.code, "detail": exc.detail}, 422)
        existing = self._core_id_by_run_id.get(spec["run_id"])
        if existing is not None:
            run = self._runs[existing]
            return _json({"id": run.id, "state": run.state}, 200)
        budget = self.faults.budget_runs
        if budget is not None and len(self._runs) >= budget:
            return _json({"code": "provider_budget_exhausted"}, 429)
        run = _SimRun(
            id="core-" + uuid.uuid4().hex,
            run_id=spec["run_id"],
            user_id=spec["user_id"],
            title=spec["title"],
            document_url=spec["document_url"],
            sources=spec["sources"],
            state="held",
            created_at=time.time(),
        )
        self._runs[run.id] = run
        self._core_id_by_run_id[run.run_id] = run.id
        if not spec["hold"]:
            self._start_judging(run)
        await self._save(run)
        return _json({"id": run.id, "state": run.state}, 201)

    def _lookup(self, request: web.Request) -> _SimRun | None:
        return self._runs.get(request.match_info["id"])

    async def _handle_release(self, request: web.Request) -> web.Response:
        if self.faults.release_status is not None:
            return _json({"code": "simulated_fault"}, self.faults.release_status)
        run = self._lookup(request)
        if run is None:
            return _json({"code": "not_found"}, 404)
        if run.state == "held":
            self._start_judging(run)
            await self._save(run)
        elif run.state != "judging":
            return _json({"code": "run_not_held", "state": run.state}, 409)
        return _json({"state": run.state})

    async def _handle_cancel(self, request: web.Request) -> web.Response:
        run = self._lookup(request)
        if run is None:
            return _json({"code": "not_found"}, 404)
        if run.state in ("held", "judging"):
            task = self._judging.pop(run.id, None)
            if task is not None:
                task.cancel()
            run.state = "cancelled"
            run.finished_at = time.time()
            await self._save(run)
        return _json({"state": run.state})

    async def _handle_get(self, request: web.Request) -> web.Response:
        run = self._lookup(request)
        if run is None:
            return _json({"code": "not_found"}, 404)
        return _json(run.view())

    # --- control API -----------------------------------------------------------------------

    async def _handle_faults(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            return _json({"code": "bad_request", "detail": "body is not JSON"}, 400)
        if not isinstance(body, dict):
            return _json({"code": "bad_request", "detail": "body is not a JSON object"}, 400)
        problem = _faults_problem(body)
        if problem is not None:
            return _json({"code": "bad_request", "detail": problem}, 400)
        for name in FAULT_TYPES.keys() & body.keys():
            setattr(self.faults, name, body[name])
        if "judge_time_s" in body:
            self.judge_time_s = float(body["judge_time_s"])
        return _json({**asdict(self.faults), "judge_time_s": self.judge_time_s})

    async def _handle_runs(self, request: web.Request) -> web.Response:
        return _json(self.runs_snapshot())

    async def _handle_stats(self, request: web.Request) -> web.Response:
        return _json(self.stats())

    async def _handle_finish(self, request: web.Request) -> web.Response:
        run = self._lookup(request)
        if run is None:
            return _json({"code": "not_found"}, 404)
        if run.state != "judging":
            return _json({"code": "run_not_judging", "state": run.state}, 409)
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            return _json({"code": "bad_request", "detail": "body is not JSON"}, 400)
        state = body.get("state", "completed") if isinstance(body, dict) else None
        if state not in ("completed", "failed"):
            return _json({"code": "bad_request", "detail": "state: completed or failed"}, 400)
        error = body.get("error") if isinstance(body, dict) else None
        task = self._judging.pop(run.id, None)
        if task is not None:
            task.cancel()
        await self._finish(run, state, str(error) if error is not None else FAILED_RUN_ERROR)
        return _json(run.view())

    # --- judging and callbacks -------------------------------------------------------------

    def _start_judging(self, run: _SimRun) -> None:
        run.state = "judging"
        run.released_at = time.time()
        self._judging[run.id] = asyncio.create_task(
            self._judge(run, self.judge_time_s), name=f"judge-{run.id}"
        )
        self.max_judging = max(self.max_judging, len(self._judging))

    async def _judge(self, run: _SimRun, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._judging.pop(run.id, None)
        state = "failed" if self.faults.fail_runs else "completed"
        await self._finish(run, state, FAILED_RUN_ERROR)

    async def _finish(self, run: _SimRun, state: str, error: str) -> None:
        run.state = state
        run.finished_at = time.time()
        if state == "completed":
            run.verdicts = [{"source": s, "verdict": verdict_for(s)} for s in run.sources]
            run.error = None
        else:
            run.error = error
        log.info(
            "core run ended",
            extra={"action": "sim_run_end", "run_id": run.run_id, "status": state},
        )
        await self._save(run)
        if self.faults.drop_callbacks:
            return
        copies = 2 if self.faults.duplicate_callbacks else 1
        task = asyncio.create_task(self._deliver(run, copies), name=f"callback-{run.id}")
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, run: _SimRun, copies: int) -> None:
        body = orjson.dumps(run.view())
        for _ in range(copies):
            if await self._deliver_once(body):
                run.callbacks_sent += 1
            else:
                log.warning(
                    "core callback gave up",
                    extra={"action": "sim_callback", "run_id": run.run_id, "status": "undelivered"},
                )

    async def _deliver_once(self, body: bytes) -> bool:
        for round_no in range(CALLBACK_ROUNDS):
            if round_no:
                await asyncio.sleep(CALLBACK_RETRY_S)
            urls = list(self.callback_urls)
            if not urls:
                continue
            # Rotate the first URL tried so several service instances share the load.
            start = self._callback_cursor % len(urls)
            self._callback_cursor += 1
            for url in urls[start:] + urls[:start]:
                if await self._post_callback(url, body):
                    return True
        return False

    async def _post_callback(self, url: str, body: bytes) -> bool:
        if self._session is None:
            return False
        timestamp = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "X-Core-Timestamp": str(timestamp),
            "X-Core-Signature": sign_callback(self._callback_secret, timestamp, body),
        }
        try:
            async with self._session.post(url, data=body, headers=headers) as response:
                await response.read()
                ok = 200 <= response.status < 300
                status: int | str = response.status
        except (ClientError, TimeoutError) as exc:
            ok, status = False, type(exc).__name__
        if not ok:
            log.info(
                "core callback refused",
                extra={"action": "sim_callback", "url": url, "status": status},
            )
        return ok


async def _serve(
    host: str,
    port: int,
    callback_urls: list[str],
    callback_secret: str,
    judge_time_s: float,
    store: RunStore | None,
) -> None:
    sim = CoreSimulator(
        callback_urls=callback_urls,
        callback_secret=callback_secret,
        judge_time_s=judge_time_s,
        store=store,
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        print(await sim.start(host, port), flush=True)
        await stopping.wait()
    finally:
        await sim.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signum)


def run_standalone(
    host: str,
    port: int,
    callback_urls: list[str],
    callback_secret: str,
    judge_time_s: float,
    store: RunStore | None = None,
) -> None:
    """Serve the simulator until SIGINT or SIGTERM."""
    asyncio.run(_serve(host, port, callback_urls, callback_secret, judge_time_s, store))
