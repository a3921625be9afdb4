"""User tokens and the admin token (http/auth.py)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import jwt
import pytest
from analysis_queue import errors
from analysis_queue.http.auth import mint_token, require_admin, user_from_header

SECRET = "unit-test-jwt-secret-0123456789abcdef-0123456789abcdef-0123456789"


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
