"""The loss a training cell differentiates: the model over packed rows + the policy-gradient loss.

Glue only: the model (gyre_jax.model) and the loss math (gyre_jax.losses) live
elsewhere. Returns a ``loss_fn(params, micro_batch) -> (loss, metrics)`` for
``CellSteps``; combine its metrics with ``gyre_jax.losses.METRIC_REDUCTIONS``.
"""
from __future__ import annotations

from gyre_jax.losses import PolicyLossConfig, loss_from_hidden, loss_from_logits
from gyre_jax.model import ModelConfig, Transformer


def policy_loss_fn(model_config: ModelConfig, loss_config: PolicyLossConfig = PolicyLossConfig(), *, logits_chunk: int | None = None):
    """``logits_chunk``: scan the vocab projection over chunks of this many positions
    (never materialising [B, L, V] logits, for long rows); None = full logits.
    """
    model = Transformer(model_config)

    def loss_fn(params, mb):
        inputs = (mb["tokens"], mb["positions"], mb["segment_ids"], mb["subtree_end"])
        if logits_chunk is None:
            return loss_from_logits(model.apply(params, *inputs), mb, loss_config)
        hidden_BxLxD, unembed_DxV = model.apply(params, *inputs, return_hidden=True)
        return loss_from_hidden(hidden_BxLxD, unembed_DxV, mb, loss_config, chunk_size=logits_chunk, layout="DxV")

    return loss_fn
