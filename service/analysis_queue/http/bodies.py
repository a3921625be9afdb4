"""Request bodies: pydantic models that forbid unknown fields and bound every size.

The edge checks what a request must look like before anything reaches Core or the database:
sizes, no control characters in any string, every source a DOI or an http(s) URL, the thesis
document an http(s) URL. Core still has the last word on content (does the DOI exist, can the
document be parsed) and refuses at create time with its own codes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticCustomError

MAX_SOURCES = 200
MAX_TEXT_CHARS = 500
MAX_URL_CHARS = 2000
MAX_USER_ID_CHARS = 200

# C0, DEL and C1: no string the API stores or forwards may carry them (header and log
# injection, NUL bytes PostgreSQL refuses, terminal escapes in whoever reads the data).
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
NO_CONTROL_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"
# ``10.<4-9 digits>/<suffix>``, optionally written ``doi:…`` or ``https://doi.org/…`` (the latter
# is an http(s) URL anyway). Core applies the same rule (we insist on ASCII digits).
DOI = re.compile(r"(?:doi:|https://doi\.org/)?10\.[0-9]{4,9}/\S+", re.IGNORECASE)
# What the OpenAPI document tells clients (and fuzzers) a source looks like. The validators
# below are the authority; this pattern only describes them.
_VISIBLE = r"[^\s\x00-\x1f\x7f-\x9f]"
URL_PATTERN = rf"^[hH][tT][tT][pP][sS]?://[^\s\x00-\x1f\x7f-\x9f/?#]+{_VISIBLE}*$"
SOURCE_PATTERN = rf"^(?:(?:[dD][oO][iI]:)?10\.[0-9]{{4,9}}/{_VISIBLE}+|{URL_PATTERN[1:-1]})$"


def _no_control(value: str) -> str:
    if CONTROL_CHARS.search(value):
        raise PydanticCustomError("control_characters", "must not contain control characters")
    return value


def is_http_url(value: str) -> bool:
    """An absolute http(s) URL with a host (and a well-formed port, if any), no whitespace."""
    if any(ch.isspace() for ch in value) or CONTROL_CHARS.search(value):
        return False
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises on a malformed port
    except ValueError:
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)


def is_source(value: str) -> bool:
    return DOI.fullmatch(value) is not None or is_http_url(value)


def _http_url(value: str) -> str:
    if not is_http_url(value):
        raise PydanticCustomError("invalid_url", "must be an http(s) URL with a host")
    return value


def _source(value: str) -> str:
    if not is_source(value):
        raise PydanticCustomError(
            "invalid_source", "must be a DOI (10.NNNN/suffix) or an http(s) URL with a host"
        )
    return value


def _described(**schema: Any) -> Any:
    return Field(json_schema_extra=schema)


Text = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_TEXT_CHARS),
    AfterValidator(_no_control),
    _described(pattern=NO_CONTROL_PATTERN),
]
Url = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_URL_CHARS),
    AfterValidator(_no_control),
    AfterValidator(_http_url),
    _described(pattern=URL_PATTERN),
]
Source = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_URL_CHARS),
    AfterValidator(_no_control),
    AfterValidator(_source),
    _described(
        pattern=SOURCE_PATTERN,
        description="A DOI (`10.NNNN/suffix`, optionally `doi:` or `https://doi.org/` "
        "prefixed) or an http(s) URL.",
        examples=["10.1000/xyz123", "https://journal.example/article/7"],
    ),
]
UserId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_USER_ID_CHARS),
    AfterValidator(_no_control),
    _described(pattern=r"^[^\x00-\x1f\x7f-\x9f]+$"),
]
Note = Annotated[
    str,
    StringConstraints(max_length=MAX_TEXT_CHARS),
    AfterValidator(_no_control),
    _described(pattern=NO_CONTROL_PATTERN),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Thesis(_Strict):
    title: Text
    document_url: Url


class AnalysisRequest(_Strict):
    thesis: Thesis
    sources: list[Source] = Field(min_length=1, max_length=MAX_SOURCES)


class RecheckRequest(_Strict):
    sources: list[Source] = Field(min_length=1, max_length=MAX_SOURCES)


class CreditGrant(_Strict):
    user_id: UserId
    amount: int = Field(gt=0, le=1_000_000)
    note: Note | None = None


MAX_USER_LIMIT = 100  # the database's bound (user_limits.max_running)


class UserLimitRequest(_Strict):
    """A user's plan: how many of their analyses may run at once; null restores the default."""

    max_running: int | None = Field(ge=1, le=MAX_USER_LIMIT)
