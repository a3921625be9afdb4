"""A job as the REST API and the event stream show it."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic
import pytest
from analysis_queue.models import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    ChangeNotice,
    EventKind,
    Job,
    JobStatus,
    WaitReason,
)
from support import make_job

SUMMARY_KEYS = {
    "id",
    "run_id",
    "status",
    "queue_position",
    "waiting_for",
    "delta_of",
    "thesis",
    "source_count",
    "verdict_counts",
    "created_at",
    "promoted_at",
    "started_at",
    "finished_at",
    "error",
}
JOB_KEYS = SUMMARY_KEYS | {"sources", "verdicts"}


def _job(status: str, queue_position: int | None, **overrides: Any) -> Job:
    return make_job(status=status, queue_position=queue_position, **overrides)


@pytest.mark.parametrize(
    "status", ["queued", "pending", "running", "succeeded", "failed", "cancelled"]
)
def test_job_json_shape(status: str) -> None:
    job = _job(status, 3, waiting_for="provider_capacity")
    body = job.to_json()
    assert set(body) == JOB_KEYS
    assert body["queue_position"] == (3 if status == "queued" else None)
    assert body["waiting_for"] == ("provider_capacity" if status == "queued" else None)
    assert body["id"] == str(job.id) and body["run_id"] == str(job.run_id)
    assert body["created_at"] == "2030-01-01T00:00:00+00:00"
    assert body["delta_of"] is None
    json.dumps(body)  # plain JSON types only


def test_job_json_delta_and_error() -> None:
    parent = uuid.uuid4()
    job = _job(
        "failed",
        None,
        delta_of_job_id=parent,
        finished_at=datetime(2030, 1, 2, tzinfo=UTC),
        error_code="core_run_gone",
        error_detail="gone",
    )
    body = job.to_json()
    assert set(body) == JOB_KEYS
    assert body["delta_of"] == str(parent)
    assert body["error"] == {"code": "core_run_gone", "detail": "gone"}
    assert body["queue_position"] is None
    assert _job("queued", None).to_json()["queue_position"] is None


def test_a_summary_is_the_job_without_its_sources_and_verdicts() -> None:
    verdicts = [
        {"source": "10.1000/a", "verdict": "supported"},
        {"source": "10.1000/b", "verdict": "unsupported"},
        {"source": "10.1000/c", "verdict": "supported"},
    ]
    job = _job(
        "succeeded", None, sources=["10.1000/a", "10.1000/b", "10.1000/c"], verdicts=verdicts
    )
    summary = job.summary().to_json()
    assert set(summary) == SUMMARY_KEYS
    assert summary["source_count"] == 3
    assert summary["verdict_counts"] == {"supported": 2, "unsupported": 1}
    whole = job.to_json()
    assert {k: v for k, v in whole.items() if k in SUMMARY_KEYS} == summary
    assert (whole["sources"], whole["verdicts"]) == (job.sources, verdicts)
    assert _job("queued", 1).summary().to_json()["verdict_counts"] is None


# -- the closed sets are the database's ------------------------------------------------------

BASELINE = (
    Path(__file__).resolve().parents[2] / "sql" / "migrations" / "0011_baseline.sql"
).read_text()


def _check_values(pattern: str) -> set[str]:
    match = re.search(pattern, BASELINE, flags=re.DOTALL)
    assert match is not None, pattern
    return set(re.findall(r"'([a-z_]+)'", match.group(1)))


def test_statuses_kinds_and_waits_are_what_the_database_allows() -> None:
    assert {s.value for s in JobStatus} == _check_values(
        r"status\s+text NOT NULL CHECK \((.*?)\)\)"
    )
    assert {k.value for k in EventKind} == _check_values(r"job_events_kind_check CHECK \((.*?)\)\)")
    assert {w.value for w in WaitReason} == _check_values(r"AND waiting_for IN \((.*?)\)\)")
    assert ACTIVE_STATUSES | TERMINAL_STATUSES | {JobStatus.QUEUED} == set(JobStatus)


def test_a_notification_payload_reads_as_a_notice_and_extra_keys_are_ignored() -> None:
    payload = json.dumps(
        {"v": 2, "at": 1.5, "u": {"b": 0, "a": 1, "c": 1}, "a_key_of_a_later_release": 1}
    )
    notice = ChangeNotice.model_validate_json(payload)
    assert (notice.at, notice.users, notice.overflow) == (1.5, {"b": 0, "a": 1, "c": 1}, False)
    assert notice.wakes() == ["a", "c"], "sorted, and only the users whose change may leave work"
    many = ChangeNotice.model_validate_json('{"v": 2, "at": 2.0, "overflow": true}')
    assert many.overflow and many.users == {} and many.wakes() == []
    with pytest.raises(pydantic.ValidationError):
        ChangeNotice.model_validate_json('{"v": 2, "u": {"a": "yes"}}')
