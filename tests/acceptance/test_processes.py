"""Real service processes: the one-command embedded start, and two instances sharing a database."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from bouncer import ROUTES, Route
from support import assert_fifo_serial, check_invariants, fetch, free_port, thesis_body, wait_for

pytestmark = pytest.mark.acceptance

SECRETS = {
    "AQ_JWT_SECRET": "acceptance-jwt-secret-0123456789abcdef",
    "AQ_ADMIN_TOKEN": "acceptance-admin",
    "AQ_CORE_CALLBACK_SECRET": "acceptance-callback",
}


def _env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AQ_")}
    env.update(values)
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "analysis_queue.cli", *args]


class Proc:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode

    def tail(self) -> str:
        """The end of the log, after every error line (a failed initdb logs its output there,
        long before the traceback the end shows)."""
        text = self.log_path.read_text(errors="replace")
        errors = [line[:2000] for line in text.splitlines() if '"level":"error"' in line]
        return "\n".join([*errors[-5:], text[-3000:]])


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop(signal.SIGKILL)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _ready(
    http: aiohttp.ClientSession, base: str, proc: Proc, timeout_s: float = 60, path: str = "/readyz"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.popen.poll() is None, f"{proc.name} exited:\n{proc.tail()}"
        try:
            async with http.get(f"{base}{path}") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{proc.name} not ready:\n{proc.tail()}")


async def _jobs(http: aiohttp.ClientSession, base: str, token: str) -> list[dict[str, Any]]:
    async with http.get(f"{base}/v1/analyses", headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 200
        return list((await r.json())["analyses"])


async def _admit_three(http: aiohttp.ClientSession, base: str, env: dict[str, str]) -> str:
    """Grant credits with the CLI, as the banner says, and click three times; the user's token."""
    granted = subprocess.run(
        _cli("grant", "lecturer", "3"), env=env, capture_output=True, text=True, timeout=30
    )
    assert granted.returncode == 0, granted.stderr
    token = subprocess.check_output(_cli("token", "lecturer"), env=env, text=True).strip()
    auth = {"Authorization": f"Bearer {token}"}
    statuses = []
    for n in range(3):
        async with http.post(f"{base}/v1/analyses", json=thesis_body(n), headers=auth) as r:
            assert r.status == 201, await r.text()
            statuses.append((await r.json())["status"])
    assert statuses == ["pending", "queued", "queued"]
    return token


