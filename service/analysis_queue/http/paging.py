"""Cursor pagination of a user's jobs: ``?limit=`` and an opaque ``next`` cursor.

Pages are a keyset on ``queue_seq`` (newest first), which each admit draws under its user's
lock: a job admitted while a client pages sorts before its first page and never shifts a later
one, so following ``next`` visits every job that existed when paging began exactly once. The
cursor is opaque to clients (they send back what they got); it is the seq of the last job of
the page, versioned so that its format can change.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass

from multidict import MultiMapping

from analysis_queue import errors
from analysis_queue.models import JobSummary

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
_PREFIX = "q1:"
_SEQ = re.compile(r"[0-9]{1,19}")
_LIMIT = re.compile(r"[0-9]{1,4}")


@dataclass(frozen=True, slots=True)
class PageRequest:
    before_seq: int | None  # None: from the newest
    limit: int


def encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"{_PREFIX}{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise _invalid("cursor", "is not a cursor this service gave out") from exc
    seq = raw.removeprefix(_PREFIX)
    if seq == raw or _SEQ.fullmatch(seq) is None or int(seq) >= 2**63:
        raise _invalid("cursor", "is not a cursor this service gave out")
    return int(seq)


def page_request(query: MultiMapping[str]) -> PageRequest:
    """``?limit=`` (1..MAX_LIMIT, default DEFAULT_LIMIT) and ``?cursor=`` of a list request."""
    raw_limit = query.get("limit")
    limit = DEFAULT_LIMIT
    if raw_limit is not None:
        if _LIMIT.fullmatch(raw_limit) is None or not 1 <= int(raw_limit) <= MAX_LIMIT:
            raise _invalid("limit", f"must be a whole number from 1 to {MAX_LIMIT}")
        limit = int(raw_limit)
    cursor = query.get("cursor")
    return PageRequest(decode_cursor(cursor) if cursor else None, limit)


def split_page(rows: Sequence[JobSummary], limit: int) -> tuple[Sequence[JobSummary], str | None]:
    """A page read with ``limit + 1`` rows: the page, and the cursor of the next one (None
    when this is the last)."""
    if len(rows) <= limit:
        return rows, None
    page = rows[:limit]
    return page, encode_cursor(page[-1].queue_seq)


def _invalid(field: str, message: str) -> errors.InvalidParameter:
    return errors.InvalidParameter(
        f"The query parameter {field} {message}.", errors=[{"field": field, "message": message}]
    )
