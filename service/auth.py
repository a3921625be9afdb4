"""Who is calling: user JWTs (HS256, pinned) and the admin bearer token."""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from typing import Any

import jwt

from . import errors

ALGORITHM = "HS256"
TOKEN_TTL_S = 24 * 3600
MAX_USER_ID_LEN = 200


def _bearer(header: str | None) -> str:
    if not header:
        raise errors.Unauthorized("Missing Authorization: Bearer token.")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.Unauthorized("Authorization must be a Bearer token.")
    return token.strip()


def user_from_header(header: str | None, secret: str) -> str:
    """The user id (``sub``) of a valid token; Unauthorized otherwise."""
    return _verify(_bearer(header), secret)[0]


def _verify(token: str, secret: str) -> tuple[str, float]:
    """(sub, exp) of a valid token."""
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            secret,
            algorithms=[ALGORITHM],  # pinned: "none" and algorithm confusion are refused
            options={"require": ["sub", "exp"]},
        )
    except jwt.ExpiredSignatureError as exc:
        raise errors.Unauthorized("The token has expired.") from exc
    except jwt.PyJWTError as exc:
        raise errors.Unauthorized("The token is invalid.") from exc
    sub = claims.get("sub")
    if not isinstance(sub, str) or not 0 < len(sub) <= MAX_USER_ID_LEN or not sub.isprintable():
        raise errors.Unauthorized("The token's subject is not a valid user id.")
    return sub, float(claims["exp"])


class TokenCache:
    """Verified tokens, so a client's every request does not pay for HMAC and JSON parsing
    again. A hit is still checked against the token's expiry; bounded, oldest evicted."""

    def __init__(self, secret: str, max_entries: int = 10_000) -> None:
        self._secret = secret
        self._max = max_entries
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def user(self, header: str | None) -> str:
        token = _bearer(header)
        hit = self._entries.get(token)
        if hit is not None:
            if hit[1] > time.time():
                return hit[0]
            del self._entries[token]
        sub, exp = _verify(token, self._secret)
        self._entries[token] = (sub, exp)
        if len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return sub


def require_admin(header: str | None, admin_token: str) -> None:
    token = _bearer(header)
    if not admin_token or not hmac.compare_digest(token.encode(), admin_token.encode()):
        raise errors.Unauthorized("Admin credentials required.")


def mint_token(user_id: str, secret: str, ttl_s: int = TOKEN_TTL_S) -> str:
    """A token for local use (``analysis-queue token USER``) and tests."""
    now = int(time.time())
    return jwt.encode({"sub": user_id, "iat": now, "exp": now + ttl_s}, secret, algorithm=ALGORITHM)
