"""Unit tests without a database: backoff, SQL files, auth, settings, JSON shapes, problems."""

from __future__ import annotations

import base64
import json
import stat
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
import pytest
from analysis_queue import errors
from analysis_queue.config import SECRETS_FILE, Settings
from analysis_queue.http.auth import mint_token, require_admin, user_from_header
from analysis_queue.models import Job
from analysis_queue.queue.dispatch import next_attempt_at

REPO = Path(__file__).resolve().parents[2]
SECRET = "unit-test-jwt-secret-0123456789abcdef-0123456789abcdef-0123456789"
SAMPLES = 2000
# timedelta keeps microseconds: a uniform draw is rounded to the nearest one.
TIMEDELTA_RESOLUTION_S = 1e-6


# -- dispatch.next_attempt_at --------------------------------------------------------------


def _tenacity_window(attempt: int, base_s: float, max_s: float) -> float:
    """wait_random_exponential draws uniform(0, min(max, multiplier * 2 ** (attempt_number - 1)));
    next_attempt_at passes attempt_number = max(1, attempt)."""
    return float(min(max_s, base_s * 2 ** (max(1, attempt) - 1)))


def _delays(attempt: int, base_s: float, max_s: float, deadline_in_s: float) -> list[float]:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    deadline = now + timedelta(seconds=deadline_in_s)
    out = []
    for _ in range(SAMPLES):
        at = next_attempt_at(now, attempt, deadline, base_s=base_s, max_s=max_s)
        assert at <= deadline
        out.append((at - now).total_seconds())
    return out


@pytest.mark.parametrize("attempt", [0, 1, 2, 3, 5, 8, 12, 40])
def test_next_attempt_full_jitter_window(attempt: int) -> None:
    base_s, max_s = 0.5, 20.0
    window = _tenacity_window(attempt, base_s, max_s)
    delays = _delays(attempt, base_s, max_s, deadline_in_s=10_000)
    upper = min(max_s, base_s * 2**attempt)  # the documented AWS bound; tenacity's is <= it
    assert all(0 <= d <= window + TIMEDELTA_RESOLUTION_S for d in delays), (min(delays), window)
    assert all(d <= upper + TIMEDELTA_RESOLUTION_S for d in delays)
    # Full jitter: the draws fill the window, they are not constant or clustered.
    assert len(set(delays)) > SAMPLES * 0.9
    assert max(delays) > 0.9 * window
    assert min(delays) < 0.1 * window
    mean = sum(delays) / len(delays)
    assert 0.4 * window < mean < 0.6 * window


def test_next_attempt_window_grows_then_caps() -> None:
    base_s, max_s = 1.0, 60.0
    maxima = [max(_delays(n, base_s, max_s, deadline_in_s=10_000)) for n in (1, 3, 5, 7, 9)]
    # windows 1, 4, 16, 60 (capped from 64), 60 (capped from 256)
    assert maxima[0] <= 1.0 + TIMEDELTA_RESOLUTION_S
    assert 3.6 < maxima[1] <= 4.0 + TIMEDELTA_RESOLUTION_S
    assert 14.4 < maxima[2] <= 16.0 + TIMEDELTA_RESOLUTION_S
    assert 54.0 < maxima[3] <= 60.0 + TIMEDELTA_RESOLUTION_S
    assert 54.0 < maxima[4] <= 60.0 + TIMEDELTA_RESOLUTION_S


def test_next_attempt_never_after_deadline() -> None:
    base_s, max_s = 10.0, 600.0
    delays = _delays(6, base_s, max_s, deadline_in_s=2.5)  # window 320 s, deadline in 2.5 s
    assert max(delays) == 2.5
    assert all(0 <= d <= 2.5 for d in delays)
    # Most draws are clamped to the deadline, the few below it are still spread.
    assert sum(1 for d in delays if d == 2.5) > SAMPLES * 0.9
    assert len({d for d in delays if d < 2.5}) > 1

    now = datetime(2030, 1, 1, tzinfo=UTC)
    past = now - timedelta(seconds=1)
    assert next_attempt_at(now, 3, past, base_s=base_s, max_s=max_s) == past


# -- auth ----------------------------------------------------------------------------------