async def test_dev_mode_survives_a_restart_and_a_demo_beside_it(
    tmp_path: Path, procs: list[Proc], http: aiohttp.ClientSession
) -> None:
    """What README's first command does (`make run` is `analysis-queue dev`), with nothing set:
    the embedded database, the simulator, generated secrets. Its first lines say where the
    dashboard is and how to sign in; a demo beside it takes none of its jobs; a Ctrl-C and a
    new start finish what was admitted (the simulator's held runs are in the database)."""
    port = free_port()
    # Judging outlasts the demo however slow the machine, so the Ctrl-C below finds jobs held;
    # the second start judges quickly (a restored run's time left follows the new setting).
    env = _env(AQ_DATA_DIR=str(tmp_path / "data"), AQ_PORT=str(port), AQ_SIM_JUDGE_TIME_S="60")
    base = f"http://127.0.0.1:{port}"
    dev = Proc("dev", _cli("dev"), env, tmp_path)
    procs.append(dev)
    await _ready(http, base, dev, timeout_s=90)
    first = dev.tail().splitlines()
    assert first[0].startswith("analysis-queue ") and "development mode" in first[0], first
    assert f"dashboard:  {base}/" in first[1], first
    assert "token lecturer" in first[2] and "grant lecturer" in first[3], first
    token = await _admit_three(http, base, env)

    demo = subprocess.run(
        _cli("demo", "--theses", "3", "--judge-time", "0.2"),
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "one at a time, in the order they were clicked" in demo.stdout, demo.stdout
    assert "failed" not in demo.stdout, demo.stdout

    # Ctrl-C while two of the three wait behind held runs, then start again.
    assert [j["status"] for j in await _jobs(http, base, token)].count("queued") >= 1
    assert dev.stop(signal.SIGINT) == 0, dev.tail()
    again = Proc("dev-again", _cli("dev"), {**env, "AQ_SIM_JUDGE_TIME_S": "1.5"}, tmp_path)
    procs.append(again)
    await _ready(http, base, again, timeout_s=90)

    async def all_succeeded() -> bool:
        return [j["status"] for j in await _jobs(http, base, token)] == ["succeeded"] * 3

    await wait_for(all_succeeded, timeout_s=30, what="the three analyses after the restart")
    assert again.stop(signal.SIGTERM) == 0, again.tail()


@pytest.mark.parametrize("db_route", ROUTES, indirect=True)
async def test_two_processes_share_one_database(
    database_url: str,
    tmp_path: Path,
    procs: list[Proc],
    http: aiohttp.ClientSession,
    db_route: Route,
) -> None:
    """Two ``serve`` processes admit, promote and complete one queue, FIFO per user; directly,
    and with their pools through PgBouncer in transaction mode (their listeners direct)."""
    ports = [free_port(), free_port()]
    sim_port = free_port()
    sim = Proc(
        "core-sim",
        _cli(
            "core-sim",
            "--port",
            str(sim_port),
            "--judge-time",
            "0.05",
            *(a for p in ports for a in ("--callback-url", f"http://127.0.0.1:{p}/v1/core/events")),
        ),
        _env(**SECRETS, AQ_DATA_DIR=str(tmp_path)),
        tmp_path,
    )
    procs.append(sim)
    instances = []
    for i, port in enumerate(ports):
        env = _env(
            **SECRETS,
            **db_route.env(database_url),
            AQ_CORE_URL=f"http://127.0.0.1:{sim_port}",
            AQ_PORT=str(port),
            AQ_DATA_DIR=str(tmp_path),
            AQ_SWEEP_INTERVAL_S="1",
            AQ_INSTANCE_ID=f"proc-{i}",
        )
        proc = Proc(f"serve-{i}", _cli("serve"), env, tmp_path)
        procs.append(proc)
        instances.append((proc, f"http://127.0.0.1:{port}"))
    await _ready(http, f"http://127.0.0.1:{sim_port}", sim, path="/_sim/runs")
    for proc, base in instances:
        await _ready(http, base, proc)
    await db_route.assert_routed(database_url, listeners=2)

    from analysis_queue.http.auth import mint_token

    users = [f"user-{i}" for i in range(5)]
    admin = {"Authorization": f"Bearer {SECRETS['AQ_ADMIN_TOKEN']}"}
    for u in users:
        async with http.post(
            f"{instances[0][1]}/v1/admin/credits", json={"user_id": u, "amount": 6}, headers=admin
        ) as r:
            assert r.status == 200

    async def clicks(user: str) -> None:
        auth = {"Authorization": f"Bearer {mint_token(user, SECRETS['AQ_JWT_SECRET'])}"}
        for n in range(6):
            base = instances[n % 2][1]
            async with http.post(f"{base}/v1/analyses", json=thesis_body(n), headers=auth) as r:
                assert r.status == 201, await r.text()

    await asyncio.gather(*(clicks(u) for u in users))

    async def all_done() -> bool:
        rows = await fetch(database_url, "SELECT status FROM analysis_jobs")
        return len(rows) == 30 and all(r["status"] == "succeeded" for r in rows)

    await wait_for(all_done, timeout_s=60, what="30 analyses across two processes")
    await assert_fifo_serial(database_url)
    await check_invariants(database_url)
    await db_route.assert_routed(database_url, listeners=2)
    for proc, _ in instances:
        assert proc.stop(signal.SIGTERM) == 0, proc.tail()
