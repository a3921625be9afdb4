"""User tokens: ``nbf`` / ``iat`` with clock-skew leeway, ``exp`` without, optional issuer and
audience, minting (library and CLI) and the verified-token cache under those settings."""

from __future__ import annotations

import json
import time
from typing import Any

import jwt
import pytest
from analysis_queue import cli, errors
from analysis_queue.http.auth import LEEWAY_S, JwtPolicy, TokenCache, mint_token, user_from_header

SECRET = "unit-secret-0123456789abcdef0123456789"
ISSUER = "https://idp.uni.example"
AUDIENCE = "analysis-queue"


def _token(secret: str = SECRET, **claims: Any) -> str:
    now = int(time.time())
    payload: dict[str, Any] = {"sub": "alice", "exp": now + 600, **claims}
    return jwt.encode({k: v for k, v in payload.items() if v is not None}, secret, "HS256")


def _user(token: str, **policy: str | None) -> str:
    return user_from_header(f"Bearer {token}", SECRET, **policy)


def test_not_before_is_honoured_with_leeway_for_clock_skew() -> None:
    now = int(time.time())
    assert _user(_token(nbf=now - 5)) == "alice"
    assert _user(_token(nbf=now + LEEWAY_S - 5)) == "alice"  # issuer's clock a little ahead
    with pytest.raises(errors.Unauthorized, match="not valid yet"):
        _user(_token(nbf=now + LEEWAY_S + 60))
    with pytest.raises(errors.Unauthorized):
        _user(_token(nbf="tomorrow"))


def test_issued_in_the_future_is_refused_beyond_the_leeway() -> None:
    now = int(time.time())
    assert _user(_token(iat=now + LEEWAY_S - 5)) == "alice"
    with pytest.raises(errors.Unauthorized):
        _user(_token(iat=now + LEEWAY_S + 60))


