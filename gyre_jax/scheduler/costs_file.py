"""The scheduler's measured costs as a JSON file, so that one run's measurement seeds the next.

Every RL run writes ``<workdir>/<mode>/scheduler_costs.json`` (``FILE_NAME``) after each
step, atomically: the costs its controller has measured so far (``policy.Measured``'s
fields, in seconds; null = not measured). Two readers:

* ``--config.scheduler.priors=PATH``: a pilot run's file becomes another run's
  ``PolicyConfig.priors``, so elastic can start at the split they give instead of
  measuring first (``policy.priors_split``: only when a switch outlasts a step);
* a resumed run reads its own file back (``OnlineEstimates.restore``), so it continues
  measured instead of starting blind.

The simulator's pilot (``workloads.pilot_priors``) produces the same ``Measured``, so a
file and a simulation given the same costs run the same policy decisions.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile

from gyre_jax.scheduler.policy import Measured

FILE_NAME = "scheduler_costs.json"
_FIELDS = tuple(f.name for f in dataclasses.fields(Measured))
_COUNTS = ("pilot_split",)  # cells, not seconds


def to_json(m: Measured) -> dict:
    """The costs to keep. A switch still in progress is no cost by itself, but how long it has
    taken is a lower bound on the round trip (a 10-minute switch must not be read as free by
    the next run because the first one had not finished): it is folded into the round trip."""
    d = dataclasses.asdict(m)
    in_flight = d.pop("switch_in_flight_s")
    if in_flight is not None:
        d["switch_round_trip_s"] = max(d["switch_round_trip_s"] or 0.0, in_flight)
    return d


def save(path: str, m: Measured) -> None:
    """Write ``m`` to ``path`` atomically (a reader never sees half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".scheduler_costs.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(to_json(m), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str) -> Measured:
    """The costs in ``path``; ValueError in one line naming the path (and the field) if the file
    is missing or is not an object of ``Measured``'s fields, each null or a finite number >= 0."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the scheduler costs ({e.strerror or e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: must be a JSON object of costs {list(_FIELDS)}, got {type(d).__name__}")
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; known: {list(_FIELDS)}")
    for k, v in d.items():
        ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
        if not ok:
            raise ValueError(f"{path}: field {k!r} must be null or a number >= 0 (seconds, or calls per agent), "
                             f"got {v!r}")
        if k in _COUNTS and v is not None and (v != int(v) or v < 1):
            raise ValueError(f"{path}: field {k!r} must be null or a whole number of cells >= 1, got {v!r}")
    values: dict = {k: None if v is None else int(v) if k in _COUNTS else float(v) for k, v in d.items()}
    m = Measured(**values)
    return Measured(**to_json(m))  # a switch_in_flight_s given in the file is the round trip's lower bound


def load_own(workdir: str) -> Measured | None:
    """The costs an earlier attempt in ``workdir`` measured (None: none did), read after the store's lock says
    no other run writes them; a damaged file is a ConfigError naming it."""
    from gyre_jax.errors import ConfigError

    path = os.path.join(workdir, FILE_NAME)
    if not os.path.exists(path):
        return None
    try:
        return load(path)
    except ValueError as e:
        raise ConfigError(f"--workdir: {e}; delete it to let this run measure its costs afresh") from None


def save_own(workdir: str, measured: Measured, moves=()) -> None:
    """``<workdir>/scheduler_costs.json`` (each step: the next run's priors, a resume's start); a failed write is a
    StorageError naming the path. ``moves``: the weight moves so far (objects with ``bytes`` and ``seconds``),
    kept as the move inside a switch, so a run that moves other bytes can rescale it (costs.for_move_bytes)."""
    from gyre_jax.errors import storage_error

    if moves:
        measured = dataclasses.replace(measured, move_bytes=sum(m.bytes for m in moves) / len(moves),
                                       move_s=sum(m.seconds for m in moves) / len(moves))
    path = os.path.join(workdir, FILE_NAME)
    try:
        save(path, measured)
    except OSError as e:
        raise storage_error(path, "writing the scheduler costs", e) from e
