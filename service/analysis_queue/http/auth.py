"""Who is calling: user JWTs (HS256, pinned; optional issuer and audience) and the admin
bearer token."""

from __future__ import annotations

import hmac
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jwt

from analysis_queue import errors

ALGORITHM = "HS256"
TOKEN_TTL_S = 24 * 3600
# The longest lifetime a user token may claim (AQ_JWT_MAX_TTL_S): without it a token minted
# with ``exp = 10**30`` is a credential for ever, and there is no revocation list.
MAX_TOKEN_TTL_S = 24 * 3600
MAX_USER_ID_LEN = 200
# Clock skew tolerated on ``nbf`` and ``iat`` (a token minted by a clock slightly ahead of ours).
LEEWAY_S = 30


def _numeric_date(claims: dict[str, Any], name: str) -> float | None:
    """Claim ``name`` as an RFC 7519 NumericDate (a JSON number of seconds since the epoch: an
    integer, or a finite non-integer), None when absent; else 401 naming the claim. An integer
    beyond a float's range is refused too: no time this service can compare."""
    if name not in claims:
        return None
    value = claims[name]
    try:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(name)
        seconds = float(value)
    except (TypeError, OverflowError):
        seconds = math.nan
    if not math.isfinite(seconds):
        raise errors.Unauthorized(
            f"The token's {name} claim must be a finite number of seconds since the epoch "
            "(an RFC 7519 NumericDate)."
        )
    return seconds


def _bearer(header: str | None) -> str:
    if not header:
        raise errors.Unauthorized("Missing Authorization: Bearer token.")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.Unauthorized("Authorization must be a Bearer token.")
    return token.strip()


def user_from_header(
    header: str | None,
    secret: str,
    *,
    issuer: str | None = None,
    audience: str | None = None,
    max_ttl_s: float = MAX_TOKEN_TTL_S,
) -> str:
    """The user id (``sub``) of a valid token; Unauthorized otherwise."""
    policy = JwtPolicy(secret, issuer or None, audience or None, max_ttl_s)
    return policy.verify(_bearer(header))[0]


@dataclass(frozen=True, slots=True)
class JwtPolicy:
    """What a user token must satisfy: HS256 with ``secret``, ``sub`` and ``exp``, and ``iss`` /
    ``aud`` equal to the configured values when those are set (a token that carries an ``aud``
    is refused when no audience is configured: it was meant for someone else), and a lifetime
    of at most ``max_ttl_s``."""

    secret: str
    issuer: str | None = None
    audience: str | None = None
    max_ttl_s: float = MAX_TOKEN_TTL_S

    def verify(self, token: str) -> tuple[str, int]:
        """(sub, exp) of a valid token.

        ``nbf`` and ``iat`` are honoured when present, with ``LEEWAY_S`` of tolerance for an
        issuer whose clock runs ahead of ours. ``exp`` gets none: a token is never accepted
        after its stated expiry, so a verified token can be cached until exactly ``exp``.

        The lifetime is ``exp - iat``; a token without ``iat`` is judged by what is left of it,
        ``exp - now`` (with the same leeway). Either way a token accepted now is valid for at
        most ``max_ttl_s`` more, which only shrinks while it sits in a cache."""
        required = ["sub", "exp"]
        if self.issuer is not None:
            required.append("iss")
        if self.audience is not None:
            required.append("aud")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self.secret,
                algorithms=[ALGORITHM],  # pinned: "none" and algorithm confusion are refused
                issuer=self.issuer,
                audience=self.audience,
                # The times are checked below, as numbers: pyjwt takes whatever int() takes,
                # a string "1796..." or a boolean among them.
                options={
                    "require": required,
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except (jwt.PyJWTError, ValueError, TypeError, OverflowError) as exc:
            raise errors.Unauthorized("The token is invalid.") from exc
        exp, nbf, iat = (_numeric_date(claims, name) for name in ("exp", "nbf", "iat"))
        assert exp is not None  # required
        now = time.time()
        if exp <= now:  # no leeway: a verified token can be cached until exactly exp
            raise errors.Unauthorized("The token has expired.")
        if (nbf is not None and nbf > now + LEEWAY_S) or (iat is not None and iat > now + LEEWAY_S):
            raise errors.Unauthorized("The token is not valid yet.")
        self._check_lifetime(iat, exp, now)
        sub = claims.get("sub")
        if not isinstance(sub, str) or not 0 < len(sub) <= MAX_USER_ID_LEN or not sub.isprintable():
            raise errors.Unauthorized("The token's subject is not a valid user id.")
        return sub, math.floor(exp)  # a cache keeps it until exp at the latest

    def _check_lifetime(self, iat: float | None, exp: float, now: float) -> None:
        # An ``iat`` lies no later than now plus the leeway, so the remaining lifetime is
        # bounded by the stated one.
        if iat is not None:
            too_long = exp - iat > self.max_ttl_s
        else:
            too_long = exp - now > self.max_ttl_s + LEEWAY_S
        if too_long:
            raise errors.Unauthorized(
                f"The token's lifetime is longer than the {self.max_ttl_s:g} s allowed."
            )


class TokenCache:
    """Verified tokens, so a client's every request does not pay for HMAC and JSON parsing
    again. A hit is still checked against the token's expiry; bounded, oldest evicted.

    The key is the token itself: everything else verification depends on (secret, issuer,
    audience, maximum lifetime) is fixed for the cache's lifetime, and a token's own ``nbf``
    lies in the past once it has been verified, so the one thing that can change a verdict is
    ``exp``."""

    def __init__(
        self,
        secret: str,
        max_entries: int = 10_000,
        *,
        issuer: str | None = None,
        audience: str | None = None,
        max_ttl_s: float = MAX_TOKEN_TTL_S,
    ) -> None:
        self._policy = JwtPolicy(secret, issuer or None, audience or None, max_ttl_s)
        self._max = max_entries
        self._entries: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def user(self, header: str | None) -> str:
        token = _bearer(header)
        hit = self._entries.get(token)
        if hit is not None:
            if hit[1] > time.time():
                return hit[0]
            del self._entries[token]
        sub, exp = self._policy.verify(token)
        self._entries[token] = (sub, exp)
        if len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return sub


def require_bearer(header: str | None, expected: str, message: str) -> None:
    """Unauthorized unless the header carries exactly ``expected`` (compared in constant time;
    an empty ``expected`` admits nobody)."""
    token = _bearer(header)
    if not expected or not hmac.compare_digest(token.encode(), expected.encode()):
        raise errors.Unauthorized(message)


def require_admin(header: str | None, admin_token: str) -> None:
    require_bearer(header, admin_token, "Admin credentials required.")


def mint_token(
    user_id: str,
    secret: str,
    ttl_s: int = TOKEN_TTL_S,
    *,
    issuer: str | None = None,
    audience: str | None = None,
) -> str:
    """A token for local use (``analysis-queue token USER``) and tests; it carries ``iss`` and
    ``aud`` when given (the service requires them when ``AQ_JWT_ISSUER`` / ``AQ_JWT_AUDIENCE``
    are set)."""
    now = int(time.time())
    claims: dict[str, Any] = {"sub": user_id, "iat": now, "nbf": now, "exp": now + ttl_s}
    if issuer:
        claims["iss"] = issuer
    if audience:
        claims["aud"] = audience
    return jwt.encode(claims, secret, algorithm=ALGORITHM)
