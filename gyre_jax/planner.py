"""The memory plan of an RL layout, per device and per role, before any device work.

``plan(cfg, device_kind, n_devices)`` adds up, for one device of each role, the bytes
the run will hold there:

* **core** (cell 0, training): params, optimizer state (AdamW: two moments in the
  param dtype, as ``optax.adamw`` keeps them), gradients (the step's accumulator and
  the micro-batch gradient being added to it), activations of one micro-batch, the
  micro-batch itself;
* **serve** (a rollout cell's engine): params in the serving layout and the KV cache
  (``cells.max_slots x cells.max_len`` preallocated per engine; with
  ``cells.kv_cache='paged'`` the page pool, ``cells.kv_pages`` pages of ``cells.page_size``
  tokens, split over kv heads only: every 'data' replica holds the whole pool), and the
  decode step's logits;
* a cell that does both (``scheduler.mode='colocate'``, or one cell only) holds
  both at once: its engine keeps its cache while it trains;
* **satellite** (elastic modes): a serving cell that turns to training keeps its engine
  and adds a params snapshot, one micro-batch's gradient and the activations.

Every term is divided the way ``gyre_jax.sharding.RULES`` splits it on that role's
mesh (training ('fsdp', 'tensor'), serving ('data', 'tensor'); gyre_jax/cells/mesh.py).
What is left of the chip's memory is the headroom; a role whose headroom is below
``RESERVE_FRACTION`` of the chip (XLA's workspace, fragmentation, the runtime's own
buffers) does not fit, and ``check`` raises one ConfigError line naming the largest
term and the knob that shrinks it.

Activations are a model of what the compiled step keeps, fitted to XLA's own
``compiled.memory_analysis()`` on CPU (tests/test_planner_xla.py checks it at
several sizes): without remat every layer keeps its residual-stream inputs, q/k/v,
the attention output and the MLP's hidden pre-activations; with remat a layer keeps
only its input and one layer is recomputed at a time. The [rows, row_len, vocab]
float32 logits count whole unless the loss projects them in chunks
(``gyre_jax.cells.loss.memory_plan`` decides, and is asked here).

Pure Python: it imports JAX's modules (the rules table, the model config) but
starts no backend, so ``launch.main --plan`` answers before any device exists.
"""
from __future__ import annotations

import dataclasses
import math
import os

from gyre_jax.errors import ConfigError
from gyre_jax.scheduler.modes import get_mode

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str
    hbm_bytes: int  # memory of one chip (for cpu: this host's RAM, shared by all its devices)
    note: str


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# The one table of device memory. Vendor figures per chip; GiB where the vendor's "GB" is binary.
DEVICE_KINDS: dict[str, DeviceKind] = {k.name: k for k in (
    DeviceKind("h100-80g", 80 * GIB, "NVIDIA H100 SXM/PCIe 80 GB HBM3"),
    DeviceKind("a100-80g", 80 * GIB, "NVIDIA A100 80 GB HBM2e"),
    DeviceKind("h200-141g", 141 * 10**9, "NVIDIA H200 141 GB HBM3e"),
    DeviceKind("tpu-v5p", 95 * GIB, "TPU v5p, 95 GiB HBM per chip"),
    DeviceKind("tpu-v5e", 16 * GIB, "TPU v5e, 16 GiB HBM per chip"),
    DeviceKind("tpu-v6e", 32 * GIB, "TPU v6e (Trillium), 32 GiB HBM per chip"),
    DeviceKind("cpu", 0, "this host's RAM, shared by its CPU devices"),
)}
# Kept free on every device: XLA's scratch and fusion workspace, allocator fragmentation,
# the CUDA/TPU runtime. On GPU also set XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (JAX takes 75% by default).
RESERVE_FRACTION = 0.10

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_target(text: str) -> tuple[str, int]:
    """``"h100-80g:8"`` -> ("h100-80g", 8); one-line ConfigError naming the flag otherwise."""
    kind, _, n = text.partition(":")
    if kind not in DEVICE_KINDS:
        raise ConfigError(f"--plan={text}: unknown device kind {kind!r}; known: {', '.join(DEVICE_KINDS)}")
    if not n.isdigit() or int(n) < 1:
        raise ConfigError(f"--plan={text}: give the device count after the colon, e.g. --plan={kind}:8")
    return kind, int(n)


