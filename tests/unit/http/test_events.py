"""GET /v1/events: which Last-Event-ID it resumes after."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from analysis_queue.http.events import _last_event_id


@pytest.mark.parametrize(
    ("header", "query", "expected"),
    [
        (None, None, None),
        ("17", None, 17),
        (" 17 ", None, 17),
        (None, "5", 5),
        ("0", None, 0),
        ("-1", None, None),
        ("1e3", None, None),
        ("abc", None, None),
        (str(2**63), None, None),
        ("٣", None, None),  # a decimal digit that is not ASCII
    ],
)
def test_last_event_id_is_a_non_negative_integer_or_nothing(
    header: str | None, query: str | None, expected: int | None
) -> None:
    path = "/v1/events" + (f"?last_event_id={query}" if query is not None else "")
    headers = {"Last-Event-ID": header} if header is not None else {}
    assert _last_event_id(make_mocked_request("GET", path, headers=headers)) == expected
