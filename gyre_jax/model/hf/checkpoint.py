"""``load_pretrained`` / ``save_pretrained``: HF safetensors checkpoints in and out.

Import streams one tensor at a time from disk onto its devices: the sharding of each
param comes from the rules table (gyre_jax/sharding.py) applied to ``param_logical_axes``;
a per-layer tensor of a large stacked ``[Y, ...]`` param is written into its slot on the
devices (a donated ``dynamic_update_slice``), so the host never holds more than one
tensor (plus its transposed copy); a stacked param of at most ``STACK_ON_HOST_BYTES`` is
assembled on the host and moved in one transfer. Export fetches one layer's slice at a time and
writes HF names, shapes and dtypes, sharded with ``model.safetensors.index.json``
above ``max_shard_bytes``; import -> export -> import is bit-exact (pure reshapes).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.hf.config_map import UnsupportedCheckpoint, config_from_hf, hf_config
from gyre_jax.model.hf.gguf_file import GGUFCheckpoint, is_gguf
from gyre_jax.model.hf.st_io import SafetensorsReader, write_safetensors
from gyre_jax.model.hf.tensors import IGNORED_SUFFIXES, Entry, entries
from gyre_jax.model.transformer import init_params, param_logical_axes
from gyre_jax.sharding import RULES, tree_shardings

log = logging.getLogger(__name__)
INDEX, SINGLE, CONFIG = "model.safetensors.index.json", "model.safetensors", "config.json"
# Files a serving stack needs beside the weights; save_pretrained(like=...) copies them.
# A stacked [Y, ...] param up to this size is assembled on the host and moved once; a larger one is written
# into its slot on the devices layer by layer (the host never holds it whole). The slot writes compile once per
# param shape: ~10 compiles of seconds each for a small model on a loaded host, more than its whole load.
STACK_ON_HOST_BYTES = 256 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


class _Checkpoint:
    """The tensors of a checkpoint directory (single file or sharded), opened lazily."""

    def __init__(self, path: str):
        self.path = path
        idx = os.path.join(path, INDEX)
        if os.path.exists(idx):
            with open(idx) as f:
                wm = json.load(f).get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise UnsupportedCheckpoint(f"{idx}: no 'weight_map'")
            self.file_of = dict(wm)
        elif os.path.exists(os.path.join(path, SINGLE)):
            with SafetensorsReader(os.path.join(path, SINGLE)) as r:
                self.file_of = {n: SINGLE for n in r.tensors}
        else:
            raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} is there")
        self._open: dict[str, SafetensorsReader] = {}

    def _reader(self, name: str) -> SafetensorsReader:
        fn = self.file_of[name]
        if fn not in self._open:
            p = os.path.join(self.path, fn)
            if not os.path.exists(p):
                raise FileNotFoundError(f"{p}: listed in {INDEX} for tensor {name!r} but missing")
            self._open[fn] = SafetensorsReader(p)
        r = self._open[fn]
        if name not in r.tensors:
            raise UnsupportedCheckpoint(f"{r.path}: tensor {name!r} is listed in {INDEX} but not in the file")
        return r

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader(name).shape(name)

    def read(self, name: str) -> np.ndarray:
        return self._reader(name).read(name)

    def close(self):
        for r in self._open.values():
            r.close()
        self._open.clear()

    def largest_file_bytes(self) -> int:
        return max(os.path.getsize(os.path.join(self.path, f)) for f in set(self.file_of.values()))


def vocab_multiple(mesh, rules=RULES) -> int:
    """How many ways ``mesh`` splits the vocab axis (the embedding must be a multiple of it)."""
    if mesh is None:
        return 1
    axes = dict(rules).get("vocab")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes if a in mesh.shape], dtype=np.int64))


def read_config(path: str) -> dict[str, Any]:
    """``path``/config.json, with ``tie_word_embeddings`` as transformers loads these files (``_tie_as_loaded``).

    A ``.gguf`` file: the config.json its metadata describes (gguf_file.GGUFCheckpoint.hf_config)."""
    if is_gguf(path):
        ck = GGUFCheckpoint(path)
        try:
            return ck.hf_config()
        finally:
            ck.close()
    p = os.path.join(path, CONFIG)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{p}: no config.json (is {path!r} a Hugging Face checkpoint directory?)")
    with open(p) as f:
        hf = json.load(f)
    return _tie_as_loaded(path, hf)


HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _tie_as_loaded(path: str, hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with ``tie_word_embeddings`` set to whether the head is the embedding once loaded.

    transformers (5.x) reads an absent field as False (Qwen2, Qwen3 and Llama configs alike) and does
    not tie when the files hold an ``lm_head.weight`` that differs from the embedding, whatever the
    field says: a stored head is never dropped. One case differs on purpose: no field and no
    ``lm_head.weight`` is a tied checkpoint (transformers would leave the head random). An explicit
    ``false`` without the tensor stays an error (_check_names names it). Without weight files here
    (a bare config.json) the field is left as it is.
    """
    try:
        ck = _Checkpoint(path)
    except FileNotFoundError:
        return hf
    try:
        given = hf.get("tie_word_embeddings")
        if given is None:
            tied = HEAD not in ck.file_of
            if tied:
                log.warning("hf: %s: config.json has no tie_word_embeddings and no %s; loading it tied", path, HEAD)
        elif given and HEAD in ck.file_of and EMBED in ck.file_of and not np.array_equal(ck.read(HEAD),
                                                                                          ck.read(EMBED)):
            log.warning("hf: %s: tie_word_embeddings=true but %s differs from the embedding; using %s (as "
                        "transformers does)", path, HEAD, HEAD)
            tied = False
        else:
            return hf
    finally:
        ck.close()
    return {**hf, "tie_word_embeddings": tied}


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


