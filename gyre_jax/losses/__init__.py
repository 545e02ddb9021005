"""gyre_jax.losses: pure, jittable RL objectives on arrays (imports only jax, numpy and chex).

Four registries of one shape (``registry.py``: a named pure function, a typed config,
its metrics and how they combine, a one-line summary, its paper), chosen by name:

* ``POLICY_LOSSES`` (``objectives.py``): ppo_clip, gspo, cispo, decoupled_ppo, reinforce, nll.
* ``MISMATCH_CORRECTIONS`` (``corrections.py``): measure, tis, tis_seq, mis, mis_seq, icepop:
  train-inference mismatch, as a stop-gradient weight per token, with its metrics.
* ``ADVANTAGE_ESTIMATORS`` (``advantages.py``): grpo, dr_grpo, rloo, reinforce_pp,
  reinforce_pp_baseline.
* ``WEIGHT_BUILDERS`` (``weights.py``): rollout_token_mean, token_mean, constant: the
  aggregation, normalised over the global step so micro-batch losses and gradients add up.

``PolicyLossConfig.create(loss=..., mismatch=..., kl_coef=..., **options)`` builds the
configuration; ``policy_loss`` computes ``sum(w * (c * pg + kl_coef * kl - entropy_coef * H))``
from per-token log-probs, ``loss_from_logits`` / ``loss_from_hidden`` from model output
and a packed batch (``PackedRows`` field names). ``token_logprobs`` and friends compute
float32 log-probs and entropies without a float32 copy of the logits.

Use the losses in your own project::

    import jax, jax.numpy as jnp, numpy as np
    from gyre_jax.losses import PolicyLossConfig, build_loss_weights, loss_from_logits

    B, L, V, D = 2, 8, 32, 16
    rng = np.random.default_rng(0)
    loss_mask = rng.random((B, L)) < 0.5                   # which targets the policy generated
    rollout_ids = np.array([[0] * L, [1] * 4 + [2] * 4])    # rollout of each token: R = 3 in the step
    weights, _ = build_loss_weights("rollout_token_mean", loss_mask, rollout_ids, 3)  # w = 1 / (N_r * R)
    batch = {"targets": rng.integers(0, V, (B, L)).astype(np.int32), "loss_mask": loss_mask,
             "loss_weights": weights, "sequence_ids": rollout_ids,    # GSPO's sequences, whole in a row
             "behavior_logprobs": np.full((B, L), -3.0, np.float32),  # the sampler's log-probs
             "advantages": np.where(rollout_ids == 1, -0.5, 1.0).astype(np.float32)}
    config = PolicyLossConfig.create(loss="gspo", eps_low=3e-4, eps_high=4e-4)

    @jax.jit
    def grad_fn(w_DxV, h_BxLxD, mb):                        # your model here: logits = h @ w
        return jax.value_and_grad(lambda w: loss_from_logits(h_BxLxD @ w, mb, config), has_aux=True)(w_DxV)

    w, h = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((D, V), (B, L, D)))
    (loss, metrics), g = grad_fn(w, h, batch)
    (l0, _), g0 = grad_fn(w, h[:1], {k: v[:1] for k, v in batch.items()})  # a micro-batch: row 0
    (l1, _), g1 = grad_fn(w, h[1:], {k: v[1:] for k, v in batch.items()})  # and row 1
    print(float(loss), float(l0 + l1), float(jnp.abs(g0 + g1 - g).max()), float(metrics["clip_frac"]))

Metrics are weighted sums, counts or min/max (``METRIC_REDUCTIONS``): combine
micro-batches of one step with ``combine_metrics``; over a whole step the sums are
weighted means.
"""
from gyre_jax.losses import advantages as _advantages  # noqa: F401 - registers the estimators
from gyre_jax.losses.advantages import NormConfig
from gyre_jax.losses.corrections import IcePopConfig, MaskConfig, MeasureConfig, MismatchInputs, TISConfig
from gyre_jax.losses.logprobs import (
    DEFAULT_VOCAB_CHUNK,
    chunked_token_logprobs,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from gyre_jax.losses.loss_fn import BASE_KEYS, BATCH_KEYS, batch_keys, loss_from_hidden, loss_from_logits
from gyre_jax.losses.numerics import safe_exp, sequence_mean, sequence_sum
from gyre_jax.losses.objectives import (
    CISPOConfig,
    ClipConfig,
    DecoupledConfig,
    GSPOConfig,
    NLLConfig,
    PolicyInputs,
    ReinforceConfig,
)
from gyre_jax.losses.policy_gradient import (
    KL_ESTIMATORS,
    MISMATCH_OFF,
    PolicyLossConfig,
    combine_metrics,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    mean_metrics,
    policy_gradient_loss,
    policy_loss,
)
from gyre_jax.losses.registry import (
    ADVANTAGE_ESTIMATORS,
    METRIC_REDUCTIONS,
    MISMATCH_CORRECTIONS,
    POLICY_LOSSES,
    WEIGHT_BUILDERS,
    Entry,
    NoConfig,
    Registry,
)
from gyre_jax.losses.weights import (
    ConstantConfig,
    build_loss_weights,
    get_weight_builder,
    group_mean_weights,
    rollout_token_mean_weights,
    sequence_mean_weights,
    token_mean_weights,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "BASE_KEYS", "BATCH_KEYS", "CISPOConfig", "ClipConfig", "ConstantConfig",
    "DEFAULT_VOCAB_CHUNK", "DecoupledConfig", "Entry", "GSPOConfig", "IcePopConfig", "KL_ESTIMATORS",
    "METRIC_REDUCTIONS", "MISMATCH_CORRECTIONS", "MISMATCH_OFF", "MaskConfig", "MeasureConfig", "MismatchInputs",
    "NLLConfig", "NoConfig", "NormConfig", "POLICY_LOSSES", "PolicyInputs", "PolicyLossConfig", "Registry",
    "ReinforceConfig", "TISConfig", "WEIGHT_BUILDERS", "batch_keys", "build_loss_weights", "chunked_token_logprobs",
    "combine_metrics", "get_kl_estimator", "get_weight_builder", "group_mean_weights", "kl_k1", "kl_k2", "kl_k3",
    "loss_from_hidden", "loss_from_logits", "mean_metrics", "policy_gradient_loss", "policy_loss",
    "rollout_token_mean_weights", "safe_exp", "sequence_mean", "sequence_mean_weights", "sequence_sum",
    "token_entropy", "token_logprobs", "token_logprobs_and_entropy", "token_mean_weights",
]
