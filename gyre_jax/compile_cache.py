"""The persistent XLA compilation cache, shared by cells whose programs differ only in their devices.

A run compiles the same program once per cell: two cells of a host's CPU devices (devices 0-1 and
2-3) trace identical HLO (shardings name logical devices), yet JAX keys each compiled executable
by its device assignment, so every cell pays the whole compile (minutes for a 30-layer model on 2
cores). On GPU JAX already drops the assignment from the persistent cache's key (one process per
GPU loads what another compiled) and loads the executable onto the caller's devices;
``share_across_devices`` does the same on CPU, where it holds as well (tests/test_compile_cache.py
runs one cell's executable on another cell's devices, and permuted, against numpy). It also makes
the second cell wait while the first compiles the same key, so it loads instead of compiling too
(cells warm their steps from their own threads at once).

``enable`` is what the launcher calls: the cache in ``~/.cache/gyre_jax/xla`` (or
``$JAX_COMPILATION_CACHE_DIR``), every compile of 1 s or more kept, and the sharing above on CPU.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "gyre_jax", "xla")
_state: dict[str, Any] = {"patched": False}
_key_locks: dict[str, threading.Lock] = {}
_held = threading.local()  # the keys this thread missed and is compiling (their locks held)
_guard = threading.Lock()


def enable(cache_dir: str | None = None, *, min_compile_s: float = 1.0) -> str:
    """Turn the persistent cache on (``$JAX_COMPILATION_CACHE_DIR`` when set, as it is) and share
    entries across device sets on CPU; returns the directory in use."""
    import jax

    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not env:
        cache_dir = cache_dir or DEFAULT_DIR
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    share_across_devices()
    return env or str(cache_dir)


def share_across_devices() -> bool:
    """Key the persistent cache without the device assignment on CPU, and let one thread compile a
    key while others wait to load it. False (and a log line) when this JAX's internals differ."""
    if _state["patched"]:
        return True
    try:
        from jax._src import cache_key, compiler
        hash_options = cache_key._hash_serialized_compile_options
        cache_read, compile_write = compiler._cache_read, compiler._compile_and_write_cache
    except (ImportError, AttributeError) as e:
        log.info("compile cache: not shared across cells (%s)", e)
        return False

    def hash_without_devices(hash_obj, options, strip_device_assignment=False):
        # Only CPU is changed: GPU already strips, and a TPU's executable may depend on its topology.
        cpu = _platform_of(options) == "cpu"
        if cpu:  # which devices may change; how many may not (a 4-device program run on 8 fails in safe_zip)
            hash_obj.update(_device_shape(options).encode())
        return hash_options(hash_obj, options, strip_device_assignment=strip_device_assignment or cpu)

    def read_or_claim(module_name, key, *args, **kwargs):
        if _process_count() > 1:  # a miss may go to JAX's cross-process compile, which never releases a claim
            return cache_read(module_name, key, *args, **kwargs)
        with _guard:
            lock = _key_locks.setdefault(key, threading.Lock())
        lock.acquire()
        try:
            found = cache_read(module_name, key, *args, **kwargs)
        except BaseException:
            lock.release()
            raise
        if found[0] is not None:
            lock.release()
        else:  # a miss: this thread compiles it (compile_and_write below releases the lock)
            _held.keys = getattr(_held, "keys", set()) | {key}
        return found

    def compile_write_release(*args, **kwargs):
        key = kwargs.get("cache_key", args[6] if len(args) > 6 else None)
        try:
            return compile_write(*args, **kwargs)
        finally:
            held = getattr(_held, "keys", set())
            if key in held:
                held.discard(key)
                _key_locks[key].release()

    _state["originals"] = (hash_options, cache_read, compile_write)
    cache_key._hash_serialized_compile_options = hash_without_devices
    compiler._cache_read = read_or_claim  # type: ignore[assignment]  # same call, JAX annotates its own
    compiler._compile_and_write_cache = compile_write_release
    _state["patched"] = True
    return True


def unshare() -> None:
    """Undo ``share_across_devices`` (tests)."""
    if not _state["patched"]:
        return
    from jax._src import cache_key, compiler

    hash_options, cache_read, compile_write = _state.pop("originals")
    cache_key._hash_serialized_compile_options = hash_options
    compiler._cache_read, compiler._compile_and_write_cache = cache_read, compile_write
    _state["patched"] = False


def _device_shape(options) -> str:
    """The device assignment's shape (replicas x partitions), kept in the key when its devices are not."""
    da = getattr(options.executable_build_options, "device_assignment", None)
    if da is None:
        return "devices:none"
    return f"devices:{da.replica_count()}x{da.computation_count()}"


def _process_count() -> int:
    import jax

    return jax.process_count()


def _platform_of(options) -> str:
    """The platform a key is computed for: compile options carry none, so ask JAX's default backend
    (a CPU-only host's is 'cpu'; a GPU host's CPU programs keep their device assignment)."""
    import jax

    del options
    return jax.default_backend()
