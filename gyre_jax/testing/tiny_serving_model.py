"""The tiny model the serving tests decode with (a test helper, not a fake).

Shared so the engine tests and the live-server tests exercise the same weights:
the byte tokenizer's vocabulary, and weights scaled up so greedy outputs vary and
the top-2 logit gaps (>0.04) dwarf float32 cache-vs-full-forward differences (~1e-5).
"""
import jax

from gyre_jax.model import init_params, model_config_tiny

CFG = model_config_tiny(vocab_size=272, max_seq_len=256)


def sharp_params(seed=0, scale=2.0):
    return jax.tree.map(lambda x: x * scale, init_params(CFG, jax.random.key(seed)))
