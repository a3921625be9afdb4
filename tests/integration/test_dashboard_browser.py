"""The dashboard in a real browser (headless Chromium through Playwright): the write-up's
lecturer submits five theses, sees one running and four queued, and watches the next start
when the first finishes; then a failure, a cancel, and the credits that follow; the cancelled
one stays listed in any browser. They remove a finished analysis, open one to each source's
verdict, start a delta re-check from it, are told in words what is wrong with a form, and do
all of it on a phone too. The page must get every change from
the event stream: it never polls."""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from analysis_queue.dev.core_sim import verdict_for
from analysis_queue.http.auth import mint_token
from support import JWT_SECRET, Harness, fetchval, thesis_body

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
DESKTOP = {"width": 1280, "height": 1000}
PHONE = {"width": 375, "height": 800}
SOURCES = ["10.1000/lecture.1", "https://journal.example/articles/2", "10.1000/lecture.3"]
LABELS = {
    "supported": "supported",
    "partially_supported": "partially supported",
    "unsupported": "unsupported",
    "not_found": "not found",
}

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="the playwright package is not installed (pip install -e .[dev])"
)
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None,
    reason=f"{CHROMIUM} is missing (apt-get install chromium)",
)
expect = playwright_api.expect


@dataclass
class Watched:
    """What a page asked for and what went wrong in it."""

    page: Any
    requests: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # failed loads and HTTP errors
    problems: list[str] = field(default_factory=list)  # script errors

    def calls(self, base_url: str) -> list[tuple[str, str]]:
        return [(m, url.removeprefix(base_url)) for m, url in self.requests]


@asynccontextmanager
async def _chromium() -> AsyncIterator[Any]:
    expect.set_options(timeout=TIMEOUT_MS)
    ARTIFACTS.mkdir(exist_ok=True)
    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            await browser.close()


async def _page(browser: Any, viewport: dict[str, int]) -> Watched:
    page = await browser.new_page(viewport=viewport)
    watched = Watched(page)
    page.on("request", lambda r: watched.requests.append((r.method, r.url)))
    page.on("requestfailed", lambda r: watched.failed.append(f"{r.url}: {r.failure}"))
    page.on(
        "response",
        lambda r: watched.failed.append(f"{r.url}: HTTP {r.status}") if r.status >= 400 else None,
    )
    page.on("pageerror", lambda e: watched.problems.append(f"page error: {e}"))
    return watched


async def _sign_in(page: Any, base_url: str, token: str) -> None:
    await page.goto(f"{base_url}/")
    await expect(page.locator("#sign-in")).to_be_visible()
    await page.fill("#token", token)
    await page.click("#sign-in-form button[type=submit]")
    await expect(page.locator("#connection")).to_have_text("live")


async def _submit(page: Any, title: str, n: int, sources: list[str] | None = None) -> None:
    await page.fill("#title", title)
    await page.fill("#document-url", f"https://uni.example/theses/{n}.pdf")
    if sources is not None:
        await page.fill("#sources", "\n".join(sources))
    await page.click("#submit-button")
    await expect(page.locator("#title")).to_have_value("")  # admitted: title and document clear
    await expect(page.locator("#submit-error")).to_have_text("")


async def _finish_in_core(h: Harness, job_id: str, **body: Any) -> None:
    core_run_id = await fetchval(
        h.database_url, "SELECT core_run_id FROM analysis_jobs WHERE id = $1::uuid", job_id
    )
    async with h.http.post(f"{h.sim.base_url}/_sim/runs/{core_run_id}/finish", json=body) as r:
        assert r.status == 200, await r.text()


async def _positions(page: Any) -> list[tuple[str, str]]:
    items = page.locator("#queued > li")
    return [
        (str(p), str(t))
        for p, t in await items.evaluate_all(
            "els => els.map(e => [e.dataset.position, e.querySelector('.title').textContent])"
        )
    ]


