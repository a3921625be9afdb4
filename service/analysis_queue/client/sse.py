"""A Server-Sent Events parser, fed the stream's bytes as they arrive (the WHATWG "event
stream interpretation": lines end in CRLF, LF or CR; ``data`` lines join with LF; a blank line
dispatches; comments start with a colon; ``retry`` is the reconnection time in ms; ``id``
persists from one event to the next). Bounded: a line or an event larger than ``max_bytes``
is a :class:`~analysis_queue.client.errors.ProtocolError`, never unbounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from analysis_queue.client.errors import ProtocolError

MAX_EVENT_BYTES = 16 << 20  # the service's largest frame (a snapshot) is well under 1 MiB
_BOM = "\ufeff"


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str  # "message" when the frame names none
    data: str
    last_event_id: str  # the last ``id`` seen, this frame's or an earlier one's


class SseParser:
    def __init__(self, max_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.retry_ms: int | None = None  # the last ``retry`` the stream sent
        self.last_event_id = ""
        self._buffer = b""
        self._data: list[str] = []
        self._data_bytes = 0
        self._event = ""
        self._started = False
        # The last chunk ended in a CR: an LF that starts the next one belongs to it (CRLF).
        self._after_cr = False

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events that ``chunk`` completes, in order."""
        if not chunk:
            return []
        buf = self._buffer + chunk if self._buffer else chunk
        events: list[SseEvent] = []
        pos = 0
        if self._after_cr and buf[:1] == b"\n":
            pos = 1  # the LF of a CRLF that the last chunk ended inside
        self._after_cr = False
        while True:
            found = self._line_end(buf, pos)
            if found is None:
                break
            end, skip = found
            self._after_cr = end + skip == len(buf) and buf[end : end + 1] == b"\r"
            event = self._line(self._decode(buf[pos:end]))
            if event is not None:
                events.append(event)
            pos = end + skip
        self._buffer = buf[pos:]
        if len(self._buffer) > self.max_bytes:
            raise ProtocolError(f"an event stream line is longer than {self.max_bytes} bytes")
        return events

    @staticmethod
    def _line_end(buf: bytes, pos: int) -> tuple[int, int] | None:
        """Where the line starting at ``pos`` ends and how long its terminator is; None if it
        is not complete yet."""
        lf = buf.find(b"\n", pos)
        # CR only before the next LF: scanning to the end for each line would be quadratic.
        cr = buf.find(b"\r", pos, len(buf) if lf == -1 else lf)
        if cr == -1 and lf == -1:
            return None
        if cr != -1 and (lf == -1 or cr < lf):
            return cr, 2 if buf[cr + 1 : cr + 2] == b"\n" else 1
        return lf, 1

    def _decode(self, raw: bytes) -> str:
        line = raw.decode("utf-8", errors="replace")
        if not self._started:
            self._started = True
            line = line.removeprefix(_BOM)
        return line

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment (the service's keepalive)
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_bytes += len(value) + 1
            if self._data_bytes > self.max_bytes:
                raise ProtocolError(f"an event stream event is larger than {self.max_bytes} bytes")
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self.last_event_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self.retry_ms = int(value)
        return None

    def _dispatch(self) -> SseEvent | None:
        data, event = self._data, self._event
        self._data, self._data_bytes, self._event = [], 0, ""
        if not data:
            return None
        return SseEvent(event or "message", "\n".join(data), self.last_event_id)
