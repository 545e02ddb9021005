"""THE sharding rules table (logical axis -> mesh axis) and the helpers that apply it.

Every parameter carries logical axis names (the model attaches them with
``nn.with_logical_partitioning``); every array that crosses into a jitted step
gets its sharding from ``RULES`` here and from nowhere else. One table serves
both layouts of a cell (cells/mesh.py): a rule naming a mesh axis the mesh does not
have means "replicated" on that mesh, so on the serving mesh
('data', 'tensor') weights are split over 'tensor' only, while on the
training mesh ('fsdp', 'tensor') they are also split over 'fsdp'.

Derive shardings from abstract values (``jax.eval_shape(init)``), never from
materialised arrays, so state is born sharded.
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The mesh axis names. They live here, in a leaf module, because the model (HF checkpoint
# loading), the cells and serving all lay arrays out by this table, and the model must not
# import the cells (which import the model).
FSDP = "fsdp"
TENSOR = "tensor"
DATA = "data"
EXPERT = "expert"  # mixture of experts: experts split over it; tokens too (it is data parallel outside the experts)

MeshAxes = str | tuple[str, ...] | None

RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", (DATA, FSDP, EXPERT)),  # rows of a packed batch: data parallel; fsdp and expert shard batch too
    ("vocab", TENSOR),
    ("embed", FSDP),  # fsdp: weights split along d_model, all-gathered per layer in the step
    ("heads", TENSOR),
    ("kv_heads", TENSOR),
    ("head_dim", None),
    ("mlp", TENSOR),
    ("expert", EXPERT),  # the experts of an MoE layer (model/moe.py dispatches tokens to them all-to-all)
    ("moe_mlp", TENSOR),  # one expert's hidden width
    ("layers", None),  # scanned layer axis: every device holds its slice of every layer
    ("lora_rank", None),  # a LoRA adapter's rank (model/lora.py): small, every device holds all of it
    ("length", None),  # sequence axis of a packed row
    # A serving engine's KV cache [layers, slots, positions, kv_heads, head_dim] and the
    # k/v blocks it moves [layers, positions, kv_heads, head_dim] (serving/engine_state.py):
    # decode slots: data parallel over the serving mesh; with an expert axis (cells.serve_expert) the
    # slots split over it too, so its devices attend to different slots and share only the experts
    ("cache_batch", (DATA, EXPERT)),
    ("cache_len", None),  # cache positions: every device holds the whole context of its slots
)

BATCH_LOGICAL = ("batch", "length")  # every [B, L] array of a packed micro-batch


def _rules_dict(rules) -> dict[str, MeshAxes]:
    out: dict[str, MeshAxes] = {}
    for name, axes in rules:
        if name in out:
            raise ValueError(f"sharding rules: logical axis {name!r} appears twice")
        out[name] = axes
    return out


def mesh_spec(
    logical: PartitionSpec | tuple,
    mesh: Mesh,
    *,
    shape: tuple[int, ...] | None = None,
    rules=RULES,
    where: str = "array",
    replicate_indivisible: bool = False,
) -> PartitionSpec:
    """Mesh PartitionSpec for one array with logical axis names ``logical``.

    Mesh axes the mesh lacks are dropped (replicated there). With ``shape``,
    checks that every sharded dimension divides by its mesh axes' total size; with
    ``replicate_indivisible`` such a dimension is replicated instead of raising (the
    KV cache: fewer kv heads than the tensor degree are copied, not split).
    """
    table = _rules_dict(rules)
    logical = tuple(logical)
    if shape is not None and len(shape) != len(logical):
        raise ValueError(f"{where}: {len(logical)} logical axes {logical} for an array of shape {shape}")
    used: dict[str, str] = {}
    out: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"{where}: logical axis {name!r} has no rule; known: {sorted(table)}")
        axes = table[name]
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a in mesh.shape)
        for a in axes:
            if a in used:
                raise ValueError(
                    f"{where}: mesh axis {a!r} would shard both {used[a]!r} and {name!r} (logical {logical})"
                )
            used[a] = name
        if shape is not None and axes:
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            if shape[dim] % size and replicate_indivisible:
                axes = ()
            elif shape[dim] % size:
                raise ValueError(
                    f"{where}: dimension {dim} ({name!r}) of shape {shape} has size {shape[dim]}, "
                    f"not divisible by mesh axes {axes} of total size {size}"
                )
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:  # canonical form: trailing replicated dims omitted
        out.pop()
    return PartitionSpec(*out)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def tree_shardings(logical_tree, mesh: Mesh, abstract_tree=None, *, rules=RULES):
    """NamedShardings for a pytree of logical PartitionSpecs (e.g. ``nn.get_partition_spec``).

    ``abstract_tree`` (same structure, ShapeDtypeStructs or arrays) enables the
    divisibility check, with the parameter path in the error.
    """
    if abstract_tree is None:
        return jax.tree.map(lambda s: NamedSharding(mesh, mesh_spec(s, mesh, rules=rules)), logical_tree, is_leaf=_is_spec)
    specs, treedef = jax.tree_util.tree_flatten_with_path(logical_tree, is_leaf=_is_spec)
    shapes = treedef.flatten_up_to(abstract_tree)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef is unresolved in jax's stubs; flatten_up_to is its method
    out = [
        NamedSharding(mesh, mesh_spec(s, mesh, shape=tuple(a.shape), rules=rules, where=jax.tree_util.keystr(p)))
        for (p, s), a in zip(specs, shapes)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def batch_sharding(mesh: Mesh, *, rules=RULES) -> NamedSharding:
    """Sharding of a [B, L] array of a packed micro-batch on ``mesh``."""
    return NamedSharding(mesh, mesh_spec(BATCH_LOGICAL, mesh, rules=rules, where="batch"))
