"""What a LoRA run's engine serves: the frozen base with its adapters, merged or beside it.

An engine of a LoRA run (``GyreEngine(config, Adapted(base, adapters), lora_serving=...)``) is born
with the base and the adapters and is then published adapters only (``engine.publish(adapters,
version)``: what a role switch or a publication moved). Two ways to serve them:

* ``merged`` (one adapter live): W + s * A @ B folded into the weights once per version (float32
  sums, the base's dtype), then decode is the plain model's: exact, and no per-token cost. The cell
  keeps the base on its serving mesh to merge every new version into (FrozenBase.on).
* ``unmerged``: the base's per-layer weights stay as placed at start and each version replaces the
  adapters beside them; the model adds ``x @ A @ B`` per token (model/lora.py). With several
  adapters (multi-LoRA) each token uses its own slot's adapter.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh

from gyre_jax.cells.frozen_base import Adapted, FrozenBase
from gyre_jax.model import lora as lora_lib
from gyre_jax.model.unrolled import LayerParams, split_params
from gyre_jax.sharding import tree_shardings

SERVING = ("merged", "unmerged")


class LoraWeights:
    """Adapters -> the engine's LayerParams, on one serving mesh (module docstring)."""

    def __init__(self, base: FrozenBase, mesh: Mesh, serving: str):
        if serving not in SERVING:
            raise ValueError(f"lora_serving must be one of {SERVING}, got {serving!r}")
        lora = base.config.lora
        assert lora is not None  # FrozenBase refuses a config without lora
        if serving == "merged" and lora.num_adapters > 1:
            raise ValueError(f"lora_serving='merged' serves one adapter; this run has {lora.num_adapters}: use "
                             "'unmerged' (each slot applies its own adapter beside the base)")
        self.base, self.mesh, self.serving = base, mesh, serving
        self.config = base.base_config if serving == "merged" else base.config
        one = lora_lib.adapter_logical_axes(base.config)
        self._adapter_logical = tuple(one for _ in range(lora.num_adapters))
        self._adapter_shardings: Any = None
        cfg = base.config
        self._merge = jax.jit(lambda b, a: lora_lib.merge(cfg, b, a[0]))
        self._effective = jax.jit(lambda a: lora_lib.effective(cfg, a))

    def param_shardings(self):
        """Shardings of the tree the engine places (the base's; with the adapters' when unmerged)."""
        base = self.base.shardings(self.mesh)
        if self.serving == "merged":
            return base
        eff = jax.eval_shape(self._effective, tuple(jax.eval_shape(
            lambda: lora_lib.init_adapter(self.base.config, jax.random.key(0))) for _ in self._adapter_logical))
        one = lora_lib.adapter_logical_axes(self.base.config)["lora"]
        return {"params": base["params"], "lora": tree_shardings(one, self.mesh, eff)}

    def _on_mesh(self, adapters):
        if self._adapter_shardings is None:
            self._adapter_shardings = tree_shardings(self._adapter_logical, self.mesh, adapters)
        return jax.device_put(adapters, self._adapter_shardings)

    def weights(self, params, place: Callable[[Any], LayerParams], previous: LayerParams | None) -> LayerParams:
        """The LayerParams to serve for ``params`` (an ``Adapted`` at start, then adapters alone)."""
        adapters = params.adapters if isinstance(params, Adapted) else params
        if isinstance(adapters, dict):
            adapters = (adapters,)
        adapters = self._on_mesh(adapters)
        if self.serving == "merged":
            return place(self._merge(self.base.on(self.mesh), adapters))
        eff = self._effective(adapters)
        if previous is None:  # the base's layers placed once, from wherever it is held
            return place({"params": self.base.params["params"], "lora": eff})
        lora_layers = split_params(self.config, {"params": eff}).layers
        return previous.replace(layers=tuple(
            {**old, "lora": new["params"]} for old, new in zip(previous.layers, lora_layers)))