@functools.cache
def _zeros(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _write_layer(sharding, rank: int = 1):
    """Write a [1, ...] slice (rank 2: [1, 1, ...], one expert of one layer) at index (i[, j], 0, ...)."""
    def put(s, x, *idx):
        return jax.lax.dynamic_update_slice(s, x, (*idx, *([0] * (s.ndim - rank))))

    return jax.jit(put, donate_argnums=0, out_shardings=sharding)


def _slice_sharding(sharding, rank: int = 1):
    """Sharding of one [1, ...] layer slice of a stacked param (the layers (and experts) axes unsplit)."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        return NamedSharding(sharding.mesh, PartitionSpec(*([None] * rank), *spec[rank:]))
    return sharding


def open_checkpoint(path: str) -> _Checkpoint | GGUFCheckpoint:
    """The tensors of a HF checkpoint directory or of a ``.gguf`` file, by HF name."""
    return GGUFCheckpoint(path) if is_gguf(path) else _Checkpoint(path)


def load_pretrained(path: str, *, mesh=None, dtype: str | None = None, vocab_pad_multiple: int | None = None,
                    max_seq_len: int | None = None, rules=RULES) -> tuple[ModelConfig, dict]:
    """(ModelConfig, {"params": ...}) of a HF checkpoint directory or a ``.gguf`` file, params placed on ``mesh``.

    A GGUF file's quantized tensors are dequantized (gguf_file.py) to ``dtype``.

    ``dtype``: the params' dtype ("bfloat16", "float32"; default config.json's ``dtype``/``torch_dtype``).
    ``vocab_pad_multiple`` defaults to what ``mesh`` needs to split the vocab axis.
    Without a mesh, params go to the first device.
    """
    hf = read_config(path)
    if vocab_pad_multiple is None:
        vocab_pad_multiple = vocab_multiple(mesh, rules)
    cfg = config_from_hf(hf, dtype=dtype, vocab_pad_multiple=vocab_pad_multiple, max_seq_len=max_seq_len,
                         where=path if is_gguf(path) else os.path.join(path, CONFIG))
    abstract = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))["params"]
    if mesh is None:
        one = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, abstract)
    else:
        shardings = tree_shardings(param_logical_axes(cfg)["params"], mesh, abstract, rules=rules)
    ck = open_checkpoint(path)
    try:
        plan = entries(cfg)
        _check_names(ck, cfg, plan)
        params: dict = {}
        progress = _LoadProgress(total=sum(len(e.tensors()) for e in plan))
        for e in plan:
            a, sh = _get(abstract, e.path), _get(shardings, e.path)
            if not e.per_layer:
                w = _read(ck, e, e.name(), a.dtype)
                _set(params, e.path, jax.device_put(w, sh))
                progress.read(w.nbytes)
                continue
            _set(params, e.path, _stacked(ck, e, a, sh, progress))
        log.info("hf: loaded %s (%d tensors, %.2f GB) in %.1fs", path, progress.total, progress.nbytes / 1e9,
                 time.perf_counter() - progress.t0)
    finally:
        ck.close()
    return cfg, {"params": params}


@dataclasses.dataclass
class _LoadProgress:
    """Tensors read so far, with a log line (rate, ETA) at most every 10 s."""

    total: int
    done: int = 0
    nbytes: int = 0
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    last: float = dataclasses.field(default_factory=time.perf_counter)

    def read(self, nbytes: int) -> None:
        self.done, self.nbytes = self.done + 1, self.nbytes + nbytes
        if time.perf_counter() - self.last > 10:
            self.last, el = time.perf_counter(), time.perf_counter() - self.t0
            log.info("hf: %d/%d tensors, %.2f GB in %.0fs (%.0f MB/s), ETA %.0fs", self.done, self.total,
                     self.nbytes / 1e9, el, self.nbytes / 1e6 / el, el * (self.total - self.done) / self.done)


def _stacked(ck, e: Entry, a, sh, progress: _LoadProgress):
    """One per-layer (or per-expert) entry, its tensors stacked into one array placed with ``sh``."""
    rank = 2 if e.experts else 1  # one tensor per layer, or per expert of a layer
    on_host = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize <= STACK_ON_HOST_BYTES
    if on_host:  # assembled here, one transfer: no per-shape compiles of the slot writes
        host = np.empty(a.shape, np.dtype(a.dtype))
    else:
        stacked = _zeros(a.shape, a.dtype, sh)()
        put, one_sh = _write_layer(sh, rank), _slice_sharding(sh, rank)
    for name, idx, _ in e.tensors():
        w = _read(ck, e, name, a.dtype)
        if on_host:
            host[tuple(idx)] = w
        else:
            stacked = put(stacked, jax.device_put(w.reshape((1,) * rank + w.shape), one_sh),
                          *(np.int32(x) for x in idx))
        progress.read(w.nbytes)
        del w
    return jax.device_put(host, sh) if on_host else stacked


def _check_names(ck: _Checkpoint | GGUFCheckpoint, cfg: ModelConfig, plan: list[Entry]) -> None:
    expected = {name for e in plan for name, _, _ in e.tensors()}
    have = set(ck.file_of)
    missing = sorted(expected - have)
    if missing:
        raise UnsupportedCheckpoint(f"{ck.path}: {len(missing)} tensors the config implies are missing, e.g. "
                                    f"{missing[:5]}")
    extra = sorted(n for n in have - expected if not n.endswith(IGNORED_SUFFIXES))
    if cfg.tie_embeddings and HEAD in extra:  # a tied checkpoint that also stores an equal copy (_tie_as_loaded)
        extra.remove(HEAD)
    if extra:
        raise UnsupportedCheckpoint(f"{ck.path}: {len(extra)} tensors this model has no place for (a feature it does "
                                    f"not compute?), e.g. {extra[:5]}")


def _read(ck: _Checkpoint | GGUFCheckpoint, e: Entry, name: str, dtype) -> np.ndarray:
    got = ck.shape(name)
    if got != e.hf_shape:
        raise UnsupportedCheckpoint(f"{ck.path}: tensor {name!r} ({ck.file_of[name]}) has shape {got}, "
                                    f"config.json implies {e.hf_shape}")
    w = e.to_ours(ck.read(name))
    return np.ascontiguousarray(w.astype(np.dtype(dtype), copy=False))


def save_pretrained(params, config: ModelConfig, path: str, *, like: str | None = None,
                    max_shard_bytes: int = 5 * 2**30, dtype: str | None = None) -> list[str]:
    """Write ``params`` as a HF checkpoint (config.json + safetensors) into ``path``.

    ``like``: a source checkpoint directory whose config.json fields we do not own
    (token ids, ...) are kept and whose tokenizer files are copied, so the result is
    servable as is; or the ``.gguf`` file a run started from (its metadata's config, and its
    tokenizer and chat template written as tokenizer.json + tokenizer_config.json).
    ``dtype`` defaults to the params'. Returns the files written.
    """
    tree = params["params"] if "params" in params else params
    dtype = dtype or config.param_dtype
    out_dt = np.dtype(jnp.dtype(dtype))
    os.makedirs(path, exist_ok=True)
    specs, makers = _tensor_plan(tree, config, out_dt)
    shards = _shards(specs, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for j in range(len(shards))]
    total, weight_map = 0, {}
    for fn, ks in zip(names, shards):
        total += write_safetensors(os.path.join(path, fn), [specs[k] for k in ks], (makers[k]() for k in ks))
        weight_map.update({specs[k][0]: fn for k in ks})
    written = list(names)
    if len(names) > 1:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(INDEX)
    else:
        stale = os.path.join(path, INDEX)
        if os.path.exists(stale):
            os.remove(stale)
    base = read_config(like) if like else None
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(hf_config(config.replace(param_dtype=dtype), base), f, indent=2)  # torch_dtype: the files' dtype
    written.append(CONFIG)
    if like and is_gguf(like):  # the file's tokenizer and chat template as tokenizer.json + tokenizer_config.json
        written += _write_gguf_tokenizer(like, path)
    elif like:
        for fn in TOKENIZER_FILES:
            src = os.path.join(like, fn)
            if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, fn)):
                shutil.copyfile(src, os.path.join(path, fn))
                written.append(fn)
    log.info("hf: wrote %s (%d files, %.2f GB)", path, len(names), total / 1e9)
    return written


def _tensor_plan(tree, config: ModelConfig, out_dt: np.dtype) -> tuple[list, list]:
    """(the checkpoint's tensors as (name, HF shape, dtype), a function making each one's array), in HF
    order: embeddings, layer by layer, final norm, head."""
    specs, makers = [], []
    plan = entries(config)
    for e in plan:
        if not e.per_layer and e.path == ("embed",):
            specs.append((e.name(), e.hf_shape, out_dt))
            makers.append(functools.partial(_fetch, tree, e, (), out_dt))
    per_layer = [(i, name, e, idx) for e in plan if e.per_layer for name, idx, i in e.tensors()
                 if i is not None]  # always: a per-layer entry's tensors name their layer
    for _, name, e, idx in sorted(per_layer, key=lambda t: t[0]):  # layer by layer (stable: plan order within)
        specs.append((name, e.hf_shape, out_dt))
        makers.append(functools.partial(_fetch, tree, e, idx, out_dt))
    for e in plan:
        if not e.per_layer and e.path != ("embed",):
            specs.append((e.name(), e.hf_shape, out_dt))
            makers.append(functools.partial(_fetch, tree, e, (), out_dt))
    return specs, makers


def _shards(specs: list, max_shard_bytes: int) -> list[list[int]]:
    """Tensor indices per safetensors file, in order, each file at most ``max_shard_bytes`` (or one tensor)."""
    shards: list[list[int]] = [[]]
    size = 0
    for k, (_, shape, dt) in enumerate(specs):
        nb = int(np.prod(shape)) * dt.itemsize
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    return shards


def _write_gguf_tokenizer(src: str, path: str) -> list[str]:
    from gyre_jax.model.hf.gguf_tokenizer import gguf_tokenizer

    tk, tc = gguf_tokenizer(src)
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in tc.items() if v is not None}, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]


def _fetch(tree, e: Entry, idx: tuple[int, ...], dt) -> np.ndarray:
    leaf = _get(tree, e.path)
    a = np.asarray(jax.device_get(leaf[idx] if idx else leaf))
    return np.ascontiguousarray(e.to_hf(a).astype(dt, copy=False))
