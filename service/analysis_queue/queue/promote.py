"""Promotion: fill free slots, from wherever a slot is known to have freed.

The decision is the database's (``aq_promote_v2``); this module decides *when* to ask, and folds
requests that arrive while one is in flight into one more call:

- **Ceiling off**: a slot is a user's. A freed slot means "promote this user's next job", one
  call per user, several users at once (``promote_user``).
- **Ceiling on**: a freed slot is the provider's and goes to whoever's turn it is, so there is
  one kind of request, a *pass* (``run_pass``): at most one in flight per instance, repeated
  while it fills whole batches or was asked again meanwhile. A pass first re-derives the waits
  of the users whose slot freed (collected meanwhile), in case their completion was written by
  something that did not. Passes of several instances queue on the global lock; a late one
  finds nothing to do at the cost of a round trip.

Every call returns the ceiling in force, so the instance learns a change of mode from its next
promotion; a stale belief costs one misdirected call, never a wrong decision.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from analysis_queue import errors
from analysis_queue.models import Job
from analysis_queue.queue.dispatch import Dispatcher
from analysis_queue.store.database import Database

log = logging.getLogger(__name__)

PASS_BATCH = 64  # promotions per pass transaction (it holds the chosen users' locks)


class Promoter:
    def __init__(self, db: Database, dispatcher: Dispatcher, *, concurrency: int = 8) -> None:
        self.db = db
        self.dispatcher = dispatcher
        self.ceiling: int | None = None  # as last seen by a promotion here
        self._sem = asyncio.Semaphore(concurrency)
        self._promoting: set[str] = set()
        self._again: set[str] = set()
        self._pass_running = False
        self._pass_again = False
        self._pass_users: set[str] = set()  # to re-derive at the next pass
        self._tasks: set[asyncio.Task[None]] = set()
        self.promotions = 0

    @property
    def ceiling_on(self) -> bool:
        return self.ceiling is not None

    # -- requests (never block) -------------------------------------------------------------

    def slot_freed(self, user_id: str, trigger: str = "notify") -> None:
        """A user's job left pending/running: fill what it freed."""
        if self.ceiling_on:
            self.pass_soon(trigger, user_id)
        else:
            self.promote_user_soon(user_id, trigger)

    def promote_user_soon(self, user_id: str, trigger: str = "notify") -> None:
        """Promote a user's next job; requests for one user fold into one re-run."""
        if user_id in self._promoting:
            self._again.add(user_id)
            return
        self._promoting.add(user_id)
        self._spawn(self._promote_user(user_id, trigger))

    def pass_soon(self, trigger: str = "notify", user_id: str | None = None) -> None:
        """Run a promotion pass; requests while one runs fold into one more."""
        if user_id is not None:
            self._pass_users.add(user_id)
        if self._pass_running:
            self._pass_again = True
            return
        self._pass_running = True
        self._spawn(self._pass(trigger))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- calls ------------------------------------------------------------------------------

    async def promote(self, user_ids: Sequence[str], trigger: str) -> list[Job]:
        """One call to the database; hands what it promoted to the dispatcher."""
        async with self._sem:
            self.ceiling, jobs = await self.db.promote(user_ids, PASS_BATCH)
        for job in jobs:
            self.promotions += 1
            self.dispatcher.metrics.promotions.labels(trigger).inc()
            log.info(
                "promoted",
                extra={
                    "action": "promote",
                    "trigger": trigger,
                    "job_id": str(job.id),
                    "user_id": job.user_id,
                },
            )
            self.dispatcher.submit(job.id)
        return jobs

    async def run_pass(self, trigger: str, user_ids: Sequence[str] = ()) -> int:
        """Promote until a call fills less than a whole batch; returns how many."""
        total = 0
        while True:
            jobs = await self.promote(user_ids, trigger)
            total += len(jobs)
            user_ids = ()
            if len(jobs) < PASS_BATCH:
                return total

    async def _promote_user(self, user_id: str, trigger: str) -> None:
        try:
            while True:
                self._again.discard(user_id)
                if self.ceiling_on:
                    # Learned meanwhile: the slot is the provider's.
                    self.pass_soon(trigger, user_id)
                    break
                await self.promote((user_id,), trigger)
                if user_id not in self._again:
                    break
        except errors.DatabaseUnavailable:
            log.warning("promotion: database unavailable", extra={"user_id": user_id})
        except Exception:
            log.exception("promotion failed", extra={"action": "promote", "user_id": user_id})
        finally:
            self._promoting.discard(user_id)

    async def _pass(self, trigger: str) -> None:
        try:
            while True:
                self._pass_again = False
                users, self._pass_users = sorted(self._pass_users), set()
                await self.run_pass(trigger, users)
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
