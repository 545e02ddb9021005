"""The policy loss: a registered objective, a mismatch correction, KL to a reference, entropy.

All inputs are [B, T] (any matching shape works). Per token, with ``w`` the loss
weight (the aggregation, ``weights.py``), ``pg`` the chosen objective's term
(``objectives.py``: ppo_clip, gspo, cispo, decoupled_ppo, reinforce, nll), ``c`` a
mismatch correction's stop-gradient weight (``corrections.py``; 1 when off), ``C`` =
``log_ratio_clamp``::

    kl     = k(logp, ref_logp)                      KL(pi || ref) estimator, overflow-safe
    l      = c * pg + kl_coef * kl - entropy_coef * H
    loss   = sum_t w_t l_t

The weights are already normalised over the *global* step, so a micro-batch's loss
is its exact share and micro-batch losses (and gradients) add up to the step's.

KL estimators (Schulman 2020, "Approximating KL divergence"), ``d = ref_logp - logp``:
``k1 = -d``; ``k2 = d^2 / 2``; ``k3 = exp(d) - 1 - d`` (unbiased, non-negative, low
variance). k3's ``exp`` overflows float32 at ``d = 88.7``; here it is ``safe_exp``:
``exp`` up to ``d = 20`` (``KL_SAFE_EXP_FROM``) and its tangent line beyond
(``numerics.safe_exp``), so the value and gradient stay finite for any finite ``d``
and equal the textbook form for ``d <= 20``. They assume samples from the current policy; with off-policy samples
they are the usual GRPO approximation.

Safety by default: the log-ratio clamp. Engine and trainer far apart (stale
weights, mismatched numerics) can give ``logp - mu = 89``, and ``exp(89)``
overflows float32: without a bound the loss is NaN at ``A = 0`` (inf * 0), +inf
at ``A < 0``, and at ``A > 0`` the loss is finite but the gradient is NaN (the
clipped branch sends 0 back through ``exp(89)``). One such token poisons the
step. ``exp`` is therefore only ever evaluated on a clamped log-ratio (``C`` = 20 by
default, as Tunix's GRPO and verl), so every branch, forward and backward, sees a
ratio in ``[e^-C, e^C]``, and a token outside the clamp has no gradient through its
ratio. For ``|logp - mu| <= C`` (every token of a healthy run) it changes nothing.
The clamp must keep every clip threshold of the objective inside ``(e^-C, e^C)``
(validated) and is at most 80, so ``e^C`` leaves float32 headroom. Dual clip
(``clip_c``) additionally caps the ``A < 0`` loss at ``-c A``.

Masking: tokens with weight 0 are replaced by safe constants *before* any
arithmetic, so garbage there (NaN, +-inf) reaches neither the loss nor any
gradient. At weighted tokens an out-of-clamp log-ratio is counted in
``clamp_frac`` (and ``ratio_max`` / ``ratio_min`` reach ``e^+-C``): a real problem
upstream, shown, not hidden.

Metrics are weighted sums, counts, or min/max (``registry.METRIC_REDUCTIONS``):
combine micro-batches of one step with ``combine_metrics``; over a whole step the
sums are weighted means.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import chex
import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.losses import corrections as _corrections  # noqa: F401 - registers the corrections
from gyre_jax.losses.corrections import MismatchInputs, mismatch_metrics
from gyre_jax.losses.numerics import (
    MAX_LOG_RATIO_CLAMP,
    check_number,
    finite_number,
    safe_exp,
    sequence_mean,
    sequence_sum,
)
from gyre_jax.losses.objectives import PolicyInputs
from gyre_jax.losses.registry import (
    METRIC_REDUCTIONS,
    MISMATCH_CORRECTIONS,
    NOT_MEANS,
    POLICY_LOSSES,
    declare_metrics,
)
from gyre_jax.registry import options_field, resolve_options

MISMATCH_OFF = "off"
# k3's exp is linear beyond this log-ratio (numerics.safe_exp): a policy e^20 away from the
# reference is penalised without overflow, whatever log_ratio_clamp the ratio uses.
KL_SAFE_EXP_FROM = 20.0


def kl_k1(logp, ref_logp):
    """k1 = logp - ref_logp (unbiased, can be negative)."""
    return logp - ref_logp


def kl_k2(logp, ref_logp):
    """k2 = (logp - ref_logp)^2 / 2 (biased, non-negative)."""
    return 0.5 * jnp.square(logp - ref_logp)


def kl_k3(logp, ref_logp):
    """k3 = exp(d) - 1 - d with d = ref_logp - logp (unbiased, non-negative); exp overflow-safe beyond the clamp."""
    d = ref_logp - logp
    return safe_exp(d, KL_SAFE_EXP_FROM) - 1.0 - d


KL_ESTIMATORS: dict[str, Callable] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable:
    try:
        return KL_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise LookupError(f"unknown kl_estimator {name!r}; known: {sorted(KL_ESTIMATORS)}") from None


# Terms every configuration reports (the objective and correction add their own).
declare_metrics(dict(loss="mean", pg_loss="mean", kl_ref="mean", entropy="mean", weight_sum="count",
                     num_tokens="count", weight_outside_mask="count"), "policy_loss")

MISMATCH_PREFIX = "mismatch_"  # every correction config field starts with it (options route by it)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Which objective and correction, their configs, and the shared terms (hashable: a jit static).

    ``PolicyLossConfig.create(loss=..., mismatch=..., **options)`` routes flat options
    (``eps_low=``, ``clip_c=``, ``mismatch_cap=``...) to the chosen entries' configs.
    """

    loss: str = "ppo_clip"  # POLICY_LOSSES name
    loss_options: Any = options_field(POLICY_LOSSES, "loss")  # its config (None: the paper's defaults)
    mismatch: str = MISMATCH_OFF  # MISMATCH_CORRECTIONS name, or "off"
    mismatch_options: Any = options_field(MISMATCH_CORRECTIONS, "mismatch", off=MISMATCH_OFF)  # its config
    kl_coef: float = 0.0  # weight of the KL-to-reference term (needs reference log-probs)
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS: k1 | k2 | k3 (overflow-safe)
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss; reported either way)
    entropy_metric: bool = True  # report the weighted entropy even when entropy_coef == 0
    # |log-ratios| are clamped to this before exp: loss and gradient stay finite for
    # any log-ratio (module docstring), whatever engine and trainer disagree by; no effect inside it.
    log_ratio_clamp: float = 20.0

    def __post_init__(self):
        where = "PolicyLossConfig."
        resolve_options(self)
        if self.correction is not None and "behavior_logprobs" not in self.entry.inputs:
            raise ValueError(f"{where}mismatch={self.mismatch!r}: loss {self.loss!r} reads no behaviour "
                             f"log-probs, so there is nothing to correct")
        for name in ("kl_coef", "entropy_coef"):
            check_number(where, name, getattr(self, name), lo=0.0)
        get_kl_estimator(self.kl_estimator)
        check_number(where, "log_ratio_clamp", self.log_ratio_clamp, lo=0.0, lo_open=True, hi=MAX_LOG_RATIO_CLAMP)
        if hasattr(self.loss_options, "check_clamp"):
            self.loss_options.check_clamp(self.log_ratio_clamp, where)

    @classmethod
    def create(cls, *, loss: str = "ppo_clip", mismatch: str = MISMATCH_OFF, kl_coef: float = 0.0,
               kl_estimator: str = "k3", entropy_coef: float = 0.0, entropy_metric: bool = True,
               log_ratio_clamp: float = 20.0, **options) -> "PolicyLossConfig":
        """Flat options to the entries' configs, by field name (the corrections' fields are the
        ``mismatch_*`` ones, so each option names one field, as the RL config's flag does). An option
        the chosen entry does not have is a ValueError naming it (None values mean "the default" and
        are skipped)."""
        where = "PolicyLossConfig."
        entry = POLICY_LOSSES.get(loss)
        obj_opts = {k: v for k, v in options.items() if not k.startswith(MISMATCH_PREFIX) and v is not None}
        mis_opts = {k: v for k, v in options.items() if k.startswith(MISMATCH_PREFIX) and v is not None}
        obj_fields = {f.name for f in dataclasses.fields(entry.config)}
        for k in sorted(set(obj_opts) - obj_fields):
            raise ValueError(f"{where}{k} does not apply to loss {loss!r} (its options: {sorted(obj_fields)})")
        mc = None
        if mismatch != MISMATCH_OFF:
            ce = MISMATCH_CORRECTIONS.get(mismatch)
            fields = {f.name for f in dataclasses.fields(ce.config)}
            for k in sorted(set(mis_opts) - fields):
                raise ValueError(f"{where}{k} does not apply to mismatch {mismatch!r} (its options: {sorted(fields)})")
            mc = ce.config(**mis_opts)
        elif mis_opts:
            raise ValueError(f"{where}{sorted(mis_opts)[0]} is set but mismatch is off")
        return cls(loss=loss, loss_options=entry.config(**obj_opts), mismatch=mismatch, mismatch_options=mc,
                   kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef,
                   entropy_metric=entropy_metric, log_ratio_clamp=log_ratio_clamp)

    @property
    def entry(self):
        return POLICY_LOSSES.get(self.loss)

    @property
    def correction(self):
        return None if self.mismatch == MISMATCH_OFF else MISMATCH_CORRECTIONS.get(self.mismatch)

    def batch_needs(self) -> tuple[str, ...]:
        """Per-token inputs beyond targets, loss_mask and loss_weights (batch keys), in order."""
        need = list(self.entry.inputs)
        if self.correction is not None:
            need.append("trainer_logprobs")
        if self.kl_coef:
            need.append("ref_logprobs")
        return tuple(need)

    def step_passes(self) -> frozenset[str]:
        """What a trainer must compute on the step's rows before its gradients (the RL loop's
        per-step pass): ``prox`` (the step's own params), ``trainer`` (each token's behaviour
        version), ``ref`` (the reference params), ``seq_log_ratio`` / ``seq_log_mismatch``
        (per-sequence statistics of those)."""
        out = set()
        if "prox_logprobs" in self.entry.inputs or self.entry.extra.get("sequence_stat"):
            out.add("prox")
        if self.entry.extra.get("sequence_stat"):
            out.add("seq_log_ratio")
        if self.correction is not None:
            out.add("trainer")
            if self.correction.level == "sequence":
                out.add("seq_log_mismatch")
        if self.kl_coef:
            out.add("ref")
        return frozenset(out)

    def metric_names(self) -> set[str]:
        """Every metric ``policy_loss`` reports for this config (for tests and dashboards)."""
        names = {"loss", "pg_loss", "weight_sum", "num_tokens"} | set(self.entry.metrics)
        if self.correction is not None:
            names |= set(self.correction.metrics) | set(_corrections.MISMATCH_METRICS)
        return names


