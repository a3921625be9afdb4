"""The verified-token cache must never outlive a token or accept what verification refuses."""

from __future__ import annotations

import time

import jwt
import pytest
from analysis_queue import errors
from analysis_queue.http.auth import TokenCache, mint_token

SECRET = "unit-secret-0123456789abcdef0123456789"


def test_cached_token_still_expires() -> None:
    cache = TokenCache(SECRET)
    now = int(time.time())
    token = jwt.encode({"sub": "u", "exp": now + 1}, SECRET, algorithm="HS256")
    assert cache.user(f"Bearer {token}") == "u"
    assert cache.user(f"Bearer {token}") == "u"  # a hit
    time.sleep(max(0.0, now + 1.05 - time.time()))  # the token's real expiry passes
    with pytest.raises(errors.Unauthorized):
        cache.user(f"Bearer {token}")


def test_refused_tokens_are_not_cached() -> None:
    cache = TokenCache(SECRET)
    bad = mint_token("u", "another-secret-0123456789abcdef0123")
    for _ in range(2):
        with pytest.raises(errors.Unauthorized):
            cache.user(f"Bearer {bad}")
    assert not cache._entries


def test_cache_is_bounded() -> None:
    cache = TokenCache(SECRET, max_entries=3)
    tokens = [mint_token(f"u{i}", SECRET) for i in range(5)]
    for i, token in enumerate(tokens):
        assert cache.user(f"Bearer {token}") == f"u{i}"
    assert len(cache._entries) == 3
    assert list(cache._entries) == tokens[2:]
