"""Where a GyreEngine's decode slots keep their KV: one layout object behind a small interface.

The engine owns the decode state, its threads and JetStream's contract; its layout owns the
host-side bookkeeping of where each slot's tokens live and when a call may enter its slot:

* ``ContiguousKV``: ``max_len`` entries preallocated per slot; a call enters its slot at once.
* ``PagedKV`` (kv_paged.py): a pool of ``page_size``-token pages; a call is admitted when
  pages for its prompt and all it may still generate are free, and full pages of prompts
  and answers are kept in a prefix cache keyed by their tokens.

``KVLayout`` is the interface the engine calls (on JetStream's generate thread, except
``prefill``: its prefill thread). ``EngineHooks`` is what a layout may ask of its engine.
``plan_kv`` checks the sizes and returns the device layout (``device_fns``'s ``paged``), from
which the engine builds its layout (``engine.kv_layout_for``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import numpy as np

from gyre_jax.model import ModelConfig
from gyre_jax.serving.engine_state import DecodeState, PrefillInput, Prefix, kv_bytes_per_page, kv_memory_plan
from gyre_jax.serving.pages import PrefixPages

KV_CACHES = ("contiguous", "paged")


@dataclasses.dataclass(frozen=True)
class EngineHooks:
    """What a layout may ask of its engine (GyreEngine builds one of its own methods and jitted functions)."""

    name: str
    counters: dict[str, Any]
    params: Callable[[], Any]  # the weights served now
    prefill: Callable[[Any, PrefillInput], Prefix]  # compute a prompt's k/v (after any kv it carries)
    prefix_out: Callable[[Any, Any, PrefillInput, int], Prefix]  # a Prefix of given k/v (None: computed later)
    insert_now: Callable[..., DecodeState]  # put a prefix into its slot of the decode state
    fail: Callable[[str, str], None]  # fail a request (its error for the backend)
    wake: Callable[[], None]  # wake a generate thread waiting for work
    stop_slot: Callable[..., DecodeState]  # device functions (engine_state.device_fns)
    hold_slot: Callable[..., DecodeState]
    gather: Callable[..., tuple[Any, Any]]
    set_table: Callable[..., DecodeState]


class KVLayout(Protocol):
    kind: str  # one of KV_CACHES (GyreEngine.kv_cache)
    prefix_pages: PrefixPages | None  # the page prefix cache, if the layout keeps one
    keeps_sequences: bool  # whether ``keep_sequence`` keeps anything (release(tokens=...) is worth sending)

    def prefill(self, params, inp: PrefillInput) -> Prefix:
        """On JetStream's prefill thread: the request's Prefix (its k/v, or none yet if admission computes it)."""

    def insert(self, ds: DecodeState, prefix: Prefix, slot: int, *, cancelled: bool) -> DecodeState:
        """JetStream's insert: the call into ``slot`` (now or once it can be admitted); a dead or
        cancelled call only stops the slot."""

    def admit(self, ds: DecodeState) -> DecodeState:
        """At each generate call: admit calls that were waiting for room."""

    def grow(self, ds: DecodeState) -> DecodeState:
        """Just before a decode call: room for the tokens it may write."""

    def track(self, active_S: np.ndarray, len_S: np.ndarray | None = None) -> None:
        """The slots' flags (and lengths) as read from the device: finished slots grow no more."""

    def withdraw(self, slot: int) -> tuple[Prefix, PrefillInput | None] | None:
        """The call still waiting for room in ``slot``, taken out of the queue (its prefix, and its
        input if admission was to compute it); None if the slot's call was admitted."""

    def keep_sequence(self, tokens: np.ndarray, slot: int, length: int) -> None:
        """A finished call's whole sequence: keep what the slot computed of it for the next call."""

    def free(self, slot: int) -> None:
        """The slot's call is over: its room goes back."""

    def forget_cached(self) -> None:
        """New weights: nothing cached under the old ones may be reused."""

    def reset(self) -> None:
        """A fresh decode state: every slot empty, nothing waiting, nothing cached."""

    def stats(self) -> dict[str, int]:
        """Occupancy counters (empty for a layout with none)."""


def plan_kv(kind: str, config: ModelConfig, max_len: int, max_slots: int, *, page_size: int, kv_pages: int | None,
            kv_budget_bytes: int | None) -> tuple[int, int] | None:
    """Check the KV sizes; (pages, page_size) of a paged pool, None for a contiguous cache."""
    if kind not in KV_CACHES:
        raise ValueError(f"GyreEngine.kv_cache must be one of {KV_CACHES}, got {kind!r}")
    if kind == "paged" and config.lora is not None and config.lora.num_adapters > 1:
        raise ValueError("GyreEngine: kv_cache='paged' shares prompt pages between calls by their tokens alone; "
                         "with several LoRA adapters two calls of one prompt differ, which is not covered: use "
                         "kv_cache='contiguous'")
    if kind == "paged":
        if page_size < 1 or max_len % page_size:
            raise ValueError(f"GyreEngine: max_len={max_len} must be a multiple of page_size={page_size}")
        if kv_pages is None:
            kv_pages = (int(kv_budget_bytes) // kv_bytes_per_page(config, page_size) if kv_budget_bytes is not None
                        else max_slots * max_len // page_size + 1)
        return int(kv_pages), int(page_size)
    if kv_budget_bytes is not None:
        plan = kv_memory_plan(config, max_len, int(kv_budget_bytes))
        if plan["slots_that_fit"] < max_slots:
            raise ValueError(
                f"GyreEngine: {max_slots} slots x max_len={max_len} need "
                f"{max_slots * plan['bytes_per_slot'] / 2**30:.2f} GiB of KV cache, more than "
                f"kv_budget_bytes={kv_budget_bytes / 2**30:.2f} GiB; {plan['slots_that_fit']} slots fit at this "
                f"max_len, or one slot of up to {plan['max_len_one_slot']} tokens (or kv_cache='paged')")
    return None


class ContiguousKV:
    """Every slot preallocates ``max_len`` entries: nothing to plan on the host."""

    kind = "contiguous"
    keeps_sequences = False

    def __init__(self, hooks: EngineHooks):
        self.hooks = hooks
        self.prefix_pages: PrefixPages | None = None

    def prefill(self, params, inp: PrefillInput) -> Prefix:
        return self.hooks.prefill(params, inp)

    def insert(self, ds: DecodeState, prefix: Prefix, slot: int, *, cancelled: bool) -> DecodeState:
        if prefix.k is None or cancelled:
            return self.hooks.stop_slot(ds, np.int32(slot))
        return self.hooks.insert_now(ds, prefix, slot)

    def admit(self, ds: DecodeState) -> DecodeState:
        return ds

    def grow(self, ds: DecodeState) -> DecodeState:
        return ds

    def track(self, active_S: np.ndarray, len_S: np.ndarray | None = None) -> None:
        pass

    def withdraw(self, slot: int) -> tuple[Prefix, PrefillInput | None] | None:
        return None

    def keep_sequence(self, tokens: np.ndarray, slot: int, length: int) -> None:
        pass

    def free(self, slot: int) -> None:
        pass

    def forget_cached(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}