_COMBINE_OPS = {"sum": (jnp.add, np.add), "min": (jnp.minimum, np.minimum), "max": (jnp.maximum, np.maximum)}


def combine_metrics(a: Mapping, b: Mapping, reductions: Mapping[str, str] | None = None, *, host: bool = False) -> dict:
    """Merge two micro-batches' metrics of one step (jittable, associative): the one metrics combiner.

    ``reductions``: metric -> sum/min/max (default: the policy loss's ``METRIC_REDUCTIONS``);
    ``host=True`` combines numpy values without touching a device (the elastic step's host sums).
    """
    if a.keys() != b.keys():
        raise ValueError(f"combine_metrics: different metric keys {sorted(a)} vs {sorted(b)}")
    table = METRIC_REDUCTIONS if reductions is None else reductions
    out = {}
    for k in a:
        how = table.get(k)
        if how not in _COMBINE_OPS:
            raise KeyError(f"combine_metrics: no reduction (sum/min/max) for metric {k!r}; got {how!r}")
        out[k] = _COMBINE_OPS[how][int(host)](a[k], b[k])
    return out


def mean_metrics(m: dict) -> dict:
    """Turn summed metrics into weighted means over the tokens they cover.

    For a whole step (weights summing to 1) this changes nothing; for one
    micro-batch it gives that micro-batch's own means.
    """
    ws = m["weight_sum"]
    safe = jnp.where(ws != 0, ws, 1.0)
    return {k: (v if k in NOT_MEANS else v / safe) for k, v in m.items()}