def _b64(data: dict[str, Any]) -> str:
    raw = json.dumps(data, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_token_round_trip() -> None:
    token = mint_token("alice@example", SECRET)
    assert user_from_header(f"Bearer {token}", SECRET) == "alice@example"
    assert user_from_header(f"bearer   {token}  ", SECRET) == "alice@example"


def test_expired_token_is_refused() -> None:
    token = mint_token("alice", SECRET, ttl_s=-10)
    with pytest.raises(errors.Unauthorized, match="expired"):
        user_from_header(f"Bearer {token}", SECRET)


def test_wrong_secret_is_refused() -> None:
    token = mint_token("alice", SECRET + "-other")
    with pytest.raises(errors.Unauthorized):
        user_from_header(f"Bearer {token}", SECRET)


def test_alg_none_is_refused() -> None:
    now = int(time.time())
    for header in ({"alg": "none"}, {"alg": "none", "typ": "JWT"}, {"alg": "None"}):
        token = f"{_b64(header)}.{_b64({'sub': 'alice', 'exp': now + 3600})}."
        with pytest.raises(errors.Unauthorized):
            user_from_header(f"Bearer {token}", SECRET)


def test_other_hmac_algorithm_is_refused() -> None:
    now = int(time.time())
    token = jwt.encode({"sub": "alice", "exp": now + 3600}, SECRET, algorithm="HS512")
    assert jwt.decode(token, SECRET, algorithms=["HS512"])["sub"] == "alice"  # well formed
    with pytest.raises(errors.Unauthorized):
        user_from_header(f"Bearer {token}", SECRET)


def test_token_without_exp_is_refused() -> None:
    token = jwt.encode({"sub": "alice", "iat": int(time.time())}, SECRET, algorithm="HS256")
    with pytest.raises(errors.Unauthorized):
        user_from_header(f"Bearer {token}", SECRET)


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Bearer    ", "Basic dXNlcjpwYXNz", "Token abc", "abc"],
)
def test_missing_or_non_bearer_header_is_unauthorized(header: str | None) -> None:
    with pytest.raises(errors.Unauthorized) as info:
        user_from_header(header, SECRET)
    assert info.value.code == "unauthorized"
    with pytest.raises(errors.Unauthorized):
        require_admin(header, "admin-token")


def test_require_admin_accepts_only_the_exact_token() -> None:
    require_admin("Bearer admin-token", "admin-token")  # no exception: accepted
    require_admin("bearer  admin-token ", "admin-token")
    for wrong in ("admin-tokenX", "admin-toke", "ADMIN-TOKEN", "admin", mint_token("a", SECRET)):
        with pytest.raises(errors.Unauthorized):
            require_admin(f"Bearer {wrong}", "admin-token")


def test_require_admin_refuses_when_no_admin_token_is_configured() -> None:
    for header in ("Bearer x", "Bearer admin-token", 'Bearer ""'):
        with pytest.raises(errors.Unauthorized):
            require_admin(header, "")


# -- config.Settings.with_generated_secrets -------------------------------------------------

SECRET_NAMES = ("jwt_secret", "admin_token", "core_callback_secret")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECRET_NAMES:
        monkeypatch.delenv(f"AQ_{name.upper()}", raising=False)


@pytest.mark.usefixtures("clean_env")
def test_generated_secrets_are_created_once_and_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = Settings(data_dir=data_dir).with_generated_secrets()
    path = data_dir / SECRETS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = {name: getattr(first, name) for name in SECRET_NAMES}
    assert all(len(v) >= 32 for v in values.values())
    assert len(set(values.values())) == 3
    assert json.loads(path.read_text()) == values
    before = path.stat()

    second = Settings(data_dir=data_dir).with_generated_secrets()
    assert {name: getattr(second, name) for name in SECRET_NAMES} == values
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(data_dir.glob("*.tmp"))


@pytest.mark.usefixtures("clean_env")
def test_explicit_secrets_are_kept(tmp_path: Path) -> None:
    stored = Settings(data_dir=tmp_path).with_generated_secrets()
    explicit = Settings(data_dir=tmp_path, jwt_secret="explicit-jwt").with_generated_secrets()
    assert explicit.jwt_secret == "explicit-jwt"
    assert explicit.admin_token == stored.admin_token
    assert explicit.core_callback_secret == stored.core_callback_secret
    assert json.loads((tmp_path / SECRETS_FILE).read_text())["jwt_secret"] == stored.jwt_secret

    all_set = Settings(
        data_dir=tmp_path / "unused", jwt_secret="a", admin_token="b", core_callback_secret="c"
    ).with_generated_secrets()
    assert (all_set.jwt_secret, all_set.admin_token, all_set.core_callback_secret) == (
        "a",
        "b",
        "c",
    )
    assert not (tmp_path / "unused").exists()


# -- models.Job.to_json --------------------------------------------------------------------

JOB_KEYS = {
    "id",
    "run_id",
    "status",
    "queue_position",
    "waiting_for",
    "delta_of",
    "thesis",
    "sources",
    "created_at",
    "promoted_at",
    "started_at",
    "finished_at",
    "error",
    "verdicts",
}


def _job(status: str, queue_position: int | None, **overrides: Any) -> Job:
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "user_id": "alice",
        "run_id": uuid.uuid4(),
        "core_run_id": "core-1",
        "status": status,
        "queue_seq": 7,
        "delta_of_job_id": None,
        "deleted_at": None,
        "thesis": {"title": "T", "document_url": "https://uni.example/t.pdf"},
        "sources": ["10.1000/x"],
        "cost": 1,
        "created_at": datetime(2030, 1, 1, tzinfo=UTC),
        "promoted_at": None,
        "started_at": None,
        "finished_at": None,
        "release_attempts": 0,
        "next_release_at": None,
        "error_code": None,
        "error_detail": None,
        "verdicts": None,
        "queue_position": queue_position,
    }
    values.update(overrides)
    return Job(**values)


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
