"""The clients: :class:`AnalysisQueueClient` for a user (their jobs, credits and events) and
:class:`AdminClient` for the admin calls. Each owns its ``aiohttp.ClientSession`` unless it is
given one, and is an async context manager that closes what it owns.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Self
from urllib.parse import quote
from uuid import UUID

import aiohttp

from analysis_queue.client.errors import NotFound
from analysis_queue.client.models import (
    Analysis,
    AnalysisPage,
    AnalysisSummary,
    Capacity,
    CreditGrantResult,
    Credits,
    UserLimit,
)
from analysis_queue.client.retries import RetryPolicy
from analysis_queue.client.stream import EventStream, StreamSettings
from analysis_queue.client.transport import TokenSource, Transport
from analysis_queue.client.waits import Waits

DEFAULT_TIMEOUT_S = 30.0
PAGE_MAX = 200  # the service's largest page


def _segment(value: UUID | str) -> str:
    """A path segment, quoted: an id such as ``../credits`` must not reach another route."""
    return quote(str(value), safe="")


class _Client:
    def __init__(
        self,
        base_url: str,
        token: TokenSource,
        *,
        session: aiohttp.ClientSession | None,
        timeout_s: float,
        retry: RetryPolicy,
    ) -> None:
        self._http = Transport(base_url, token, session=session, timeout_s=timeout_s, retry=retry)

    @property
    def base_url(self) -> str:
        return self._http.base_url

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AnalysisQueueClient(_Client):
    """A user's client. ``token`` is their bearer JWT, or an async callable that returns a
    valid one (it is called for each request: cache inside it; after a 401 it is asked once
    more, and a different token is tried).

    ``timeout_s`` bounds each try of a call; ``retry`` says how often a call that may be
    repeated is tried (``retries.py``: GETs and :meth:`start_analysis`), ``stream`` how
    :meth:`events` reconnects.
    """

    def __init__(
        self,
        base_url: str,
        token: TokenSource,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        stream: StreamSettings | None = None,
    ) -> None:
        super().__init__(
            base_url, token, session=session, timeout_s=timeout_s, retry=retry or RetryPolicy()
        )
        self.stream_settings = stream or StreamSettings()
        self._waits = Waits(lambda: self.events(), self.get_analysis)

    async def close(self) -> None:
        await self._waits.stop()
        await super().close()

    async def start_analysis(
        self,
        title: str,
        document_url: str,
        sources: Iterable[str],
        *,
        idempotency_key: str | None = None,
    ) -> Analysis:
        """Admit an analysis. It always carries an Idempotency-Key (a fresh one unless given),
        so a retry replays the job the first try admitted instead of admitting a second one.
        Pass your own key to make a retry of *your* call (after a crash, say) safe as well.

        Raises :class:`InsufficientCredits`, :class:`InvalidBody`, :class:`InvalidSource`,
        :class:`UnparseableThesis`, :class:`JobTooLarge`, :class:`ProviderBudgetExhausted`,
        :class:`IdempotencyKeyReused` (your key, another body), :class:`ServiceUnavailable`
        once its retries are spent."""
        key = idempotency_key or str(uuid.uuid4())
        body = {"thesis": {"title": title, "document_url": document_url}, "sources": list(sources)}
        job, _ = await self._http.call(
            "POST",
            "/v1/analyses",
            Analysis,
            action="start_analysis",
            body=body,
            headers={"Idempotency-Key": key},
            idempotent=True,
            keyed=True,
        )
        return job

    async def get_analysis(self, analysis_id: UUID | str) -> Analysis:
        """One of your jobs, whole (sources and verdicts); :class:`NotFound` if there is no
        such job of yours."""
        job, _ = await self._http.call(
            "GET",
            f"/v1/analyses/{_segment(analysis_id)}",
            Analysis,
            action="get_analysis",
            idempotent=True,
        )
        return job

    async def cancel_analysis(self, analysis_id: UUID | str) -> Analysis | None:
        """Cancel a job and keep it listed (``POST /v1/analyses/{id}/cancel``): one that has not
        run is refunded. The job as cancelled (a job cancelled before is answered as it is), or
        None when there is no such job of yours; :class:`Conflict` if it succeeded or failed.
        Not retried: a :class:`ServiceUnavailable` (Core could not be told to stop it) leaves
        the job going."""
        return await self._end(analysis_id, "POST", "/cancel", "cancel_analysis")

    async def delete_analysis(self, analysis_id: UUID | str) -> Analysis | None:
        """Take a job out of your list for good (``DELETE``): one that has not ended is
        cancelled first, as :meth:`cancel_analysis` does. The job as it ended, or None when
        there is no such job of yours (deleted already, say). Not retried, like a cancel."""
        return await self._end(analysis_id, "DELETE", "", "delete_analysis")

    async def _end(
        self, analysis_id: UUID | str, method: str, suffix: str, action: str
    ) -> Analysis | None:
        try:
            job, _ = await self._http.call(
                method,
                f"/v1/analyses/{_segment(analysis_id)}{suffix}",
                Analysis,
                action=action,
                idempotent=False,
            )
        except NotFound:
            return None
        return job

    async def start_recheck(self, analysis_id: UUID | str, sources: Iterable[str]) -> Analysis:
        """Re-check a succeeded job against new sources; :class:`Conflict` unless it
        succeeded. Not retried (a re-check takes no Idempotency-Key)."""
        job, _ = await self._http.call(
            "POST",
            f"/v1/analyses/{_segment(analysis_id)}/rechecks",
            Analysis,
            action="start_recheck",
            body={"sources": list(sources)},
            idempotent=False,
        )
        return job

    async def credits(self) -> int:
        """Your credit balance."""
        answer, _ = await self._http.call(
            "GET", "/v1/credits", Credits, action="credits", idempotent=True
        )
        return answer.balance

    async def list_page(self, *, limit: int = 50, cursor: str | None = None) -> AnalysisPage:
        """One page of your jobs, newest first (``limit`` 1 to 200); pass its ``next`` as
        ``cursor`` for the page after it."""
        params = {"limit": str(limit)}
        if cursor is not None:
            params["cursor"] = cursor
        page, _ = await self._http.call(
            "GET", "/v1/analyses", AnalysisPage, action="list_page", params=params, idempotent=True
        )
        return page

    async def list_analyses(self, *, page_size: int = PAGE_MAX) -> AsyncIterator[AnalysisSummary]:
        """Every job of yours, newest first, page after page: each job that existed when the
        listing began comes exactly once (one admitted meanwhile sorts before the first page).
        Summaries, as the list carries them; :meth:`get_analysis` has a job whole."""
        cursor: str | None = None
        while True:
            page = await self.list_page(limit=page_size, cursor=cursor)
            for job in page.analyses:
                yield job
            if page.next is None:
                return
            cursor = page.next

    def events(self, last_event_id: int | None = None) -> EventStream:
        """Your event stream, reconnecting by itself (``stream.py``): every stored event once,
        in id order, and ``position`` and ``snapshot`` frames. Without ``last_event_id`` it
        starts with a snapshot of your newest jobs. Close it (``async with``) when done."""
        return EventStream(self._http, last_event_id, self.stream_settings)

    async def wait_for(self, analysis_id: UUID | str, timeout_s: float) -> Analysis:
        """The job, whole, once it is succeeded, failed or cancelled, learnt from the event
        stream (``waits.py``); ``TimeoutError`` after ``timeout_s``, :class:`NotFound` if
        there is no such job of yours (or it was deleted meanwhile)."""
        job_id = analysis_id if isinstance(analysis_id, UUID) else UUID(str(analysis_id))
        return await self._waits.wait(job_id, timeout_s)


class AdminClient(_Client):
    """The admin calls, with the ``AQ_ADMIN_TOKEN``. Only the reads are retried: a grant
    carries no Idempotency-Key, so repeating it could grant twice."""

    def __init__(
        self,
        base_url: str,
        admin_token: TokenSource,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(
            base_url,
            admin_token,
            session=session,
            timeout_s=timeout_s,
            retry=retry or RetryPolicy(),
        )

    async def grant_credits(self, user_id: str, amount: int, *, note: str | None = None) -> int:
        """Grant ``amount`` credits to ``user_id``; their balance after it."""
        body: dict[str, object] = {"user_id": user_id, "amount": amount}
        if note is not None:
            body["note"] = note
        answer, _ = await self._http.call(
            "POST",
            "/v1/admin/credits",
            CreditGrantResult,
            action="grant_credits",
            body=body,
            idempotent=False,
        )
        return answer.balance

    async def set_user_limit(self, user_id: str, max_running: int | None) -> UserLimit:
        """How many of the user's analyses may run at once (1 to 100; None: the default)."""
        limit, _ = await self._http.call(
            "PUT",
            f"/v1/admin/users/{_segment(user_id)}/limit",
            UserLimit,
            action="set_user_limit",
            body={"max_running": max_running},
            idempotent=False,
        )
        return limit

    async def user_limit(self, user_id: str) -> UserLimit:
        limit, _ = await self._http.call(
            "GET",
            f"/v1/admin/users/{_segment(user_id)}/limit",
            UserLimit,
            action="user_limit",
            idempotent=True,
        )
        return limit

    async def capacity(self) -> Capacity:
        """The provider ceiling, the slots in use and who waits for capacity."""
        answer, _ = await self._http.call(
            "GET", "/v1/admin/capacity", Capacity, action="capacity", idempotent=True
        )
        return answer