def _sequence_stat(batch, key, x_BxT, active, how, where):
    """A per-sequence statistic of ``x`` broadcast to tokens: precomputed under ``key``, or from ``sequence_ids``."""
    if key in batch:
        return jnp.asarray(batch[key]).astype(jnp.float32)
    if "sequence_ids" not in batch:
        raise KeyError(f"{where}: needs {key!r} (precomputed per token) or 'sequence_ids' (the batch then "
                       f"holds whole sequences) in the batch; it has {sorted(batch)}")
    fn = sequence_mean if how == "mean" else sequence_sum
    return fn(x_BxT, active, jnp.asarray(batch["sequence_ids"]))


def policy_loss(logp_BxT: jax.Array, weights_BxT: jax.Array, batch: Mapping[str, Any],
                config: PolicyLossConfig = PolicyLossConfig(), *, entropy_BxT: jax.Array | None = None,
                ref_logp_BxT: jax.Array | None = None, where: str = "policy_loss"):
    """``(loss, metrics)``; the math is in the module docstring.

    ``batch`` holds the per-token inputs the config reads (``config.batch_needs()``:
    ``behavior_logprobs``, ``advantages``, ``prox_logprobs``, ``trainer_logprobs``,
    ``ref_logprobs``; ``seq_log_ratio`` / ``seq_log_mismatch`` or ``sequence_ids`` for
    sequence-level entries), each shaped like ``logp_BxT``; ``ref_logp_BxT`` overrides
    ``batch['ref_logprobs']`` (which is read only with ``kl_coef != 0``; the kwarg also
    gives the ``kl_ref`` metric at ``kl_coef == 0``). Metrics: ``loss``, ``pg_loss``, ``weight_sum``,
    ``num_tokens``, the objective's and correction's, ``kl_ref`` (with reference
    log-probs), ``entropy`` (with ``entropy_BxT``).
    """
    entry = config.entry
    ref_logp_BxT, needs = _checked_inputs(logp_BxT, weights_BxT, batch, config, entropy_BxT, ref_logp_BxT, where)
    f32 = jnp.float32
    sg = jax.lax.stop_gradient
    active = weights_BxT != 0
    w = jnp.where(active, weights_BxT, 0.0).astype(f32)

    def safe(x):
        return jnp.where(active, jnp.asarray(x).astype(f32), 0.0)

    def given(key):
        return sg(safe(batch[key])) if key in needs else None

    c = config.log_ratio_clamp
    logp = safe(logp_BxT)
    zeros = jnp.zeros(logp_BxT.shape, f32)
    old = given("behavior_logprobs")
    adv = given("advantages")
    metrics: dict = {}
    corr = None
    if config.correction is not None:
        corr, old = _mismatch_correction(given("trainer_logprobs"), old, w, active, batch, config, metrics, safe, where)
    seq_lr = None
    if entry.extra.get("sequence_stat"):
        seq_lr = sg(safe(_sequence_stat(batch, "seq_log_ratio", sg(logp - old), active, "mean", where)))
    x = PolicyInputs(logp=logp, old_logp=zeros if old is None else old, advantages=zeros if adv is None else adv,
                     weights=w, active=active, log_ratio_clamp=c, prox_logp=given("prox_logprobs"),
                     seq_log_ratio=seq_lr)
    pg, om = entry.fn(x, config.loss_options)
    pg = jnp.where(active, pg, 0.0)
    if corr is not None:
        pg = pg * corr
    metrics.update(om)
    per_token = pg
    if ref_logp_BxT is not None:
        kl = get_kl_estimator(config.kl_estimator)(logp, sg(safe(ref_logp_BxT)))
        per_token = per_token + config.kl_coef * kl
        metrics["kl_ref"] = jnp.sum(w * sg(kl))
    if entropy_BxT is not None:
        ent = safe(entropy_BxT)
        per_token = per_token - config.entropy_coef * ent
        metrics["entropy"] = jnp.sum(w * sg(ent))
    loss = jnp.sum(w * per_token)
    metrics.update(loss=sg(loss), pg_loss=sg(jnp.sum(w * pg)), weight_sum=jnp.sum(w),
                   num_tokens=jnp.sum(active).astype(f32))
    return loss, metrics


