"""gyre_jax.losses: pure, jittable RL losses on arrays (imports only jax, numpy and chex).

* ``token_logprobs`` / ``token_entropy`` / ``token_logprobs_and_entropy``:
  from [B, L, V] logits, float32 results, no float32 copy of the logits.
* ``chunked_token_logprobs``: the same from hidden states and the unembedding,
  never materialising the logits.
* ``policy_gradient_loss``: clipped importance ratio (eps_low / eps_high), the
  log-ratio clamped (``log_ratio_clamp``, so loss and gradient stay finite for
  any log-ratio), optional dual clip (``clip_c``), KL to a reference
  (k1/k2/k3), entropy bonus; ``loss = sum(weights * per_token)``.
* weight builders (``rollout_token_mean_weights``, ``token_mean_weights``,
  ``sequence_mean_weights``; registry ``get_weight_builder``): the aggregation,
  normalised over the global step so micro-batch losses and gradients add up.
* ``loss_from_logits`` / ``loss_from_hidden``: one call from model output and a
  packed batch (``PackedRows`` field names) to ``(loss, metrics)``.

Use the losses in your own project::

    import jax, jax.numpy as jnp, numpy as np
    from gyre_jax.losses import PolicyLossConfig, loss_from_logits, rollout_token_mean_weights

    B, L, V = 2, 8, 32
    rng = np.random.default_rng(0)
    loss_mask = rng.random((B, L)) < 0.5              # which targets the policy generated
    rollout_ids = np.array([[0] * L, [1] * 4 + [2] * 4])  # rollout of each token, R = 3 in the step
    batch = {
        "targets": rng.integers(0, V, (B, L)).astype(np.int32),
        "loss_mask": loss_mask,
        "behavior_logprobs": np.full((B, L), -3.0, np.float32),   # recorded by the sampler
        "advantages": np.where(rollout_ids == 1, -0.5, 1.0).astype(np.float32),
        # each rollout's tokens average to 1/R: w = 1 / (N_r * R), global over the step
        "loss_weights": rollout_token_mean_weights(loss_mask, rollout_ids, 3),
    }
    config = PolicyLossConfig(eps_low=0.2, eps_high=0.28, entropy_coef=0.0)

    def loss_fn(w_DxV, hidden_BxLxD):
        logits_BxLxV = hidden_BxLxD @ w_DxV          # your model here
        return loss_from_logits(logits_BxLxV, batch, config)

    w, h = jnp.ones((16, V)) * 0.01, jnp.ones((B, L, 16))
    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(w, h)
    print(float(loss), float(metrics["clip_frac"]), float(metrics["entropy"]))

Metrics are weighted sums (see ``METRIC_REDUCTIONS``): combine micro-batches of
one step with ``combine_metrics``; over a whole step they are weighted means.
"""
from gyre_jax.losses.logprobs import (
    DEFAULT_VOCAB_CHUNK,
    chunked_token_logprobs,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from gyre_jax.losses.loss_fn import BATCH_KEYS, loss_from_hidden, loss_from_logits
from gyre_jax.losses.policy_gradient import (
    KL_ESTIMATORS,
    METRIC_REDUCTIONS,
    PolicyLossConfig,
    combine_metrics,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    mean_metrics,
    policy_gradient_loss,
)
from gyre_jax.losses.weights import (
    WEIGHT_BUILDERS,
    build_loss_weights,
    get_weight_builder,
    group_mean_weights,
    rollout_token_mean_weights,
    sequence_mean_weights,
    token_mean_weights,
)

__all__ = [
    "BATCH_KEYS",
    "DEFAULT_VOCAB_CHUNK",
    "KL_ESTIMATORS",
    "METRIC_REDUCTIONS",
    "PolicyLossConfig",
    "WEIGHT_BUILDERS",
    "build_loss_weights",
    "chunked_token_logprobs",
    "combine_metrics",
    "get_kl_estimator",
    "get_weight_builder",
    "group_mean_weights",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "loss_from_hidden",
    "loss_from_logits",
    "mean_metrics",
    "policy_gradient_loss",
    "rollout_token_mean_weights",
    "sequence_mean_weights",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "token_mean_weights",
]
