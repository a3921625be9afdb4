"""A real Prometheus (Debian's ``prometheus``) scrapes two live instances and loads the shipped
rules (deploy/prometheus/rules.yml); its HTTP API then answers with the queue's series: the
queue depth, the jobs running, the release attempts. Skips, saying why, where prometheus is not
installed (.ci/run installs it)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import Harness, fetchval, free_port, wait_for

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is missing (apt-get install prometheus; .ci/run does)"
)


@pytest.fixture
async def prometheus(harness: Harness, tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """Prometheus scraping two instances every second: its URL and the targets."""
    h = harness
    h.sim.judge_time_s = 60.0  # the jobs stay open while Prometheus looks
    instances = [await h.start_instance(metrics_cache_s=0) for _ in range(2)]
    targets = [i.base_url.removeprefix("http://") for i in instances]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n"
        "  - job_name: aq\n"
        f"    static_configs: [{{targets: {targets!r}}}]\n".replace("'", '"')
    )
    port = free_port()
    assert PROMETHEUS is not None
    with open(tmp_path / "prometheus.log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        yield f"http://127.0.0.1:{port}", targets
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)


async def _api(http: aiohttp.ClientSession, url: str, **params: str) -> Any:
    try:
        async with http.get(url, params=params) as r:
            if r.status != 200:
                return None
            body = await r.json()
    except aiohttp.ClientError:
        return None  # not listening yet
    return body["data"] if body.get("status") == "success" else None


async def test_prometheus_scrapes_both_instances_and_reads_the_queue(
    harness: Harness, prometheus: tuple[str, list[str]]
) -> None:
    h = harness
    url, targets = prometheus
    await h.grant("u", 3)
    for n in range(3):
        await h.admit("u", n)

    running = "SELECT count(*) = 1 FROM analysis_jobs WHERE status = 'running'"
    await wait_for(lambda: fetchval(h.database_url, running), what="one running")

    async def both_up() -> bool:
        data = await _api(h.http, f"{url}/api/v1/targets")
        if data is None:
            return False
        up = {t["labels"]["instance"] for t in data["activeTargets"] if t["health"] == "up"}
        return up == set(targets)

    await wait_for(both_up, timeout_s=60, what="Prometheus scraping both instances")

    async def value(query: str) -> float | None:
        data = await _api(h.http, f"{url}/api/v1/query", query=query)
        if not data or not data["result"]:
            return None
        return float(data["result"][0]["value"][1])

    async def reads(query: str, expected: float) -> bool:
        return await value(query) == expected

    # What both instances report, as Prometheus stored it after their latest scrapes.
    for query, expected in [
        ('max(aq_jobs{status="queued"})', 2.0),
        ('max(aq_jobs{status="running"})', 1.0),
        ('sum(aq_release_attempts_total{outcome="released"})', 1.0),
        ("count(aq_listener_up == 1)", 2.0),
        ("max(aq_users_stuck)", 0.0),
        ('sum(aq_http_responses_total{code="201"})', 3.0),
    ]:
        await wait_for(lambda q=query, e=expected: reads(q, e), timeout_s=30, what=query)
    rules = await _api(h.http, f"{url}/api/v1/rules")
    assert rules is not None
    loaded = [r for g in rules["groups"] for r in g["rules"]]
    assert len(loaded) == 9
    assert [r["name"] for r in loaded if r["health"] != "ok"] == []
    firing = [r["name"] for r in loaded if r.get("state") == "firing"]
    assert firing == [], firing
