"""FakeDevice: what an accelerator looks like to ``gyre_jax.planner.check_local`` (platform, kind, memory)
on a host that has none, so the planner's handling of kinds its table lacks is testable on CPU."""
from __future__ import annotations


class FakeDevice:
    def __init__(self, device_kind: str, bytes_limit: int | None, platform: str = "gpu"):
        self.device_kind, self.platform, self._limit = device_kind, platform, bytes_limit

    def memory_stats(self):
        return {"bytes_limit": self._limit} if self._limit else None  # as jax.Device: None when it reports none
