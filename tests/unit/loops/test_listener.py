"""The listener turns a notification into a typed notice for its users, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass, field

from analysis_queue.loops.listener import Listener, ListenerSettings
from analysis_queue.metrics import Metrics
from analysis_queue.models import ChangeNotice


@dataclass
class _Target:
    direct_dsn: str = "postgresql://nowhere/aq"
    application_name: str = "test"
    backend_pids: set[int] = field(default_factory=lambda: {41, 42})


def _listener() -> tuple[Listener, list[tuple[ChangeNotice, bool]], Metrics]:
    heard: list[tuple[ChangeNotice, bool]] = []
    metrics = Metrics()
    listener = Listener(
        _Target(),
        ListenerSettings(),
        metrics,
        on_notice=lambda notice, own: heard.append((notice, own)),
    )
    return listener, heard, metrics


def _count(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_a_notification_is_a_notice_for_its_users_and_whether_it_was_our_own() -> None:
    listener, heard, metrics = _listener()
    listener.handle_payload('{"v": 2, "at": 1.5, "u": {"bob": 0, "alice": 1}}', sender_pid=7)
    listener.handle_payload('{"v": 2, "u": {"carol": 1}, "later": "ignored"}', sender_pid=42)
    (first, first_own), (second, second_own) = heard
    assert first.users == {"bob": 0, "alice": 1} and first.wakes() == ["alice"]
    assert not first_own, "another process committed it"
    assert second.wakes() == ["carol"] and second_own, "one of this instance's connections"
    assert _count(metrics, "aq_notifications_total") == 2
    assert _count(metrics, "aq_notification_lag_seconds_count") == 1  # only the one with "at"


def test_an_overflowing_notification_says_so() -> None:
    listener, heard, _ = _listener()
    listener.handle_payload('{"v": 2, "at": 1.0, "overflow": true}')
    ((notice, own),) = heard
    assert notice.overflow and notice.users == {} and not own


def test_an_unreadable_notification_is_counted_and_dropped() -> None:
    listener, heard, metrics = _listener()
    for payload in ("not json", '{"u": ["a list"]}', '{"u": {"x": "yes"}}'):
        listener.handle_payload(payload)
    assert heard == []
    assert _count(metrics, "aq_notifications_total") == 3
