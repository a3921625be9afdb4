"""Promotion: fill free slots, from wherever a slot is known or suspected to have freed.

The decisions are the database's (sql/functions/promote.sql); this module decides *when* to ask,
and folds requests that arrive while one is in flight into one more call:

- **A wake-up** (``wake(user)``: a notification says a job of the user left pending/running
  or became pending, committed by another instance or writer: this instance's own decisions
  were followed up where they were made). Wake-ups that arrive together go out
  as one call (``aq_promote_woken_v2``) that reads without locks and only fills what the change
  left to fill: the usual one (a completion that already promoted its user's next job) costs
  one read. It also names the users' pending jobs that nobody is releasing. A few calls in
  flight per instance at most (one with the ceiling on); what arrives meanwhile forms the next.
- **A pass** (``pass_soon``, and ``run_pass`` for the sweep and the start): with the provider
  ceiling on, a freed global slot goes to whoever's turn it is. At most one in flight per
  instance, repeated while it fills whole batches or was asked for again meanwhile; it first
  re-derives the waits of the users it was asked for. Passes of several instances queue on the
  global lock; a late one finds nothing to do at the cost of a round trip.
- **A user's slots** (``promote``): the sweep's repair of a user a notification missed.

Every call returns the ceiling in force, so the instance learns a change of mode from its next
promotion. What a call promoted is claimed for this instance in the call's own transaction
(``claim``) and goes to the follow-up (queue/followup.py): the dispatcher releases it with no
claim statement in between.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

from analysis_queue import errors, tracing
from analysis_queue.models import Job, Woken
from analysis_queue.queue.followup import Decision, FollowUp, Trigger
from analysis_queue.store.database import Claim

log = logging.getLogger(__name__)

PASS_BATCH = 64  # promotions per pass transaction (it holds the chosen users' locks)
WAKE_CONCURRENCY = 4  # wake-up calls in flight at once per instance


class PromotionStore(Protocol):
    """The database calls promotion makes (``store/database.Database``)."""

    async def promote(
        self, user_ids: Sequence[str], limit: int, claim: Claim | None = None
    ) -> tuple[int | None, list[Job]]: ...

    async def promote_woken(
        self, user_ids: Sequence[str], limit: int, claim: Claim | None = None
    ) -> Woken: ...

    async def set_user_limit(self, user_id: str, max_running: int | None) -> list[Job]: ...


class Promoter:
    """``claim``: the instance that releases what its calls promote, which they claim for it in
    their own transaction (None: left for the dispatcher to claim)."""

    def __init__(
        self,
        db: PromotionStore,
        followup: FollowUp,
        *,
        claim: Claim | None = None,
        concurrency: int = 8,
    ) -> None:
        self.db = db
        self.followup = followup
        self.claim = claim
        self.ceiling: int | None = None  # as last seen by a promotion here
        self._sem = asyncio.Semaphore(concurrency)
        self._woken: set[str] = set()
        self._waking = 0  # wake-up calls in flight
        self._wake_scheduled = False  # a call that has not yet taken the woken users
        self._pass_running = False
        self._pass_again = False
        self._pass_trigger = Trigger.NOTIFY
        self._pass_users: set[str] = set()  # to re-derive at the next pass
        self._tasks: set[asyncio.Task[None]] = set()
        self.promotions = 0  # jobs promoted through this promoter (tests)
        self.wake_calls = 0  # database calls made for wake-ups (tests, benchmarks)

    @property
    def ceiling_on(self) -> bool:
        return self.ceiling is not None

    # -- requests (never block) -------------------------------------------------------------

    def wake(self, user_id: str) -> None:
        """Fill what a change of ``user_id``'s jobs left free; release their stranded jobs."""
        self._woken.add(user_id)
        self._schedule_wake()

    def _schedule_wake(self) -> None:
        # The call takes the woken users when it starts, after every notification of the same
        # read was handled: they go out together. With the ceiling on a wake-up that fills
        # anything is a pass, and passes exclude each other on the global lock: one at a time.
        limit = 1 if self.ceiling_on else WAKE_CONCURRENCY
        if self._woken and not self._wake_scheduled and self._waking < limit:
            self._wake_scheduled = True
            self._waking += 1
            self._spawn(self._wake_call())

    def pass_soon(self, trigger: Trigger, user_id: str | None = None) -> None:
        """Run a promotion pass; requests while one runs fold into one more."""
        if user_id is not None:
            self._pass_users.add(user_id)
        if self._pass_running:
            self._pass_again = True
            return
        self._pass_running = True
        self._pass_trigger = trigger
        self._spawn(self._pass())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- calls ------------------------------------------------------------------------------

    async def promote(self, user_ids: Sequence[str], trigger: Trigger) -> list[Job]:
        """Fill the users' free slots (with the ceiling on: a pass that first re-derives their
        waits). One call to the database; what it promoted goes to the follow-up."""
        async with self._sem:
            self.ceiling, jobs = await self.db.promote(user_ids, PASS_BATCH, self.claim)
        self._promoted(jobs, trigger)
        return jobs

    async def run_pass(self, trigger: Trigger, user_ids: Sequence[str] = ()) -> int:
        """Promote until a call fills less than a whole batch; returns how many."""
        total = 0
        while True:
            jobs = await self.promote(user_ids, trigger)
            total += len(jobs)
            user_ids = ()
            if len(jobs) < PASS_BATCH:
                return total

    async def set_user_limit(self, user_id: str, max_running: int | None) -> list[Job]:
        """Set a user's concurrency (None: the default) and start what a raise allows."""
        jobs = await self.db.set_user_limit(user_id, max_running)
        self.promotions += len(jobs)
        # With the ceiling on, the user's jobs that now wait for capacity may start: a pass.
        asks_pass = Trigger.LIMIT if self.ceiling_on else None
        self.followup.after(Decision(Trigger.LIMIT, promoted=jobs, asks_pass=asks_pass))
        return jobs

    def _promoted(self, jobs: Sequence[Job], trigger: Trigger) -> None:
        self.promotions += len(jobs)
        if jobs:
            self.followup.after(Decision(trigger, promoted=jobs))

    async def _wake_call(self) -> None:
        self._wake_scheduled = False
        users, self._woken = sorted(self._woken), set()
        try:
            await self._wake_once(users)
        except errors.DatabaseUnavailable:
            # Lost: the sweep repairs what this wake-up would have done.
            log.warning("wake-up: database unavailable", extra={"action": "promote"})
        except Exception:
            log.exception("wake-up failed", extra={"action": "promote"})
        finally:
            self._waking -= 1
            self._schedule_wake()

    async def _wake_once(self, users: list[str]) -> None:
        with tracing.span("wake-up"):  # traced: the releases it starts are its children
            async with self._sem:
                self.wake_calls += 1
                woken = await self.db.promote_woken(users, PASS_BATCH, self.claim)
            self.ceiling = woken.ceiling
            self.promotions += len(woken.promoted)
            self.followup.after(
                Decision(Trigger.NOTIFY, promoted=woken.promoted, unreleased=woken.unreleased)
            )
        if len(woken.promoted) >= PASS_BATCH:
            self.pass_soon(Trigger.NOTIFY)  # a whole batch: there may be more to fill

    async def _pass(self) -> None:
        try:
            while True:
                self._pass_again = False
                users, self._pass_users = sorted(self._pass_users), set()
                with tracing.span("promotion pass"):  # traced: a child of what asked for it
                    await self.run_pass(self._pass_trigger, users)
                if not self._pass_again:
                    break
        except errors.DatabaseUnavailable:
            log.warning("promotion pass: database unavailable", extra={"action": "promote"})
        except Exception:
            log.exception("promotion pass failed", extra={"action": "promote"})
        finally:
            self._pass_running = False

    async def stop(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
