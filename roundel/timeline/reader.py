"""Load a Chrome-trace timeline, complete or cut short by a killed job."""

from __future__ import annotations

import json


def load(path: str) -> list[dict]:
    """The events of the timeline at ``path``, in file order.

    Accepts a complete JSON array and a file whose writer was killed: a
    missing closing bracket, a trailing comma and a last event cut mid-line
    are tolerated (events up to the last complete one are returned). Raises
    ValueError when the file is not a timeline at all.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        events = json.loads(text)
    except json.JSONDecodeError:
        return _load_partial(path, text)
    if isinstance(events, dict):  # the {"traceEvents": [...]} form
        events = events.get("traceEvents", [])
    if not isinstance(events, list):
        raise ValueError(f"{path} is not a Chrome-trace timeline (expected a JSON array of events)")
    return events


def _load_partial(path: str, text: str) -> list[dict]:
    body = text.lstrip()
    if not body.startswith("["):
        raise ValueError(f"{path} is not a Chrome-trace timeline: it does not start with '['")
    decoder = json.JSONDecoder()
    events, pos = [], body.index("[") + 1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(body) or body[pos] == "]":
            return events
        try:
            event, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return events  # the last event was cut short
        events.append(event)
