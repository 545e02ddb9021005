"""What the proxy knows of each rollout's calls, so identity conflicts are refused BEFORE generation.

The store refuses a record that breaks its cross-record rules (a second call N, a task id
that changes within a rollout, a call after the outcome), but only when the call is
recorded, after the model generated it: wasted compute and a 500 to the harness. The
ledger holds, per (run, rollout), the task and group it belongs to, the call numbers
recorded or in flight and whether its outcome is recorded, loaded once from the store on
first sight (so a server restarted on the same store still knows), and ``claim`` answers
409 for a conflict before any token is generated.

Memory: an entry is only a cache of what the store holds (plus the calls in flight), so it
is dropped when its rollout ends (``forget``, on key revocation; at once if no call is in
flight, else when the last one ends), and beyond ``max_entries`` the least recently used
idle entries are dropped too (rollouts bound by headers or plain keys are never revoked).
A dropped rollout that calls again is loaded from the store as on first sight. A sink
that cannot be read back (no ``calls``) keeps every entry: nothing else would remember.
"""
from __future__ import annotations

import collections
import dataclasses

from gyre_jax.serving.api_common import ApiError
from gyre_jax.serving.proxy_identity import Binding


@dataclasses.dataclass
class _Rollout:
    task_id: str | None
    group_id: str | None
    recorded: set
    in_flight: set
    finished: bool
    next_call: int
    forgotten: bool = False  # its rollout ended: dropped when its last call in flight ends


def conflict(message: str) -> ApiError:
    return ApiError(409, message, kind="invalid_request_error")


class CallLedger:
    def __init__(self, sink, *, max_entries: int = 4096):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"CallLedger: max_entries must be a positive int, got {max_entries!r}")
        self.sink, self.max_entries = sink, max_entries
        self._reloadable = hasattr(sink, "calls")
        self._rollouts: collections.OrderedDict[tuple[str, str], _Rollout] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._rollouts)

    def _load(self, run_id: str, rollout_id: str) -> _Rollout:
        key = (run_id, rollout_id)
        r = self._rollouts.get(key)
        if r is not None:
            r.forgotten = False  # called again (e.g. a header-bound rollout): it is live
            self._rollouts.move_to_end(key)
            return r
        self._evict()
        calls, finished = [], False
        if getattr(self.sink, "run_id", run_id) == run_id and hasattr(self.sink, "calls"):
            try:
                calls = self.sink.calls(rollout_id)
                outcome = getattr(self.sink, "outcome", None)
                finished = outcome is not None and outcome(rollout_id) is not None
            except KeyError:  # nothing stored for it yet
                calls = []
        first = calls[0] if calls else None
        recorded = {c.call_index for c in calls}
        r = self._rollouts[key] = _Rollout(
            task_id=first.task_id if first else None, group_id=first.group_id if first else None,
            recorded=recorded, in_flight=set(), finished=finished, next_call=1 + max(recorded, default=-1))
        return r

    def claim(self, b: Binding, n: int) -> Binding:
        """``b`` with its call number (the rollout's next ``n`` if it named none), its numbers
        marked in flight; raises 409 if the call conflicts with what the rollout already has."""
        r = self._load(b.run_id, b.rollout_id)
        where = f"rollout {b.rollout_id!r}"
        if r.finished:
            raise conflict(f"{where} is finished (its outcome is recorded); no call is recorded after it")
        for what, have, got in (("task", r.task_id, b.task_id), ("group", r.group_id, b.group_id)):
            if have is not None and have != got:
                raise conflict(f"{where} belongs to {what} {have!r}, this call says {got!r}")
        first = r.next_call if b.call_index is None else b.call_index
        b = dataclasses.replace(b, call_index=first)
        numbers = range(first, first + n)
        if b.attempt == 0:  # a first attempt: its number must be new (a retry says X-Gyre-Attempt > 0)
            for i in numbers:
                if i in r.recorded or i in r.in_flight:
                    state = "recorded" if i in r.recorded else "in flight"
                    raise conflict(f"call {i} of {where} is already {state}; a retry of it sends attempt > 0")
        r.task_id, r.group_id = r.task_id or b.task_id, r.group_id or b.group_id
        r.in_flight.update(numbers)
        r.next_call = max(r.next_call, numbers.stop)
        return b

    def release(self, b: Binding, n: int) -> None:
        """The call ended (recorded or not): its numbers are no longer in flight."""
        key = (b.run_id, b.rollout_id)
        r = self._rollouts.get(key)
        if r is not None and b.call_index is not None:
            r.in_flight.difference_update(range(b.call_index, b.call_index + n))
            if r.forgotten and not r.in_flight:
                del self._rollouts[key]

    def forget(self, run_id: str, rollout_id: str) -> None:
        """The rollout has ended: drop what is kept of it (once no call of it is in flight)."""
        key = (run_id, rollout_id)
        r = self._rollouts.get(key)
        if r is None or not self._reloadable:
            return
        if r.in_flight:
            r.forgotten = True
        else:
            del self._rollouts[key]

    def _evict(self) -> None:
        """Keep at most max_entries: drop least recently used rollouts with no call in flight."""
        if not self._reloadable or len(self._rollouts) < self.max_entries:
            return
        drop: list[tuple[str, str]] = []
        for key, r in self._rollouts.items():  # oldest first
            if len(self._rollouts) - len(drop) < self.max_entries:
                break
            if not r.in_flight:
                drop.append(key)
        for key in drop:
            del self._rollouts[key]

    def recorded(self, run_id: str, rollout_id: str, call_index: int) -> None:
        r = self._rollouts.get((run_id, rollout_id))
        if r is not None:  # claimed, so in flight until release: a dropped entry reloads from the store
            r.recorded.add(call_index)

    def is_recorded(self, run_id: str, rollout_id: str, call_index: int) -> bool:
        r = self._rollouts.get((run_id, rollout_id))
        return r is not None and call_index in r.recorded