def device_bytes(kind: str, n_devices: int) -> int:
    """Memory one device of ``kind`` may use; cpu devices share the host's RAM."""
    if kind == "cpu":
        return _host_ram() // n_devices
    return DEVICE_KINDS[kind].hbm_bytes


# ---- the model's arrays, with the logical axes the model gives them (gyre_jax/model) ----
def param_table(m) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(name, shape, logical axes) of every parameter of the Transformer for ModelConfig ``m``
    (checked against ``jax.eval_shape`` of the model in tests/test_planner.py)."""
    D, F, Y, H, K, hd, V = m.d_model, m.d_ff, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.padded_vocab
    out: list[tuple[str, tuple[int, ...], tuple[str | None, ...]]] = [("embedding", (V, D), ("vocab", "embed"))]
    if not m.tie_embeddings:
        out.append(("unembedding", (D, V), ("embed", "vocab")))
    out.append(("final_norm", (D,), ("embed",)))
    layer: list[tuple[str, tuple[int, ...], tuple[str | None, ...]]] = [
        ("attn_norm", (D,), ("embed",)), ("mlp_norm", (D,), ("embed",)),
        ("q", (D, H, hd), ("embed", "heads", "head_dim")), ("k", (D, K, hd), ("embed", "kv_heads", "head_dim")),
        ("v", (D, K, hd), ("embed", "kv_heads", "head_dim")), ("o", (H, hd, D), ("heads", "head_dim", "embed")),
    ]
    mlp = [("gate", (D, F), ("embed", "mlp")), ("up", (D, F), ("embed", "mlp")), ("down", (F, D), ("mlp", "embed"))]
    E, Fe = getattr(m, "num_experts", 0), getattr(m, "moe_intermediate_size", 0)
    moe = [("router", (D, E), ("embed", None)), ("experts_gate", (E, D, Fe), ("expert", "embed", "moe_mlp")),
           ("experts_up", (E, D, Fe), ("expert", "embed", "moe_mlp")),
           ("experts_down", (E, Fe, D), ("expert", "moe_mlp", "embed"))]
    if m.qk_norm:
        layer += [("q_norm", (hd,), ("head_dim",)), ("k_norm", (hd,), ("head_dim",))]
    if m.qkv_bias:
        layer += [("q_bias", (H, hd), ("heads", "head_dim")), ("k_bias", (K, hd), ("kv_heads", "head_dim")),
                  ("v_bias", (K, hd), ("kv_heads", "head_dim"))]
    runs = m.layer_runs() if hasattr(m, "layer_runs") else (("layers", 0, Y, False),)
    for stack, start, stop, is_moe in runs:  # one scanned stack per run of same-kind layers (model/transformer.py)
        out += [(f"{stack}/{n}", (stop - start,) + s, ("layers",) + a) for n, s, a in layer + (moe if is_moe else mlp)]
    return out


def lora_table(m, lora) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(name, shape, logical axes) of every array of ``lora.num_adapters`` LoRA adapters on model ``m``
    (gyre_jax/model/lora.py; checked against the model's own adapters in tests/test_planner.py)."""
    D, F, H, K, hd, r = m.d_model, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim, lora.rank
    E, Fe = getattr(m, "num_experts", 0), getattr(m, "moe_intermediate_size", 0)
    mods = {"q_proj": ("q", (D,), ("embed",), (H, hd), ("heads", "head_dim")),
            "k_proj": ("k", (D,), ("embed",), (K, hd), ("kv_heads", "head_dim")),
            "v_proj": ("v", (D,), ("embed",), (K, hd), ("kv_heads", "head_dim")),
            "o_proj": ("o", (H, hd), ("heads", "head_dim"), (D,), ("embed",))}
    mlp = {"gate_proj": ("gate", (D,), ("embed",), (F,), ("mlp",)), "up_proj": ("up", (D,), ("embed",), (F,), ("mlp",)),
           "down_proj": ("down", (F,), ("mlp",), (D,), ("embed",))}
    moe = {"gate_proj": ("gate", (E, D), ("expert", "embed"), (Fe,), ("moe_mlp",)),
           "up_proj": ("up", (E, D), ("expert", "embed"), (Fe,), ("moe_mlp",)),
           "down_proj": ("down", (E, Fe), ("expert", "moe_mlp"), (D,), ("embed",))}
    out: list[tuple[str, tuple[int, ...], tuple[str | None, ...]]] = []
    for stack, start, stop, is_moe in m.layer_runs():
        table = {**mods, **(moe if is_moe else mlp)}
        y = stop - start
        for target in lora.targets:
            name, ins, ia, outs, oa = table[target]
            lead = 1 if ia[:1] == ("expert",) else 0
            for a in range(lora.num_adapters):
                out.append((f"{a}/{stack}/{name}_lora_a", (y, *ins, r), ("layers", *ia, "lora_rank")))
                out.append((f"{a}/{stack}/{name}_lora_b", (y, *ins[:lead], r, *outs),
                            ("layers", *ia[:lead], "lora_rank", *oa)))
    return out