async def _results(item: Any) -> list[tuple[str, str, str]]:
    """Each row of an opened job's results: (source, verdict as written, its mark)."""
    rows = item.locator(":scope > .job-body > .panel table.results tbody tr")
    return [
        (str(s), str(v).strip(), str(m))
        for s, v, m in await rows.evaluate_all(
            "rows => rows.map(r => [r.querySelector('.source').textContent,"
            " r.querySelector('.verdict').textContent.replace(r.querySelector('.mark')"
            ".textContent, ''), r.querySelector('.mark').textContent])"
        )
    ]


def _expected(sources: list[str]) -> list[tuple[str, str]]:
    return [(s, LABELS[verdict_for(s)]) for s in sources]


async def test_lecturer_submits_five_theses_and_watches_them_run(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 3600  # a run ends when the test ends it in Core
    inst = await h.start_instance()
    await h.grant("lecturer", 10)
    token = mint_token("lecturer", JWT_SECRET)

    async with _chromium() as browser:
        watched = await _page(browser, {"width": 1000, "height": 1400})
        page = watched.page

        # Sign in with a pasted token: the header says who, and how many credits.
        await _sign_in(page, inst.base_url, token)
        await expect(page.locator("#user")).to_have_text("Signed in as lecturer")
        await expect(page.locator("#credits")).to_have_text(re.compile(r"^10\s+credits left$"))
        await expect(page.locator("#batch")).to_have_text("Nothing started yet.")

        # Five clicks of "start analysis", one after the other. The sources, typed once, stay.
        titles = [f"Thesis {n}: on queues and fairness" for n in range(1, 6)]
        for n, title in enumerate(titles, start=1):
            await _submit(page, title, n, SOURCES if n == 1 else None)
            await expect(page.locator("#document-url")).to_have_value("")
            await expect(page.locator("#sources")).to_have_value("\n".join(SOURCES))
            await expect(page.locator("#submit-note")).to_contain_text(f"Started “{title}”")

        # One running, four queued in admission order with their positions.
        running = page.locator("#running > li")
        await expect(running).to_have_count(1)
        await expect(running.locator(".title")).to_have_text(titles[0])
        await expect(running).to_have_attribute("data-status", "running")
        await expect(page.locator("#queued > li")).to_have_count(4)
        assert await _positions(page) == [(str(i), titles[i]) for i in range(1, 5)]
        await expect(page.locator("#batch")).to_have_text("1 running · 4 queued · 0 done")
        # Each says why it waits.
        queued = page.locator("#queued > li")
        waits = await queued.evaluate_all("els => els.map(e => e.dataset.waitingFor)")
        assert waits == ["your_previous_analysis"] * 4
        await expect(queued.first.locator(".detail")).to_contain_text(
            "waits for your previous analysis"
        )
        await expect(page.locator("#credit-balance")).to_have_text("5")
        await page.screenshot(path=str(ARTIFACTS / "dashboard-five-theses.png"), full_page=True)

        # The first finishes in Core: it shows its verdicts, and the next one starts; a
        # screen reader hears both.
        first_id = await running.get_attribute("data-job-id")
        assert first_id is not None
        await _finish_in_core(h, first_id)
        done = page.locator("#finished > li[data-status=succeeded]")
        await expect(done).to_have_count(1)
        await expect(done.locator(".title")).to_have_text(titles[0])
        counts = await done.locator(".verdicts strong").all_text_contents()
        assert sum(int(c) for c in counts) == len(SOURCES)
        await expect(running.locator(".title")).to_have_text(titles[1])
        await expect(running).to_have_attribute("data-status", "running")
        await expect(page.locator("#queued > li")).to_have_count(3)
        assert await _positions(page) == [(str(i), titles[i + 1]) for i in range(1, 4)]
        await expect(page.locator("#announcer")).to_contain_text(f"“{titles[0]}” finished: ")
        await expect(page.locator("#announcer")).to_contain_text(f"“{titles[1]}” started.")
        await expect(page.locator("#batch")).to_have_text("1 running · 3 queued · 1 done")

        # The second fails: the reason is shown in words and the credit comes back.
        second_id = await running.get_attribute("data-job-id")
        assert second_id is not None
        await _finish_in_core(
            h, second_id, state="failed", error="The document could not be fetched."
        )
        failed = page.locator("#finished > li[data-status=failed]")
        await expect(failed).to_have_count(1)
        await expect(failed.locator(".detail")).to_have_text(
            "Failed: The document could not be fetched."
        )
        await expect(running.locator(".title")).to_have_text(titles[2])
        await expect(page.locator("#credit-balance")).to_have_text("6")

        # Cancel the last queued thesis: it leaves the queue, stays in the list as cancelled,
        # and the credit comes back. A cancel is a POST .../cancel, never a DELETE.
        await page.locator("#queued > li", has_text=titles[4]).get_by_role("button").click()
        await expect(page.locator("#queued > li")).to_have_count(1)
        assert await _positions(page) == [("1", titles[3])]
        await expect(page.locator("#credit-balance")).to_have_text("7")
        cancelled = page.locator("#finished > li[data-status=cancelled]")
        await expect(cancelled.locator(".title")).to_have_text(titles[4])
        await expect(cancelled.locator(".detail")).to_contain_text("Cancelled by you at ")
        await expect(cancelled.locator(".badge")).to_have_text("cancelled")
        await expect(page.locator("#announcer")).to_contain_text(f"“{titles[4]}” was cancelled.")
        await expect(page.locator("#batch")).to_have_text(
            "1 running · 1 queued · 3 done (1 failed, 1 cancelled)"
        )
        await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

        # Everything comes from the stream: a thesis admitted elsewhere (another tab, the
        # API) appears without the page making a request; no listing was ever fetched.
        seen = len(watched.requests)
        status, job = await h.admit("lecturer", 6)
        assert status == 201, job
        await expect(page.locator("#queued > li")).to_have_count(2)
        assert len(watched.requests) == seen, watched.requests[seen:]
        calls = watched.calls(inst.base_url)
        assert not [c for c in calls if c[0] == "GET" and c[1].startswith("/v1/analyses")]
        streams = [path for _, path in calls if path.startswith("/v1/events")]
        assert len(streams) == 1, streams
        # The icon is the page's own: nothing failed to load, /favicon.ico was never asked for.
        assert ("GET", "/static/favicon.svg") in calls
        async with h.http.get(f"{inst.base_url}/static/favicon.svg") as icon:
            assert icon.status == 200 and icon.content_type == "image/svg+xml"
            assert "default-src 'none'" in icon.headers["Content-Security-Policy"]
        assert watched.failed == []
        assert watched.problems == []

        cancel_id = await cancelled.get_attribute("data-job-id")
        cancels = [c for c in calls if c[0] in ("POST", "DELETE") and c[1] != "/v1/analyses"]
        assert cancels == [("POST", f"/v1/analyses/{cancel_id}/cancel")], cancels
        # The page keeps nothing of its own about jobs: the service lists the cancelled one.
        stored = await page.evaluate("() => Object.keys(sessionStorage)")
        assert stored == ["analysis-queue.token"], stored

        # A reload keeps the session, and the cancelled thesis still shows as cancelled.
        await page.reload()
        await expect(page.locator("#connection")).to_have_text("live")
        await expect(page.locator("#finished > li")).to_have_count(3)
        await expect(cancelled.locator(".title")).to_have_text(titles[4])
        await expect(page.locator("#user-name")).to_have_text("lecturer")
        # Leaving the page ends its stream (the browser aborts it): that is no failure, and
        # whether Playwright reports it as one depends on its version (1.45 does not).
        aborted = [f for f in watched.failed if "/v1/events?" in f and f.endswith("ERR_ABORTED")]
        assert len(aborted) <= 1 and watched.failed == aborted, watched.failed
        assert watched.problems == []

        # So does another browser that never saw the cancel (a context of its own: no
        # sessionStorage, no cache), signed in afresh.
        elsewhere = await _page(browser, DESKTOP)
        other = elsewhere.page
        await _sign_in(other, inst.base_url, token)
        await expect(other.locator("#finished > li")).to_have_count(3)
        moved = other.locator("#finished > li[data-status=cancelled]")
        await expect(moved.locator(".title")).to_have_text(titles[4])
        await expect(moved.locator(".detail")).to_contain_text("Cancelled by you at ")
        await expect(other.locator("#batch")).to_contain_text("(1 failed, 1 cancelled)")
        assert elsewhere.failed == [] and elsewhere.problems == []
        await other.context.close()


async def test_a_finished_job_is_removed_from_the_list_on_request(harness: Harness) -> None:
    """A "Remove" is for finished jobs only, asks first, and is a DELETE: the job leaves this
    page, and every other, for good."""
    h = harness
    h.sim.judge_time_s = 3600
    inst = await h.start_instance()
    await h.grant("lecturer", 10)
    token = mint_token("lecturer", JWT_SECRET)

    async with _chromium() as browser:
        watched = await _page(browser, DESKTOP)
        page = watched.page
        await _sign_in(page, inst.base_url, token)
        titles = ["Thesis R1: kept", "Thesis R2: removed", "Thesis R3: open"]
        for n, title in enumerate(titles, start=1):
            await _submit(page, title, n, SOURCES if n == 1 else None)
        running = page.locator("#running > li")
        await expect(running.locator(".title")).to_have_text(titles[0])
        kept_id = await running.get_attribute("data-job-id")
        assert kept_id is not None
        await _finish_in_core(h, kept_id)
        await expect(running.locator(".title")).to_have_text(titles[1])
        removed_id = await running.get_attribute("data-job-id")
        assert removed_id is not None
        await _finish_in_core(h, removed_id)
        done = page.locator("#finished > li[data-status=succeeded]")
        await expect(done).to_have_count(2)
        await expect(page.locator("#credit-balance")).to_have_text("7")

        # Open jobs cannot be removed, only cancelled.
        await expect(running.get_by_role("button", name=re.compile("^Remove"))).to_have_count(0)
        removed = page.locator(f"#finished > li[data-job-id='{removed_id}']")
        remove = removed.get_by_role("button", name=f"Remove “{titles[1]}” from the list")
        await expect(remove).to_be_visible()

        # It asks first; said no to, nothing happens.
        asked: list[str] = []

        async def answer(dialog: Any, accept: bool) -> None:
            asked.append(dialog.message)
            await (dialog.accept() if accept else dialog.dismiss())

        page.once("dialog", lambda d: answer(d, False))
        await remove.click()
        await expect(removed).to_have_count(1)
        assert len(asked) == 1 and f"“{titles[1]}”" in asked[0], asked
        assert not [c for c in watched.calls(inst.base_url) if c[0] == "DELETE"]

        # Said yes to: a DELETE, and the job leaves the list; the keyboard stays in Finished.
        page.once("dialog", lambda d: answer(d, True))
        await remove.click()
        await expect(removed).to_have_count(0)
        await expect(done).to_have_count(1)
        await expect(done.locator(".title")).to_have_text(titles[0])
        await expect(page.locator("#finished-count")).to_have_text("1")
        await expect(page.locator("#announcer")).to_contain_text(f"“{titles[1]}” was removed.")
        await expect(page.locator("#finished-title")).to_be_focused()
        deletes = [c for c in watched.calls(inst.base_url) if c[0] == "DELETE"]
        assert deletes == [("DELETE", f"/v1/analyses/{removed_id}")], deletes
        deleted_at = await fetchval(
            h.database_url, "SELECT deleted_at FROM analysis_jobs WHERE id = $1::uuid", removed_id
        )
        assert deleted_at is not None
        await expect(page.locator("#credit-balance")).to_have_text("7")  # nothing refunded
        await expect(running.locator(".title")).to_have_text(titles[2])

        # Gone for another browser too.
        elsewhere = await _page(browser, DESKTOP)
        await _sign_in(elsewhere.page, inst.base_url, token)
        await expect(elsewhere.page.locator("#running > li .title")).to_have_text(titles[2])
        others = elsewhere.page.locator("#finished > li")
        await expect(others).to_have_count(1)
        await expect(others.locator(".title")).to_have_text(titles[0])
        assert elsewhere.failed == [] and elsewhere.problems == []
        await elsewhere.page.context.close()
        assert watched.failed == []
        assert watched.problems == []


async def test_results_per_citation_and_a_recheck_started_from_the_page(harness: Harness) -> None:
    """With the provider ceiling full, the re-check waits beside its original, never in the
    queue's positions, and starts before the lecturer's next thesis."""
    h = harness
    h.sim.judge_time_s = 3600
    inst = await h.start_instance(global_max_running=1)
    await h.grant("lecturer", 10)
    await h.grant("other", 10)
    token = mint_token("lecturer", JWT_SECRET)

    async with _chromium() as browser:
        watched = await _page(browser, DESKTOP)
        page = watched.page
        await _sign_in(page, inst.base_url, token)
        await _submit(page, "Thesis A: citations", 1, SOURCES)
        running = page.locator("#running > li")
        await expect(running).to_have_attribute("data-status", "running")
        original_id = await running.get_attribute("data-job-id")
        assert original_id is not None
        await _finish_in_core(h, original_id)
        original = page.locator(f"#finished > li[data-job-id='{original_id}']")
        await expect(original).to_have_attribute("data-status", "succeeded")

        # Another user takes the only slot; the lecturer's next thesis waits for capacity.
        status, other = await h.admit("other", 1)
        assert status == 201, other
        await _submit(page, "Thesis B: next", 2)
        await expect(page.locator("#queued > li")).to_have_count(1)
        await expect(page.locator("#queued > li")).to_have_attribute(
            "data-waiting-for", "provider_capacity"
        )

        # Open the results from the keyboard: each source with its verdict, in words and a
        # mark of its own shape.
        toggle = original.locator(":scope > .job-name .title")
        await expect(toggle).to_have_attribute("aria-expanded", "false")
        await toggle.focus()
        await page.keyboard.press("Enter")
        await expect(toggle).to_have_attribute("aria-expanded", "true")
        panel = original.locator(":scope > .job-body > .panel")
        await expect(panel.locator("tbody tr")).to_have_count(len(SOURCES))
        rows = await _results(original)
        assert [(s, v) for s, v, _ in rows] == _expected(SOURCES)
        marks = {v: m for _, v, m in rows}
        assert len(set(marks.values())) == len(marks), marks  # one shape per verdict
        await expect(panel.locator("caption")).to_have_text("Verdict for each of the 3 sources")
        # Closed and opened again, it is not fetched twice.
        await toggle.click()
        await expect(panel).to_be_hidden()
        await toggle.click()
        await expect(panel.locator("tbody tr")).to_have_count(len(SOURCES))
        fetched = [c for c in watched.calls(inst.base_url) if c[1] == f"/v1/analyses/{original_id}"]
        assert fetched == [("GET", f"/v1/analyses/{original_id}")]

        # Re-check: the form starts with the sources that did not hold; the lecturer corrects
        # the list and starts it.
        doubtful = [s for s in SOURCES if verdict_for(s) != "supported"]
        await original.locator(":scope > .job-actions .recheck").click()
        form = original.locator(".recheck-form")
        box = form.locator("textarea")
        await expect(box).to_have_value("\n".join(doubtful))
        await expect(box).to_be_focused()
        await expect(form.locator(".hint")).to_contain_text("use all 3")
        # A line that is no source is named by its number, beside the list.
        await box.fill("10.1000/lecture.3-corrected\nlecture 4, p. 12")
        await form.get_by_role("button", name="Start re-check").click()
        await expect(form.locator(".field-error")).to_have_text(
            "Line 2 (“lecture 4, p. 12”) is neither a DOI (10.NNNN/…) nor a web address "
            "starting with http:// or https://."
        )
        await expect(box).to_have_attribute("aria-invalid", "true")
        corrected = ["10.1000/lecture.3-corrected", "https://journal.example/articles/4"]
        await box.fill("\n".join(corrected))
        await form.get_by_role("button", name="Start re-check").click()
        await expect(form).to_have_count(0)
        recheck = original.locator(":scope > .job-body > .rechecks > li")
        await expect(recheck).to_have_count(1)
        await expect(recheck).to_have_attribute("data-recheck-of", original_id)
        # Under its original it is named for what it checks, not by the thesis again.
        await expect(recheck.locator(".title")).to_have_text("Re-check of 2 sources")
        await expect(recheck.locator(".meta")).to_contain_text("submitted ")
        # It waits for capacity too, but it is no part of the queue: no position, no number.
        await expect(recheck).to_have_attribute("data-status", "queued")
        assert await recheck.get_attribute("data-position") is None
        await expect(recheck.locator(".badge")).to_have_text("waiting")
        await expect(page.locator("#queued > li")).to_have_count(1)
        assert await _positions(page) == [("1", "Thesis B: next")]
        await expect(page.locator("#finished > li")).to_have_count(1)  # it stands under A
        await expect(page.locator("#batch")).to_have_text(
            "0 running · 1 queued · 0 done · 1 re-check open"  # B began after A ended
        )
        await page.screenshot(path=str(ARTIFACTS / "dashboard-recheck-waiting.png"), full_page=True)

        # The slot frees: the re-check goes before the lecturer's next thesis, then finishes.
        await _finish_in_core(h, other["id"])
        await expect(recheck).to_have_attribute("data-status", "running")
        await expect(page.locator("#queued > li")).to_have_count(1)
        recheck_id = await recheck.get_attribute("data-job-id")
        assert recheck_id is not None
        await _finish_in_core(h, recheck_id)
        await expect(recheck).to_have_attribute("data-status", "succeeded")
        await expect(page.locator("#announcer")).to_contain_text(
            "Re-check of “Thesis A: citations” finished: "
        )
        await recheck.locator(".title").click()
        await expect(recheck.locator(".panel tbody tr")).to_have_count(len(corrected))
        assert [(s, v) for s, v, _ in await _results(recheck)] == _expected(corrected)
        await expect(running).to_have_attribute("data-status", "running")
        await expect(running.locator(".title")).to_have_text("Thesis B: next")
        await page.screenshot(path=str(ARTIFACTS / "dashboard-desktop.png"), full_page=True)
        assert [f for f in watched.failed if not f.endswith("/rechecks: HTTP 422")] == []
        assert watched.problems == []


async def test_form_problems_are_told_in_words_beside_their_field(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 3600
    inst = await h.start_instance(job_max_bytes=1024)
    await h.grant("lecturer", 1)
    token = mint_token("lecturer", JWT_SECRET)

    async with _chromium() as browser:
        watched = await _page(browser, DESKTOP)
        page = watched.page
        await _sign_in(page, inst.base_url, token)
        await expect(page.locator("#credits")).to_have_text(re.compile(r"^1\s+credit left$"))

        # The keyboard walks the form in the order it reads.
        await page.focus("#title")
        order = []
        for _ in range(4):
            await page.keyboard.press("Tab")
            order.append(await page.evaluate("document.activeElement.id"))
        assert order == ["document-url", "sources", "submit-button", "clear-sources"]

        # Three mistakes at once: each is said beside its field, in words, and the first field
        # with one takes the focus.
        await page.fill("#title", "   ")
        await page.fill("#document-url", "uni.example/thesis.pdf")
        await page.fill("#sources", "10.1000/fine.1\n\nnot a source")
        await page.click("#submit-button")
        await expect(page.locator("#title-error")).to_have_text("Give the thesis a title.")
        await expect(page.locator("#document-url-error")).to_have_text(
            "The document URL is not a web address starting with http:// or https://."
        )
        await expect(page.locator("#sources-error")).to_have_text(
            "Line 3 (“not a source”) is neither a DOI (10.NNNN/…) nor a web address starting "
            "with http:// or https://."
        )
        for field_id in ("title", "document-url", "sources"):
            await expect(page.locator(f"#{field_id}")).to_have_attribute("aria-invalid", "true")
        await expect(page.locator("#title")).to_be_focused()
        await expect(page.locator("#submit-error")).to_have_text("")
        text = await page.locator("#submit-form").inner_text()
        assert "thesis.document_url" not in text and "String should" not in text, text
        await page.screenshot(path=str(ARTIFACTS / "dashboard-form-errors.png"), full_page=True)

        # Typing in a field clears its message.
        await page.fill("#title", "Thesis 1")
        await expect(page.locator("#title-error")).to_be_hidden()
        await expect(page.locator("#title")).not_to_have_attribute("aria-invalid", "true")

        # Too much for one job: said at the sources.
        many = [f"https://journal.example/articles/{n}/a-rather-long-name" for n in range(40)]
        await page.fill("#document-url", "https://uni.example/thesis.pdf")
        await page.fill("#sources", "\n".join(many))
        await expect(page.locator("#source-count")).to_have_text("40 sources")
        await page.click("#submit-button")
        await expect(page.locator("#sources-error")).to_contain_text(
            "This is too much for one analysis: "
        )

        # Put right, it is admitted: the last credit goes, and the header says so.
        await page.fill("#sources", "10.1000/fine.1\nhttps://journal.example/a/2")
        await page.click("#submit-button")
        await expect(page.locator("#title")).to_have_value("")
        await expect(page.locator("#sources")).to_have_value(
            "10.1000/fine.1\nhttps://journal.example/a/2"
        )
        await expect(page.locator("#running > li")).to_have_count(1)
        await expect(page.locator("#credits")).to_have_text(re.compile(r"^0\s+credits left$"))

        # No credit left: said under the button, with what to do.
        await _submit_expecting_error(page, "Thesis 2")
        await expect(page.locator("#submit-error")).to_have_text(
            "Not enough credits to start this analysis (0 credits left). Ask for more "
            "credits, then try again."
        )
        await expect(page.locator("#sources")).to_have_value(
            "10.1000/fine.1\nhttps://journal.example/a/2"
        )

        # One click clears the sources, and the cursor waits there for new ones.
        await page.click("#clear-sources")
        await expect(page.locator("#sources")).to_have_value("")
        await expect(page.locator("#sources")).to_be_focused()
        await expect(page.locator("#source-count")).to_have_text("")
        assert watched.problems == []
        # The only failed requests are the refusals this test asked for.
        assert all(re.search(r"/v1/analyses: HTTP (422|413|402)$", f) for f in watched.failed), (
            watched.failed
        )


async def _submit_expecting_error(page: Any, title: str) -> None:
    await page.fill("#title", title)
    await page.fill("#document-url", "https://uni.example/thesis-2.pdf")
    await page.click("#submit-button")
    await expect(page.locator("#submit-error")).not_to_have_text("")
    await expect(page.locator("#title")).to_have_value(title)  # kept, to try again


async def _header_on_one_line(page: Any) -> None:
    boxes = await page.evaluate(
        """() => [...document.querySelectorAll('.top h1, .top .session > :not([hidden])')]
              .map(e => { const r = e.getBoundingClientRect();
                          return [e.id || e.tagName, r.top, r.bottom, r.left, r.right]; })"""
    )
    assert len(boxes) == 5, boxes  # the title, the connection, the user, credits, sign out
    middles = [(top + bottom) / 2 for _, top, bottom, _, _ in boxes]
    assert max(middles) - min(middles) < 4, boxes
    for name, top, bottom, _, _ in boxes:
        assert bottom - top < 40, (name, boxes)  # no item wraps onto a second line
    lefts = [left for _, _, _, left, _ in boxes]
    assert lefts == sorted(lefts), boxes  # side by side, not stacked
    assert all(right <= PHONE["width"] for _, _, _, _, right in boxes), boxes


async def _no_horizontal_overflow(page: Any) -> None:
    widths = await page.evaluate(
        "() => [document.documentElement.scrollWidth, document.documentElement.clientWidth,"
        " document.body.scrollWidth]"
    )
    assert widths[0] <= widths[1] and widths[2] <= widths[1], widths
    # Nothing drawn past the right edge, but what an ancestor clips (an ellipsis) is not drawn.
    wide = await page.evaluate(
        """(limit) => {
             const clipped = (e) => {
               for (let a = e.parentElement; a; a = a.parentElement) {
                 if (getComputedStyle(a).overflowX !== 'visible') return true;
               }
               return false;
             };
             return [...document.querySelectorAll('body *')]
               .filter(e => e.getClientRects().length)
               .filter(e => e.getBoundingClientRect().right > limit + 0.5 && !clipped(e))
               .map(e => e.tagName + '.' + e.className);
           }""",
        PHONE["width"],
    )
    assert wide == [], wide


async def test_phone_layout_holds_at_375_px(harness: Harness) -> None:
    h = harness
    h.sim.judge_time_s = 3600
    inst = await h.start_instance()
    user = "lecturer.with-a-long-name@faculty.uni.example"
    await h.grant(user, 10)
    token = mint_token(user, JWT_SECRET)
    long_source = (
        "https://repository.example/a-very-long-path/that-keeps-going/and-going/2024/"
        "conference-proceedings-volume-12.pdf"
    )
    sources = [*SOURCES, long_source]

    async with _chromium() as browser:
        watched = await _page(browser, PHONE)
        page = watched.page
        await _sign_in(page, inst.base_url, token)
        await expect(page.locator("#user-name")).to_have_text(user)
        await _header_on_one_line(page)
        await _no_horizontal_overflow(page)
        await page.screenshot(path=str(ARTIFACTS / "dashboard-phone-signed-in.png"))

        title = "A thesis with a rather long title on fairness in multi-tenant queueing systems"
        await _submit(page, title, 1, sources)
        running = page.locator("#running > li")
        await expect(running).to_have_attribute("data-status", "running")
        first_id = await running.get_attribute("data-job-id")
        assert first_id is not None
        await _finish_in_core(h, first_id)
        await _submit(page, "Thesis 2", 2)
        await _submit(page, "Thesis 3", 3)
        await expect(page.locator("#queued > li")).to_have_count(1)
        second_id = await running.get_attribute("data-job-id")
        assert second_id is not None
        await _finish_in_core(h, second_id, state="failed", error="The document is a scan.")
        finished = page.locator(f"#finished > li[data-job-id='{first_id}']")
        await expect(finished).to_have_attribute("data-status", "succeeded")
        await finished.locator(":scope > .job-name .title").click()
        await expect(finished.locator(".panel tbody tr")).to_have_count(len(sources))
        await finished.locator(":scope > .job-actions .recheck").click()
        await finished.get_by_role("button", name="Start re-check").click()
        await expect(finished.locator(".rechecks > li")).to_have_count(1)
        await _submit(page, "Thesis 4", 4)
        await page.locator("#queued > li", has_text="Thesis 4").get_by_role("button").click()
        await expect(page.locator("#finished > li[data-status=cancelled]")).to_have_count(1)

        # Everything at once on a 375 px screen: nothing sticks out sideways, and the header
        # keeps to one line.
        await _header_on_one_line(page)
        await _no_horizontal_overflow(page)
        await page.screenshot(path=str(ARTIFACTS / "dashboard-phone.png"), full_page=True)
        await page.evaluate("window.scrollTo(0, 0)")
        await page.screenshot(path=str(ARTIFACTS / "dashboard-phone-top.png"))

        # The same page at desktop width, for the record.
        await page.set_viewport_size(DESKTOP)
        await expect(page.locator("#user")).to_contain_text("Signed in as")
        await page.screenshot(
            path=str(ARTIFACTS / "dashboard-desktop-all-states.png"), full_page=True
        )
        assert watched.failed == []
        assert watched.problems == []


async def test_older_analyses_load_on_request(harness: Harness) -> None:
    """The stream's snapshot holds the newest 200; the rest come a page at a time, on a click."""
    h = harness
    h.sim.judge_time_s = 3600  # the oldest runs, the rest wait: all of them open
    inst = await h.start_instance(analysis_cost=0)
    for n in range(1, 203):
        status, job = await h.admit("lecturer", n, body=thesis_body(n, sources=1))
        assert status == 201, job
    token = mint_token("lecturer", JWT_SECRET)

    async with _chromium() as browser:
        watched = await _page(browser, DESKTOP)
        page = watched.page
        await _sign_in(page, inst.base_url, token)
        shown = page.locator("#running > li, #queued > li, #finished > li")
        await expect(shown).to_have_count(200)
        await expect(page.locator("#running > li")).to_have_count(0)  # Thesis 1 is older
        older = page.locator("#older")
        await expect(older).to_be_visible()
        await older.click()
        await expect(shown).to_have_count(202)
        await expect(older).to_be_hidden()
        await expect(page.locator("#running > li .title")).to_have_text("Thesis 1")
        assert await _positions(page) == [(str(n - 1), f"Thesis {n}") for n in range(2, 203)]
        assert watched.failed == []
        assert watched.problems == []
