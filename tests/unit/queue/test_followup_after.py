"""The follow-up: every committed decision's promotions are counted once, by trigger, and
handed to the dispatcher; refunds are counted; a pass is asked for when the decision says so."""

from __future__ import annotations

import pytest
from analysis_queue.metrics import Metrics
from analysis_queue.models import Job, JobStatus
from analysis_queue.queue.followup import Decision, FollowUp, Trigger
from support import make_job


class _Releases:
    def __init__(self) -> None:
        self.released: list[Job] = []

    def release(self, job: Job) -> None:
        self.released.append(job)


class _Passes:
    def __init__(self, ceiling_on: bool = False) -> None:
        self._ceiling_on = ceiling_on
        self.asked: list[tuple[Trigger, str | None]] = []

    @property
    def ceiling_on(self) -> bool:
        return self._ceiling_on

    def pass_soon(self, trigger: Trigger, user_id: str | None = None) -> None:
        self.asked.append((trigger, user_id))


def _bound(ceiling_on: bool = False) -> tuple[FollowUp, Metrics, _Releases, _Passes]:
    metrics = Metrics()
    followup = FollowUp(metrics)
    releases, passes = _Releases(), _Passes(ceiling_on)
    followup.bind(releases, passes)
    return followup, metrics, releases, passes


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_promotions_are_counted_by_trigger_and_released_and_the_rest_only_released() -> None:
    followup, metrics, releases, passes = _bound()
    promoted = [make_job(status=JobStatus.PENDING) for _ in range(2)]
    admitted = make_job(status=JobStatus.PENDING, user_id="bob")
    followup.after(Decision(Trigger.TAIL, user_id="alice", promoted=promoted))
    followup.after(Decision(Trigger.ADMIT, user_id="bob", unreleased=[admitted]))
    followup.after(Decision(Trigger.NOTIFY, user_id="carol"))  # a wake-up that found nothing
    assert releases.released == [*promoted, admitted]
    assert _sample(metrics, "aq_promotions_total", trigger="tail") == 2
    assert _sample(metrics, "aq_promotions_total", trigger="admit") == 0, "admitted, not promoted"
    assert _sample(metrics, "aq_promotions_total", trigger="notify") == 0
    assert passes.asked == []


def test_a_refund_is_counted_by_its_reason_and_a_pass_is_asked_for_when_said() -> None:
    followup, metrics, releases, passes = _bound(ceiling_on=True)
    refunded = make_job(status=JobStatus.CANCELLED, error_code="cancelled_by_user")
    followup.after(
        Decision(Trigger.CANCEL, user_id="alice", refunded=refunded, asks_pass=Trigger.CANCEL)
    )
    assert _sample(metrics, "aq_refunds_total", reason="cancelled_by_user") == 1
    assert passes.asked == [(Trigger.CANCEL, "alice")] and releases.released == []


def test_a_decision_before_bind_is_a_bug_not_a_silent_loss() -> None:
    with pytest.raises(RuntimeError, match="bind"):
        FollowUp(Metrics()).after(Decision(Trigger.SWEEP))
