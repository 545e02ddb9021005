"""Step hooks: what happens after a step hangs off the loop, registered with ``every=`` (levanter's add_hook).

Two lists, by thread. ``update_hooks`` run on the trainer's thread after each optimizer update,
before the policy may take the next step, with an ``UpdateInfo`` (the version and a snapshot of
state, buffered rollouts and data position): the checkpoint (``checkpointing.CheckpointHook``) and
the Hugging Face export (``export.ExportHook``). ``step_hooks`` run on the loop's thread for each
finished step's record, with a ``StepInfo``: the held-out eval, the heap trim, the metrics writer,
the scheduler's cost file. A step hook may return values for the step's record (the eval's
numbers); the hooks after it see them, so the metrics writer, registered last, writes them all.

``every=k`` runs a hook after every k-th version (0: never periodically); ``at_end=True`` also after
the run's last one. Registration order is run order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Mapping, TypeVar

Info = TypeVar("Info")


@dataclasses.dataclass(frozen=True)
class UpdateInfo:
    """After optimizer update ``version`` (the trainer thread, between steps)."""

    version: int
    snapshot: Any  # rl.step_events.TrainerSnapshot: state, buffered rollouts, data position
    last: bool  # the run's last update


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A finished step's record (the loop's thread)."""

    version: int
    params: Any  # the policy after the step (an eval's input)
    record: Any  # rl.report.StepRecord, with what earlier hooks returned
    last: bool

    def with_values(self, values: Mapping[str, Any]) -> "StepInfo":
        return dataclasses.replace(self, record=self.record.with_values(values))


@dataclasses.dataclass(frozen=True)
class Hook(Generic[Info]):
    fn: Callable[[Info], Mapping[str, Any] | None]
    every: int
    at_end: bool
    name: str


class Hooks(Generic[Info]):
    """Hooks of one kind, run in registration order after the versions they are due at."""

    def __init__(self) -> None:
        self.hooks: list[Hook[Info]] = []

    def add_hook(self, fn: Callable[[Info], Mapping[str, Any] | None], *, every: int = 1, at_end: bool = True,
                 name: str | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"add_hook: every must be an int >= 0, got {every!r}")
        self.hooks.append(Hook(fn, every, at_end, name or str(getattr(fn, "__qualname__", repr(fn)))))

    @staticmethod
    def due(hook: Hook, version: int, last: bool) -> bool:
        return bool(hook.every and version % hook.every == 0) or (hook.at_end and last)

    def run(self, info: Info) -> Info:
        """Each hook due at ``info.version``; what a hook returns goes into ``info`` for the ones after it."""
        for hook in self.hooks:
            if self.due(hook, info.version, info.last):  # type: ignore[attr-defined]
                out = hook.fn(info)
                if out:
                    info = info.with_values(out)  # type: ignore[attr-defined]
        return info


class UpdateHooks(Hooks[UpdateInfo]):
    """The trainer thread's hooks; ``after_update`` is what the trainer calls after each update."""

    def __init__(self, last_version: int):
        super().__init__()
        self.last_version = last_version

    def after_update(self, version: int, snapshot) -> None:
        self.run(UpdateInfo(version, snapshot, version >= self.last_version))


class StepHooks(Hooks[StepInfo]):
    """The loop thread's hooks; ``after_step`` returns the step's record with what they added."""

    def __init__(self, last_version: int):
        super().__init__()
        self.last_version = last_version

    def after_step(self, version: int, params, record):
        return self.run(StepInfo(version, params, record, version >= self.last_version)).record