def _checked_inputs(logp_BxT, weights_BxT, batch, config: PolicyLossConfig, entropy_BxT, ref_logp_BxT, where: str):
    """(the reference log-probs to use, the batch keys the loss reads): every input the config needs is
    there, shaped like ``logp_BxT`` (a clear error naming what is missing or misshapen otherwise)."""
    shape = logp_BxT.shape
    chex.assert_shape(weights_BxT, shape, custom_message=f"{where}: weights must have the shape of logp_BxT")
    if ref_logp_BxT is None and config.kl_coef and "ref_logprobs" in batch:
        ref_logp_BxT = batch["ref_logprobs"]  # read only when the KL term is on (a loop batch always has the key)
    if config.kl_coef != 0.0 and ref_logp_BxT is None:
        raise ValueError(f"{where}: kl_coef != 0 needs reference log-probs (ref_logp_BxT or batch['ref_logprobs'])")
    if config.entropy_coef != 0.0 and entropy_BxT is None:
        raise ValueError(f"{where}: entropy_coef != 0 needs entropy_BxT")
    needs = [k for k in config.batch_needs() if k != "ref_logprobs"]
    missing = [k for k in needs if k not in batch]
    if missing:
        raise KeyError(f"{where}: loss {config.loss!r}"
                       f"{'' if config.correction is None else f' with mismatch {config.mismatch!r}'} "
                       f"needs {missing} in the batch; it has {sorted(batch)}")
    for name, x in [*((k, batch[k]) for k in needs), ("ref_logp_BxT", ref_logp_BxT), ("entropy_BxT", entropy_BxT)]:
        if x is not None:
            chex.assert_shape(x, shape, custom_message=f"{where}: {name} must have the shape of logp_BxT")
    return ref_logp_BxT, needs