def test_expiry_gets_no_leeway() -> None:
    """A token is never accepted after its stated ``exp``, not even within the skew leeway."""
    now = int(time.time())
    for exp in (now - 1, now - LEEWAY_S // 2, now - LEEWAY_S - 1):
        with pytest.raises(errors.Unauthorized, match="expired"):
            _user(_token(exp=exp))


@pytest.mark.parametrize("exp", ["soon", 1e400, None, [1]])
def test_malformed_or_missing_exp_is_refused(exp: Any) -> None:
    with pytest.raises(errors.Unauthorized):
        _user(_token(exp=exp))  # None: no exp at all


def test_issuer_is_required_when_configured() -> None:
    policy = {"issuer": ISSUER}
    assert _user(_token(iss=ISSUER), **policy) == "alice"
    for wrong in (None, "https://evil.example", ""):
        with pytest.raises(errors.Unauthorized):
            _user(_token(iss=wrong), **policy)
    # Not configured: an iss is not checked.
    assert _user(_token(iss="https://anyone.example")) == "alice"


def test_audience_is_required_when_configured() -> None:
    policy = {"audience": AUDIENCE}
    assert _user(_token(aud=AUDIENCE), **policy) == "alice"
    assert _user(_token(aud=["other", AUDIENCE]), **policy) == "alice"
    for wrong in (None, "other-service", ["other-service"]):
        with pytest.raises(errors.Unauthorized):
            _user(_token(aud=wrong), **policy)
    # Not configured: a token addressed to some audience was meant for someone else.
    with pytest.raises(errors.Unauthorized):
        _user(_token(aud="other-service"))


def test_empty_settings_mean_unset() -> None:
    assert _user(_token(), issuer="", audience="") == "alice"
    assert JwtPolicy(SECRET).verify(_token())[0] == "alice"


def test_minted_tokens_carry_issuer_and_audience_and_pass() -> None:
    token = mint_token("bob", SECRET, issuer=ISSUER, audience=AUDIENCE)
    claims = jwt.decode(token, SECRET, algorithms=["HS256"], audience=AUDIENCE)
    assert (claims["iss"], claims["aud"], claims["sub"]) == (ISSUER, AUDIENCE, "bob")
    assert claims["nbf"] <= time.time() < claims["exp"]
    assert _user(token, issuer=ISSUER, audience=AUDIENCE) == "bob"
    plain = mint_token("bob", SECRET)
    assert "iss" not in jwt.decode(plain, SECRET, algorithms=["HS256"])
    with pytest.raises(errors.Unauthorized):
        _user(plain, issuer=ISSUER)


def test_cli_token_follows_the_issuer_and_audience_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AQ_JWT_SECRET", SECRET)
    monkeypatch.setenv("AQ_ADMIN_TOKEN", "admin")
    monkeypatch.setenv("AQ_CORE_CALLBACK_SECRET", "callback")
    monkeypatch.setenv("AQ_JWT_ISSUER", ISSUER)
    monkeypatch.setenv("AQ_JWT_AUDIENCE", AUDIENCE)

    assert cli.main(["token", "carol", "--ttl", "60"]) == 0

    token = capsys.readouterr().out.strip()
    assert TokenCache(SECRET, issuer=ISSUER, audience=AUDIENCE).user(f"Bearer {token}") == "carol"
    with pytest.raises(errors.Unauthorized):
        TokenCache(SECRET).user(f"Bearer {token}")  # it has an aud nobody configured here


def test_cache_verifies_issuer_and_audience_before_caching() -> None:
    cache = TokenCache(SECRET, issuer=ISSUER, audience=AUDIENCE)
    good = mint_token("dave", SECRET, issuer=ISSUER, audience=AUDIENCE)
    wrong_iss = mint_token("dave", SECRET, issuer="https://evil.example", audience=AUDIENCE)
    wrong_aud = mint_token("dave", SECRET, issuer=ISSUER, audience="other")
    for bad in (wrong_iss, wrong_aud, mint_token("dave", SECRET)):
        for _ in range(2):
            with pytest.raises(errors.Unauthorized):
                cache.user(f"Bearer {bad}")
    assert not cache._entries
    assert cache.user(f"Bearer {good}") == "dave"
    assert cache.user(f"Bearer {good}") == "dave"  # a hit
    assert list(cache._entries) == [good]


def test_cache_does_not_admit_a_token_before_its_nbf() -> None:
    cache = TokenCache(SECRET)
    early = _token(nbf=int(time.time()) + LEEWAY_S + 60)
    for _ in range(2):
        with pytest.raises(errors.Unauthorized):
            cache.user(f"Bearer {early}")
    assert not cache._entries


# -- maximum lifetime (AQ_JWT_MAX_TTL_S) ----------------------------------------------------------


def test_a_lifetime_longer_than_the_maximum_is_refused() -> None:
    now = int(time.time())
    day = 24 * 3600
    assert _user(_token(iat=now, exp=now + day)) == "alice"  # exactly the maximum
    for claims in (
        {"iat": now, "exp": now + day + 1},
        {"iat": now, "exp": 10**30},  # valid "for ever"
        {"iat": now - 29 * day, "exp": now + 60},  # a 29-day token, nearly spent: still refused
    ):
        with pytest.raises(errors.Unauthorized, match="lifetime"):
            _user(_token(**claims))


def test_without_iat_what_is_left_of_the_token_counts() -> None:
    now = int(time.time())
    day = 24 * 3600
    assert _user(_token(exp=now + day)) == "alice"
    assert _user(_token(exp=now + day + LEEWAY_S - 5)) == "alice"  # an issuer's clock ahead
    for exp in (now + day + LEEWAY_S + 60, 10**30):
        with pytest.raises(errors.Unauthorized, match="lifetime"):
            _user(_token(exp=exp))


def test_a_configured_maximum_applies_to_verification_and_the_cache() -> None:
    now = int(time.time())
    hour_token = _token(iat=now, exp=now + 3600)
    with pytest.raises(errors.Unauthorized, match="lifetime"):
        JwtPolicy(SECRET, max_ttl_s=600).verify(hour_token)
    assert JwtPolicy(SECRET, max_ttl_s=3600).verify(hour_token)[0] == "alice"
    cache = TokenCache(SECRET, max_ttl_s=600)
    for _ in range(2):
        with pytest.raises(errors.Unauthorized, match="lifetime"):
            cache.user(f"Bearer {hour_token}")
    assert not cache._entries
    week = 7 * 24 * 3600
    assert TokenCache(SECRET, max_ttl_s=week).user(f"Bearer {mint_token('a', SECRET, week)}")


def _cli_env(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    monkeypatch.setenv("AQ_JWT_SECRET", SECRET)
    monkeypatch.setenv("AQ_ADMIN_TOKEN", "admin")
    monkeypatch.setenv("AQ_CORE_CALLBACK_SECRET", "callback")
    for name, value in extra.items():
        monkeypatch.setenv(name, value)


def test_cli_token_cannot_be_minted_past_the_maximum(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_env(monkeypatch)
    assert cli.main(["token", "carol", "--ttl", str(24 * 3600 + 1)]) == cli.EXIT_USAGE
    out = capsys.readouterr()
    assert out.out == ""
    assert "--ttl" in out.err and "AQ_JWT_MAX_TTL_S" in out.err and "86400" in out.err
    assert cli.main(["token", "carol", "--ttl", "0"]) == cli.EXIT_USAGE
    capsys.readouterr()

    assert cli.main(["token", "carol"]) == 0  # the default lifetime is within the maximum
    token = capsys.readouterr().out.strip()
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert claims["exp"] - claims["iat"] == 24 * 3600
    assert TokenCache(SECRET).user(f"Bearer {token}") == "carol"


def test_cli_token_follows_a_shorter_maximum(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_env(monkeypatch, AQ_JWT_MAX_TTL_S="600")
    assert cli.main(["token", "carol"]) == 0
    claims = jwt.decode(capsys.readouterr().out.strip(), SECRET, algorithms=["HS256"])
    assert claims["exp"] - claims["iat"] == 600
    assert cli.main(["token", "carol", "--ttl", "601"]) == cli.EXIT_USAGE
    assert "600" in capsys.readouterr().err


# -- the times are numbers (RFC 7519 NumericDate) -------------------------------------------------


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
@pytest.mark.parametrize(
    "value",
    [
        pytest.param(lambda now: str(now + 60), id="a-string-of-digits"),
        pytest.param(lambda now: True, id="true"),
        pytest.param(lambda now: False, id="false"),
        pytest.param(lambda now: float("inf"), id="infinity"),
        pytest.param(lambda now: float("nan"), id="nan"),
        pytest.param(lambda now: 10**400, id="beyond-a-float"),
        pytest.param(lambda now: [now], id="a-list"),
    ],
)
def test_a_time_claim_that_is_not_a_finite_number_is_refused_by_name(
    claim: str, value: Any
) -> None:
    """A string of digits is what pyjwt would take (it calls int()); booleans are ints to
    Python; non-finite floats are what Python's JSON parser reads for Infinity and NaN."""
    now = int(time.time())
    claims = {"exp": now + 600, "iat": now - 5, "nbf": now - 5, claim: value(now)}
    payload = json.dumps({"sub": "alice", **claims}).encode()  # allows Infinity and NaN
    token = jwt.api_jws.encode(payload, SECRET, algorithm="HS256")
    with pytest.raises(errors.Unauthorized, match=f"{claim} claim must be a finite number"):
        _user(token)


def test_time_claims_may_be_integers_or_finite_fractions() -> None:
    now = time.time()
    assert _user(_token(exp=now + 600.5, iat=now - 0.25, nbf=now - 1.5)) == "alice"
    with pytest.raises(errors.Unauthorized, match="expired"):
        _user(_token(exp=now - 0.5))
    with pytest.raises(errors.Unauthorized, match="lifetime"):
        _user(_token(exp=1e300))  # finite, and valid "for ever"
