"""The dashboard in a real browser (headless Chromium through Playwright): the write-up's
lecturer submits five theses, sees one running and four queued, and watches the next start
when the first finishes; then a failure, a cancel, and the credits that follow. The page must
get all of it from the event stream: it never polls."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from analysis_queue.http.auth import mint_token
from support import JWT_SECRET, Harness, fetchval

CHROMIUM = Path("/usr/bin/chromium")
# This machine blocks outside connections: nothing in the browser may try to reach out.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TIMEOUT_MS = 15_000
SOURCES = ["10.1000/lecture.1", "https://journal.example/articles/2", "10.1000/lecture.3"]

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="the playwright package is not installed (pip install -e .[dev])"
)
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None,
    reason=f"{CHROMIUM} is missing (apt-get install chromium)",
)


async def _finish_in_core(h: Harness, job_id: str, **body: Any) -> None:
    core_run_id = await fetchval(
        h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id = $1::uuid", job_id
    )
    async with h.http.post(f"{h.sim.base_url}/_sim/runs/{core_run_id}/finish", json=body) as r:
        assert r.status == 200, await r.text()


async def _positions(page: Any) -> list[tuple[str, str]]:
    items = page.locator("#queued li")
    return [
        (str(p), str(t))
        for p, t in await items.evaluate_all(
            "els => els.map(e => [e.dataset.position, e.querySelector('.title').textContent])"
        )
    ]


async def test_lecturer_submits_five_theses_and_watches_them_run(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 3600  # a run ends when the test ends it in Core
    inst = await h.start_instance()
    await h.grant("lecturer", 10)
    token = mint_token("lecturer", JWT_SECRET)
    expect = playwright_api.expect
    expect.set_options(timeout=TIMEOUT_MS)
    ARTIFACTS.mkdir(exist_ok=True)

    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = await browser.new_page(viewport={"width": 1000, "height": 1400})
            requests: list[tuple[str, str]] = []
            problems: list[str] = []
            page.on("request", lambda r: requests.append((r.method, r.url)))
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

            # Sign in with a pasted token.
            await page.goto(f"{inst.base_url}/")
            await expect(page.locator("#sign-in")).to_be_visible()
            await page.fill("#token", token)
            await page.click("#sign-in-form button[type=submit]")
            await expect(page.locator("#connection")).to_have_text("live")
            await expect(page.locator("#credit-balance")).to_have_text("10")

            # Five clicks of "start analysis", one after the other.
            titles = [f"Thesis {n}: on queues and fairness" for n in range(1, 6)]
            for n, title in enumerate(titles, start=1):
                await page.fill("#title", title)
                await page.fill("#document-url", f"https://uni.example/theses/{n}.pdf")
                await page.fill("#sources", "\n".join(SOURCES))
                await page.click("#submit-button")
                await expect(page.locator("#title")).to_have_value("")  # admitted: form reset
                await expect(page.locator("#submit-error")).to_have_text("")

            # One running, four queued in admission order with their positions.
            running = page.locator("#running li")
            await expect(running).to_have_count(1)
            await expect(running.locator(".title")).to_have_text(titles[0])
            await expect(running).to_have_attribute("data-status", "running")
            await expect(page.locator("#queued li")).to_have_count(4)
            assert await _positions(page) == [(str(i), titles[i]) for i in range(1, 5)]
            # Each says why it waits.
            queued = page.locator("#queued li")
            waits = await queued.evaluate_all("els => els.map(e => e.dataset.waitingFor)")
            assert waits == ["your_previous_analysis"] * 4
            await expect(queued.first.locator(".detail")).to_contain_text(
                "waits for your previous analysis"
            )
            await expect(page.locator("#credit-balance")).to_have_text("5")
            await page.screenshot(path=str(ARTIFACTS / "dashboard-five-theses.png"), full_page=True)

            # The first finishes in Core: it shows its verdicts, and the next one starts.
            first_id = await running.get_attribute("data-job-id")
            assert first_id is not None
            await _finish_in_core(h, first_id)
            done = page.locator("#finished li[data-status=succeeded]")
            await expect(done).to_have_count(1)
            await expect(done.locator(".title")).to_have_text(titles[0])
            counts = await done.locator(".verdicts strong").all_text_contents()
            assert sum(int(c) for c in counts) == len(SOURCES)
            await expect(running.locator(".title")).to_have_text(titles[1])
            await expect(running).to_have_attribute("data-status", "running")
            await expect(page.locator("#queued li")).to_have_count(3)
            assert await _positions(page) == [(str(i), titles[i + 1]) for i in range(1, 4)]

            # The second fails: the reason is shown and the credit comes back.
            second_id = await running.get_attribute("data-job-id")
            assert second_id is not None
            await _finish_in_core(
                h, second_id, state="failed", error="The document could not be fetched."
            )
            failed = page.locator("#finished li[data-status=failed]")
            await expect(failed).to_have_count(1)
            await expect(failed.locator(".detail")).to_have_text(
                "Failed: The document could not be fetched."
            )
            await expect(running.locator(".title")).to_have_text(titles[2])
            await expect(page.locator("#credit-balance")).to_have_text("6")

            # Cancel the last queued thesis: it leaves the list and the credit comes back.
            await page.locator("#queued li", has_text=titles[4]).get_by_role("button").click()
            await expect(page.locator("#queued li")).to_have_count(1)
            assert await _positions(page) == [("1", titles[3])]
            await expect(page.locator("#credit-balance")).to_have_text("7")
            await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

            # Everything comes from the stream: a thesis admitted elsewhere (another tab, the
            # API) appears without the page making a request; no listing was ever fetched.
            seen = len(requests)
            status, job = await h.admit("lecturer", 6)
            assert status == 201, job
            await expect(page.locator("#queued li")).to_have_count(2)
            assert len(requests) == seen, requests[seen:]
            calls = [(m, url.removeprefix(inst.base_url)) for m, url in requests]
            assert not [c for c in calls if c[0] == "GET" and c[1].startswith("/v1/analyses")]
            streams = [path for _, path in calls if path.startswith("/v1/events")]
            assert len(streams) == 1, streams
            assert problems == []
        finally:
            await browser.close()
