"""AQ_JWT_ISSUER / AQ_JWT_AUDIENCE reach the running service: tokens must carry them; and
AQ_JWT_MAX_TTL_S: a token that claims a longer lifetime is refused."""

from __future__ import annotations

import asyncio

import pytest
from analysis_queue.http.auth import mint_token
from support import JWT_SECRET, Harness

ISSUER = "https://idp.uni.example"
AUDIENCE = "analysis-queue"


@pytest.mark.parametrize(
    ("issuer", "audience", "accepted"),
    [
        (ISSUER, AUDIENCE, True),
        (None, None, False),
        (ISSUER, None, False),
        (None, AUDIENCE, False),
        ("https://evil.example", AUDIENCE, False),
        (ISSUER, "another-service", False),
    ],
    ids=["both", "neither", "no_aud", "no_iss", "wrong_iss", "wrong_aud"],
)
async def test_configured_issuer_and_audience_are_required(
    harness: Harness, issuer: str | None, audience: str | None, accepted: bool
) -> None:
    h = harness
    instance = await h.start_instance(jwt_issuer=ISSUER, jwt_audience=AUDIENCE)
    await asyncio.wait_for(instance.services.sweeper.pass_done.wait(), 10)
    token = mint_token("u", JWT_SECRET, issuer=issuer, audience=audience)

    async with h.http.get(
        f"{instance.base_url}/v1/credits", headers={"Authorization": f"Bearer {token}"}
    ) as r:
        body = await r.json(content_type=None)

    if accepted:
        assert (r.status, body) == (200, {"balance": 0, "held": 0})
    else:
        assert (r.status, r.content_type, body["code"]) == (
            401,
            "application/problem+json",
            "unauthorized",
        )


async def test_configured_maximum_lifetime_is_enforced(harness: Harness) -> None:
    h = harness
    instance = await h.start_instance(jwt_max_ttl_s=600)
    statuses = []
    for ttl_s in (600, 601, 3600):
        token = mint_token("u", JWT_SECRET, ttl_s=ttl_s)
        async with h.http.get(
            f"{instance.base_url}/v1/credits", headers={"Authorization": f"Bearer {token}"}
        ) as r:
            body = await r.json(content_type=None)
            statuses.append((r.status, body.get("code")))
    assert statuses == [(200, None), (401, "unauthorized"), (401, "unauthorized")]
