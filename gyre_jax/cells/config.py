"""The RL run's cells section (``config.cells``): how devices split into cells, and what each cell runs.

``CellsConfig`` is a ``CellConfig`` (the layout ``split_cells`` takes) plus each cell's engine
(slots, KV-cache length and layout, decode steps per call) and the pool's retries.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from gyre_jax.cells.mesh import CellConfig
from gyre_jax.errors import ConfigError
from gyre_jax.schema import check_ints, check_positive

KV_CACHES = ("contiguous", "paged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellsConfig(CellConfig):
    SECTION: ClassVar[str] = "cells"
    cell_size: int = 2  # devices per cell (8 CPU devices -> 4 cells)
    # 1: slots split over the cell's devices ('data'), weights replicated; > 1: the serving mesh's 'tensor'
    serve_tensor: int = 1
    max_slots: int = 16  # concurrent decode slots per engine (one engine per cell)
    max_len: int = 160  # KV-cache length per slot (prompt + generated)
    tokens_per_call: int = 8  # decode steps per engine generate call (GyreEngine: amortizes host work)
    # "contiguous": max_slots x max_len preallocated (the default until paged has run a whole RL
    # job on an accelerator); "paged": pages of page_size tokens for live tokens only, calls
    # admitted by free pages (GyreEngine, serving/pages.py).
    kv_cache: str = "contiguous"
    page_size: int = 16  # tokens per KV page (paged); max_len must be a multiple
    kv_pages: int = 0  # pages per engine (paged); 0 = the contiguous cache's memory (max_slots x max_len)
    switch_retries: int = 2  # a role switch or weight load that raises is retried this often, then the cell is taken out
    # Engines (weights placed, decode steps compiled) must be serving within this many seconds of the start, or
    # the run ends with an error: line (exit 1) instead of hanging; a loaded 2-core host compiles slowly.
    start_timeout_s: float = 300.0
    # Prompts longer than prefill_chunk (a power of two) prefill chunk by chunk. fixed_prefill: every prompt does,
    # into a max_len buffer: one prefill program for every prompt and cached prefix (GyreEngine.fixed_prefill).
    prefill_chunk: int = 4096
    fixed_prefill: bool = False

    def __post_init__(self):
        check_ints(self, ("cell_size", "train_tensor", "train_expert", "serve_tensor", "serve_expert", "max_slots",
                          "max_len", "tokens_per_call", "switch_retries", "page_size", "kv_pages", "prefill_chunk"))
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ConfigError(f"config.cells.prefill_chunk must be a power of two >= 16, got {self.prefill_chunk}")
        if self.fixed_prefill and self.prefill_chunk > self.max_len:
            raise ConfigError(f"config.cells.fixed_prefill: prefill_chunk={self.prefill_chunk} must be at most "
                              f"cells.max_len={self.max_len}")
        check_positive(self, ("cell_size", "train_tensor", "train_expert", "serve_tensor", "serve_expert",
                              "max_slots", "max_len", "tokens_per_call", "page_size"))
        check_positive(self, ("switch_retries", "kv_pages"), allow_zero=True)
        check_positive(self, ("start_timeout_s",))
        if self.kv_cache not in KV_CACHES:
            raise ConfigError(f"config.cells.kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.kv_cache == "paged" and self.max_len % self.page_size:
            raise ConfigError(f"config.cells.max_len={self.max_len} must be a multiple of cells.page_size="
                              f"{self.page_size} when cells.kv_cache='paged'")
        for name in ("train_tensor", "serve_tensor"):
            if self.cell_size % getattr(self, name):
                raise ConfigError(f"config.cells.{name}={getattr(self, name)} must divide cells.cell_size={self.cell_size}")
        for role in ("train", "serve"):
            t, e = getattr(self, f"{role}_tensor"), getattr(self, f"{role}_expert")
            if self.cell_size % (t * e):
                raise ConfigError(f"config.cells.{role}_tensor * {role}_expert={t * e} must divide cells.cell_size="
                                  f"{self.cell_size}")
        super().__post_init__()