def _mismatch_correction(tr, old, w, active, batch, config: PolicyLossConfig, metrics: dict, safe, where: str):
    """The train-inference mismatch correction's per-token weight (stop-gradient, 0 off the active
    tokens) and the log-prob the policy ratio is then taken against: the trainer's own behaviour
    log-prob ``tr``. Its metrics go into ``metrics``."""
    sg = jax.lax.stop_gradient
    assert config.correction is not None  # policy_loss calls this only with a correction
    log_rho = tr - old
    seq = None
    if config.correction.level == "sequence":
        seq = sg(safe(_sequence_stat(batch, "seq_log_mismatch", log_rho, active, "sum", where)))
    mx = MismatchInputs(log_rho=log_rho, seq_log_rho=seq, weights=w, active=active,
                        log_ratio_clamp=config.log_ratio_clamp)
    corr, cm = config.correction.fn(mx, config.mismatch_options)
    corr = sg(jnp.where(active, corr, 0.0))
    metrics.update(cm, **mismatch_metrics(mx, corr))
    return corr, tr


def policy_gradient_loss(
    logp_BxT: jax.Array,
    behavior_logp_BxT: jax.Array,
    advantages_BxT: jax.Array,
    weights_BxT: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logp_BxT: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_BxT: jax.Array | None = None,
    entropy_coef: float = 0.0,
    log_ratio_clamp: float = 20.0,
    clip_c: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``policy_loss`` with ``loss='ppo_clip'`` from plain arrays and keywords (the classic GRPO/PPO call)."""
    where = "policy_gradient_loss"
    for name, x in (("behavior_logp_BxT", behavior_logp_BxT), ("advantages_BxT", advantages_BxT)):
        chex.assert_shape(x, logp_BxT.shape, custom_message=f"{where}: {name} must have the shape of logp_BxT")
    try:
        cfg = PolicyLossConfig.create(loss="ppo_clip", eps_low=eps_low, eps_high=eps_high, clip_c=clip_c,
                                      kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef,
                                      log_ratio_clamp=log_ratio_clamp)
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).replace('ClipConfig.', '').replace('PolicyLossConfig.', '')}") from None
    if kl_coef != 0.0 and ref_logp_BxT is None:
        raise ValueError(f"{where}: kl_coef != 0 needs ref_logp_BxT")
    batch = {"behavior_logprobs": behavior_logp_BxT, "advantages": advantages_BxT}
    return policy_loss(logp_BxT, weights_BxT, batch, cfg, entropy_BxT=entropy_BxT, ref_logp_BxT=ref_logp_BxT,
                       where=where)


__all__ = [
    "KL_ESTIMATORS", "METRIC_REDUCTIONS", "MISMATCH_OFF", "PolicyLossConfig", "combine_metrics", "finite_number",
    "get_kl_estimator", "kl_k1", "kl_k2", "kl_k3", "mean_metrics", "policy_gradient_loss", "policy_loss",
]