def _lora(cfg):
    """The run's LoraConfig, None for full fine-tuning (an RLConfig's train.lora; absent: full)."""
    knobs = getattr(getattr(cfg, "train", None), "lora", None)
    return knobs.lora_config() if knobs is not None and getattr(knobs, "rank", 0) else None


def split(logical: tuple, shape: tuple, mesh: dict[str, int], *, replicate_indivisible: bool = False) -> int:
    """How many ways the rules table splits an array of these logical axes on a mesh of these axis sizes."""
    from gyre_jax.sharding import RULES

    rules = dict(RULES)
    ways = 1
    for dim, name in zip(shape, logical):
        axes = rules.get(name) if name else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        size = math.prod(mesh.get(a, 1) for a in axes)
        if dim % size and replicate_indivisible:
            size = 1
        ways *= size
    return ways


def per_device_bytes(table, mesh: dict[str, int], itemsize: int) -> int:
    return sum(math.prod(s) * itemsize // split(a, s, mesh) for _, s, a in table)


# ---- activations: what the compiled training step keeps per token ----
def activation_bytes(m, rows: int, row_len: int, tensor: int, *, remat: bool, logits_chunk: int | None) -> dict:
    """Peak bytes of one device's training activations for ``rows`` x ``row_len`` tokens on it.

    One layer's set, per token, in the activation dtype: 6 F (gate, up, their product and the
    gradients flowing through them), 4 D (residual stream, norm outputs), 4 H hd (q, roped q,
    attention output, its gradient) and 2 K hd (k, v). Without remat every layer keeps its set
    and one more is live while the backward pass works through a layer; with remat a layer keeps
    only its float32 input and one set is live at a time. Coefficients fitted to XLA's
    ``memory_analysis`` on CPU (tests/test_planner_xla.py). Logits: 2.5 float32 copies of
    [positions, V / tensor] (logits, log-softmax, their gradient in place of one).
    """
    a = DTYPE_BYTES[m.dtype]
    D, F, H, K, hd = m.d_model, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim
    if getattr(m, "num_experts", 0):  # an MoE layer's SwiGLU set is K experts' worth per token (the larger wins)
        F = max(F if m.mlp_only_layers or m.decoder_sparse_step > 1 else 0,
                m.num_experts_per_tok * m.moe_intermediate_size)
    t = rows * row_len
    full_layer = t * a * (6 * F // tensor + 4 * D + 4 * H * hd // tensor + 2 * K * hd // tensor)
    if remat:
        layers = t * 4 * D * m.n_layers + full_layer
    else:
        layers = full_layer * (m.n_layers + 1)
    positions = t if logits_chunk is None else rows * logits_chunk
    logits = 10 * positions * m.padded_vocab // tensor
    return {"activations": layers, "logits": logits}


@dataclasses.dataclass(frozen=True)
class RolePlan:
    role: str
    mesh: dict
    terms: dict  # name -> bytes per device
    device_bytes: int

    @property
    def used(self) -> int:
        return sum(self.terms.values())

    @property
    def headroom(self) -> int:
        return self.device_bytes - self.used

    @property
    def fits(self) -> bool:
        return self.headroom >= RESERVE_FRACTION * self.device_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    device_kind: str
    n_devices: int
    n_cells: int
    roles: tuple[RolePlan, ...]
    host: dict | None = None  # cpu: the whole process's bytes by part (host_terms); None on accelerators
    host_limit: int = 0  # cpu: what the host has for it (its RAM, or what is available now at a run's start)

    @property
    def host_bytes(self) -> int:
        return sum((self.host or {}).values())

    def table(self) -> str:
        """The plan as an aligned text table (GiB per device; MiB when every role uses under 1 GiB)."""
        unit, uname = (GIB, "GiB") if max(r.used for r in self.roles) >= GIB else (1 << 20, "MiB")
        names = []
        for r in self.roles:
            names += [n for n in r.terms if n not in names]
        head = ["role", "mesh"] + names + ["used", "device", "headroom", "fits"]
        rows = [head]
        for r in self.roles:
            mesh = "x".join(f"{k}={v}" for k, v in r.mesh.items())
            rows.append([r.role, mesh] + [f"{r.terms.get(n, 0) / unit:.2f}" for n in names]
                        + [f"{r.used / unit:.2f}", f"{r.device_bytes / unit:.2f}", f"{r.headroom / unit:.2f}",
                           "yes" if r.fits else "NO"])
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        note = DEVICE_KINDS[self.device_kind].note if self.device_kind in DEVICE_KINDS else "as the runtime reports it"
        lines = [f"memory plan: {self.n_devices} x {self.device_kind} ({note}), "
                 f"{self.n_cells} cell(s); {uname} per device, {RESERVE_FRACTION:.0%} of each device kept free"]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        if self.host:
            parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.host.items())
            lines.append(f"host: {self.host_bytes / GIB:.2f} GiB peak for the process ({parts}) of "
                         f"{self.host_limit / GIB:.2f} GiB {'available' if self.host_limit < _host_ram() else 'RAM'}"
                         f": {'fits' if self.host_fits else 'does NOT fit'}")
        return "\n".join(lines)

    @property
    def host_fits(self) -> bool:
        return not self.host or self.host_bytes <= self.host_limit

    def check(self) -> None:
        """ConfigError naming the largest term of the first role that does not fit, and what to change; on a
        CPU host then the process's total against what the host has (its devices share one RAM)."""
        for r in self.roles:
            if r.fits:
                continue
            name, size = max(r.terms.items(), key=lambda kv: kv[1])
            need = r.used - (1 - RESERVE_FRACTION) * r.device_bytes
            raise ConfigError(
                f"memory plan: the {r.role} role needs {r.used / GIB:.1f} GiB per {self.device_kind} device "
                f"(of {r.device_bytes / GIB:.1f}, {RESERVE_FRACTION:.0%} kept free); largest term {name} = "
                f"{size / GIB:.1f} GiB: {_ADVICE[name]} (shrink it by {need / GIB:.1f} GiB)")
        if not self.host_fits:
            assert self.host is not None
            name, size = max(self.host.items(), key=lambda kv: kv[1])
            raise ConfigError(
                f"memory plan: this host's process needs {self.host_bytes / GIB:.1f} GiB at its peak, "
                f"{self.host_limit / GIB:.1f} GiB are available; largest part {name} = {size / GIB:.1f} GiB: "
                f"{_HOST_ADVICE.get(name, _ADVICE.get(name, ''))} (shrink it by "
                f"{(self.host_bytes - self.host_limit) / GIB:.1f} GiB)")


_ADVICE = {
    "params": "raise config.cells.cell_size (more devices share the weights) or serve_tensor",
    "optimizer": "raise config.cells.cell_size (the fsdp degree shards Adam's moments)",
    "gradients": "raise config.cells.cell_size (the fsdp degree shards the gradients)",
    "activations": "lower config.train.micro_batch_rows or train.row_len, or set config.model.remat=True",
    "logits": "lower config.train.micro_batch_rows or train.row_len (long rows project the vocab in chunks)",
    "kv_cache": "lower config.cells.max_slots or cells.max_len (cells.kv_pages when paged), or raise "
                "cells.serve_tensor",
    "batch": "lower config.train.micro_batch_rows or train.row_len",
    "decode_logits": "lower config.cells.max_slots",
}
BATCH_BYTES_PER_TOKEN = 4 * 15  # the micro-batch's int32/float32 [B, L] fields (cells/train_step.MICRO_BATCH_KEYS)
ROUTING_BYTES_PER_ID = 2  # an MoE model's recorded routing: int16 [B, L, MoE layers x top-k] (routing replay)


def train_terms(m, cells, train, lora=None) -> tuple[dict, dict]:
    """(mesh, bytes per device) of the core's training state and one micro-batch. With ``lora`` the
    base is frozen in the activation dtype (no gradient, no optimizer state) and the adapters, in
    float32, carry the optimizer's two moments and the two gradient buffers."""
    from gyre_jax.cells.loss import memory_plan

    tensor, expert = cells.train_tensor, getattr(cells, "train_expert", 1)
    mesh = {"fsdp": cells.cell_size // tensor, "tensor": tensor}
    if expert > 1:  # cells/mesh.py: ('fsdp', 'expert', 'tensor'); rows split over fsdp x expert
        mesh = {"fsdp": cells.cell_size // (tensor * expert), "expert": expert, "tensor": tensor}
    table = param_table(m)
    p = DTYPE_BYTES[m.param_dtype]
    params = per_device_bytes(table, mesh, p)
    mp = memory_plan(m, train.micro_batch_rows, train.row_len)
    rows_here = max(1, train.micro_batch_rows // (mesh["fsdp"] * expert))  # rows split over fsdp (x expert)
    act = activation_bytes(m, rows_here, train.row_len, tensor, remat=mp.remat, logits_chunk=mp.logits_chunk)
    # gradients: the step's accumulator and the micro-batch gradient being added to it (cells/train_step.py)
    batch = rows_here * train.row_len * (BATCH_BYTES_PER_TOKEN + ROUTING_BYTES_PER_ID * m.routing_width)
    if lora is not None:  # cells/frozen_base.py: the base in the serving dtype; model/lora.py: adapters in float32
        base = per_device_bytes(table, mesh, DTYPE_BYTES[m.dtype])
        adapters = per_device_bytes(lora_table(m, lora), mesh, 4)
        return mesh, {"params": base, "adapters": adapters, "optimizer": 2 * adapters, "gradients": 2 * adapters,
                      **act, "batch": batch}
    terms = {"params": params, "optimizer": 2 * params, "gradients": 2 * params, **act, "batch": batch}
    return mesh, terms


def serve_terms(m, cells, lora=None, lora_serving: str = "merged") -> tuple[dict, dict]:
    """(mesh, bytes per device) of a rollout cell's engine: params and the preallocated KV cache. With
    ``lora`` (serving/lora_weights.py): merged, the merged weights plus the base kept to merge each
    version into; unmerged, the base plus the adapters beside it."""
    tensor, expert = cells.serve_tensor, getattr(cells, "serve_expert", 1)
    mesh = {"data": cells.cell_size // tensor, "tensor": tensor}
    if expert > 1:  # cells/mesh.py: ('data', 'expert', 'tensor'); experts split over 'expert', slots over data x expert
        mesh = {"data": cells.cell_size // (tensor * expert), "expert": expert, "tensor": tensor}
    params = per_device_bytes(param_table(m), mesh, DTYPE_BYTES[m.param_dtype])
    extra: dict[str, int] = {}
    if lora is not None:
        params = per_device_bytes(param_table(m), mesh, DTYPE_BYTES[m.dtype])  # the base, frozen in the serving dtype
        extra = ({"lora_base": params} if lora_serving == "merged"
                 else {"adapters": per_device_bytes(lora_table(m, lora), mesh, 4)})
    if getattr(cells, "kv_cache", "contiguous") == "paged":  # the engine's page pool (serving/engine_state.py)
        pages = getattr(cells, "kv_pages", 0) or cells.max_slots * cells.max_len // cells.page_size + 1
        kv_shape = (m.n_layers, m.n_kv_heads, pages, cells.page_size, m.head_dim)
        kv_logical: tuple[str | None, ...] = ("layers", "kv_heads", "cache_len", None, "head_dim")
    else:
        kv_shape = (m.n_layers, cells.max_slots, cells.max_len, m.n_kv_heads, m.head_dim)
        kv_logical = ("layers", "cache_batch", "cache_len", "kv_heads", "head_dim")  # serving/engine_state.py
    kv = 2 * math.prod(kv_shape) * DTYPE_BYTES[m.dtype] // split(kv_logical, kv_shape, mesh,
                                                                  replicate_indivisible=True)
    slots_here = cells.max_slots // split(("cache_batch",), (cells.max_slots,), mesh, replicate_indivisible=True)
    return mesh, {"params": params, **extra, "kv_cache": kv, "decode_logits": slots_here * m.padded_vocab * 4}


# ---- a CPU host: every device's bytes are the same RAM, and the process's own come on top ----
# Python, JAX/XLA's runtime and compiled executables, JetStream (it imports TensorFlow), the proxy, the harness
# launcher's threads: measured 1.3-1.5 GB of RSS before any model array on this host (SmolLM2 runs, Dec 6).
PROCESS_BYTES = int(1.4 * GIB)
_HOST_ADVICE = {
    "cells": "fewer or smaller cells (config.num_cpu_devices, cells.cell_size), or see the per-device table",
    "eval_engine": "config.eval.every=0, or a smaller cells.max_slots x cells.max_len (its engine's KV)",
    "checkpoint_copy": "raise config.checkpoint_every (the save is a whole host copy of params and Adam)",
    "prefix_caches": "lower config.cells.max_slots or cells.max_len (each engine keeps up to one slot's k/v per "
                     "slot for its rollouts' next calls), or cells.kv_cache='paged'",
    "process": "nothing to configure: Python, JAX and JetStream themselves",
}


def prefix_cache_bytes(m, cells) -> int:
    """The bound on a contiguous-cache engine's prefix cache (k/v blocks kept between a rollout's calls, host
    side of the serving backend): one full slot's k/v per decode slot (rl/build.py sets it)."""
    kv_slot = 2 * m.n_layers * cells.max_len * m.n_kv_heads * m.head_dim * DTYPE_BYTES[m.dtype]
    return 0 if getattr(cells, "kv_cache", "contiguous") == "paged" else cells.max_slots * kv_slot


def host_terms(cfg, roles: tuple[RolePlan, ...], cell_size: int, n_cells: int) -> dict[str, int]:
    """Peak bytes of one CPU process running the whole layout: each cell's devices at its largest role
    (a rollout cell at its satellite's, engine kept), the held-out eval's own engine on the core's
    devices, the checkpoint's host copy of the train state (params and Adam's two moments, fetched
    whole by the save) and the process itself."""
    by = {r.role: r.used for r in roles}
    core = by.get("core+serve", by.get("core", 0))
    other = max(by.get("serve", 0), by.get("satellite", 0))
    ev = getattr(cfg, "eval", None)
    eval_engine = 0
    engines = (n_cells - 1) if by.get("serve") else 1  # rollout engines (one cell alone serves as it trains)
    every = int(getattr(ev, "every", 0) or 0)
    if every > 0 and getattr(ev, "kind", "") == "episodes":
        _, sterms = serve_terms(cfg.model, cfg.cells)
        eval_engine = sum(sterms.values()) * cell_size
        engines += 1
    params = per_device_bytes(param_table(cfg.model), {}, DTYPE_BYTES[cfg.model.param_dtype])
    opt = params * 2 if _lora(cfg) is None else 0
    return {"cells": (core + other * (n_cells - 1)) * cell_size, "eval_engine": eval_engine,
            "prefix_caches": engines * prefix_cache_bytes(cfg.model, cfg.cells),
            "checkpoint_copy": params + opt, "process": PROCESS_BYTES}


def host_available() -> int:
    """What this host can give a new process now (MemAvailable: free RAM and reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _host_ram()


def plan(cfg, device_kind: str, n_devices: int, *, per_device: int | None = None,
         host_limit: int | None = None) -> Plan:
    """The memory plan of RL config ``cfg`` (anything with ``.model``, ``.cells``, ``.train``, ``.scheduler``)
    on ``n_devices`` devices of ``device_kind`` (``per_device``: bytes the runtime reports, for a kind
    the table lacks)."""
    if per_device is None and device_kind not in DEVICE_KINDS:
        raise ConfigError(f"memory plan: unknown device kind {device_kind!r}; known: {', '.join(DEVICE_KINDS)}")
    cells = cfg.cells
    if n_devices % cells.cell_size:
        raise ConfigError(f"config.cells.cell_size={cells.cell_size} does not divide the {n_devices} devices")
    n_cells = n_devices // cells.cell_size
    per_device = device_bytes(device_kind, n_devices) if per_device is None else per_device
    lora = _lora(cfg)
    tmesh, tterms = train_terms(cfg.model, cells, cfg.train, lora)
    smesh, sterms = serve_terms(cfg.model, cells, lora, getattr(getattr(cfg.train, "lora", None), "serving", "merged"))
    mode = get_mode(cfg.scheduler.mode)
    # One cell trains and serves in turn: its engine's params and cache stay while it trains.
    if n_cells == 1 or mode.colocated:
        both = dict(tterms)
        both["serve_params"] = sterms["params"]
        both["kv_cache"], both["decode_logits"] = sterms["kv_cache"], sterms["decode_logits"]
        if "lora_base" in sterms:
            both["lora_base"] = sterms["lora_base"]
        if "adapters" in sterms:
            both["serve_adapters"] = sterms["adapters"]
        roles: tuple[RolePlan, ...] = (RolePlan("core+serve", tmesh, both, per_device),)
    else:
        roles = (RolePlan("core", tmesh, tterms, per_device), RolePlan("serve", smesh, sterms, per_device))
        if mode.switches_satellites:
            # A satellite that turns to training keeps its engine (params and cache stay, rl/cell_pool.py)
            # and takes a params snapshot, one micro-batch's gradient and its activations on top.
            sat = {("serve_params" if k == "params" else "serve_adapters" if k == "adapters" else k): v
                   for k, v in sterms.items()}
            sat.update({k: v for k, v in tterms.items() if k not in ("optimizer", "gradients")})
            sat["gradients"] = tterms["adapters" if lora is not None else "params"]
            roles += (RolePlan("satellite", tmesh, sat, per_device),)
    if device_kind != "cpu":
        return Plan(device_kind, n_devices, n_cells, roles)
    return Plan(device_kind, n_devices, n_cells, roles, host=host_terms(cfg, roles, cells.cell_size, n_cells),
                host_limit=_host_ram() if host_limit is None else host_limit)


_ADVICE["serve_params"] = _ADVICE["params"]
_ADVICE["lora_base"] = "serve the adapters unmerged (config.train.lora.serve=unmerged: no merged copy of the base)"
_ADVICE["adapters"] = "lower config.train.lora.rank, or adapt fewer targets or layers"
_ADVICE["serve_adapters"] = _ADVICE["adapters"]


# device_kind strings JAX reports -> our table's names (a kind not listed is not planned)
_JAX_KINDS = {"NVIDIA H100 80GB HBM3": "h100-80g", "NVIDIA H100 PCIe": "h100-80g", "NVIDIA A100-SXM4-80GB": "a100-80g",
              "NVIDIA A100 80GB PCIe": "a100-80g", "NVIDIA H200": "h200-141g", "TPU v5p": "tpu-v5p",
              "TPU v5 lite": "tpu-v5e", "TPU v6 lite": "tpu-v6e"}


def check_local(cfg, devices) -> Plan | None:
    """The RL job's own check at start: plan ``cfg`` for these devices; ConfigError if it cannot fit.
    A kind the table lacks is planned with the memory its runtime reports (``memory_stats``); None
    when it reports none either (the run goes on unplanned, with a log line)."""
    import logging

    d = devices[0]
    kind = "cpu" if d.platform == "cpu" else _JAX_KINDS.get(d.device_kind)
    limit = None
    if kind is None:
        limit = (d.memory_stats() or {}).get("bytes_limit")
        if not limit:
            logging.getLogger(__name__).warning("memory plan: device kind %r is not in gyre_jax.planner's table "
                                                "and reports no memory; not planned", d.device_kind)
            return None
        kind = d.device_kind
    p = plan(cfg, kind, len(devices), per_device=limit, host_limit=host_available() if kind == "cpu" else None)
    p.check()
    return p
