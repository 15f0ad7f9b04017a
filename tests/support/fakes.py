"""Test support: the clock and the key-value store the watchdog's tests move and read by hand."""

from __future__ import annotations

import json


class Clock:
    """A monotonic clock the test moves (``clock.now += s``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class KV(dict):
    """A stand-in for :class:`respo_verl.run.watchdog.Records`: the records as JSON, in this process."""

    def put(self, name, value):
        self[name] = json.loads(json.dumps(value))

    def delete(self, name):
        self.pop(name, None)
