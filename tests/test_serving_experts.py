"""Serving a mixture-of-experts model with its experts split over the serving mesh's 'expert' axis
(cells.serve_expert): GyreEngine's prefill and decode dispatch each token to its experts' devices
all-to-all (model/moe.py) and give the one-device engine's tokens, log-probs, recorded routing
and prefill k/v.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from gyre_jax.cells.mesh import CellConfig, Role, split_cells
from gyre_jax.model import init_params, model_config_tiny
from gyre_jax.serving.backend import SamplingParams
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.engine_state import PrefillInput, decode_result_steps
from gyre_jax.sharding import DATA, EXPERT

# Layer 0 routes to experts, layer 1 is dense: layer 1's k/v and every logit depend on the dispatch.
CFG = model_config_tiny(vocab_size=272, max_seq_len=64, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, mlp_only_layers=(1,))
SLOTS, MAX_LEN = 4, 64
ATOL = 1e-5


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(7))


def _requests():
    rs = np.random.RandomState(1)
    out = []
    for i, (n, temp) in enumerate([(5, 0.0), (14, 0.0), (9, 1.0)]):  # prompts of one 16-token prefill bucket
        p = rs.randint(0, 256, n).astype(np.int32)
        out.append((i, PrefillInput(f"r{i}", p[:-1], int(p[-1]), 0,
                                    SamplingParams(max_tokens=10, temperature=temp, seed=3 + i))))
    return out


def _serve(engine):
    """Each request into its own slot, then decode until every slot is done: per slot the prefill's k/v
    and the [(token, log-prob, routing)] it produced."""
    ds = engine.init_decode_state()
    lay = engine.result_layout
    kv, out = {}, {}
    for slot, inp in _requests():
        pre = engine.prefill(params=engine.params_ref, padded_tokens=inp, true_length=len(inp.tokens))
        kv[slot] = (np.asarray(pre.k), np.asarray(pre.v))
        ds = engine.insert(pre, ds, slot)
        out[slot] = []
    live = set(out)
    for _ in range(12):
        ds, res = engine.generate(engine.params_ref, ds)
        data = np.asarray(res.data)
        k2 = res.tokens_idx[1]
        for s in list(live):
            valid = data[s, k2: 2 * k2: lay.step_cols]
            steps = decode_result_steps(data[s, :k2], lay)
            out[s] += steps
            if not valid.all() or len(steps) < len(valid):
                live.discard(s)
        if not live:
            break
    assert not live and all(len(v) == 10 for v in out.values()), {s: len(v) for s, v in out.items()}
    return kv, out


@pytest.fixture(scope="module")
def one_device(params):
    return _serve(GyreEngine(CFG, params, max_slots=SLOTS, max_len=MAX_LEN, tokens_per_call=2))


@pytest.mark.parametrize("cell_size, serve_expert, kv_cache", [(2, 2, "contiguous"), (4, 2, "paged")],
                         ids=["expert2", "data2xexpert2-paged"])
def test_expert_parallel_engine_equals_one_device(params, one_device, cell_size, serve_expert, kv_cache):
    [cell] = split_cells(CellConfig(cell_size=cell_size, serve_tensor=1, serve_expert=serve_expert),
                         jax.devices()[:cell_size])
    mesh = cell.mesh(Role.ROLLOUT)
    assert dict(mesh.shape) == {DATA: cell_size // serve_expert, EXPERT: serve_expert, "tensor": 1}
    engine = GyreEngine(CFG, params, mesh=mesh, max_slots=SLOTS, max_len=MAX_LEN, tokens_per_call=2,
                        kv_cache=kv_cache)
    # Each device holds its share of the experts only (the rules table splits them over 'expert').
    gate = engine.params_ref.value.layers[0]["params"]["moe"]["gate"]  # [E, D, F]
    assert gate.sharding.spec[0] == EXPERT
    assert {s.data.shape[0] for s in gate.addressable_shards} == {CFG.num_experts // serve_expert}
    # ... and prefill and decode send tokens to them all-to-all (not an all-gather of the weights).
    prefill = engine._prefill_new.lower(engine.params_ref.value, np.zeros(16, np.int32), np.int32(5)).as_text()
    decode = engine._generate.lower(engine.params_ref.value, engine.init_decode_state()).as_text()
    assert "all_to_all" in prefill and "all_to_all" in decode
    kv, out = _serve(engine)
    kv1, out1 = one_device
    for slot in out1:
        assert [t for t, _, _ in out[slot]] == [t for t, _, _ in out1[slot]], slot
        np.testing.assert_allclose([lp for _, lp, _ in out[slot]], [lp for _, lp, _ in out1[slot]], rtol=0, atol=ATOL)
        np.testing.assert_array_equal(np.stack([r for *_, r in out[slot]]), np.stack([r for *_, r in out1[slot]]))
        for got, want in zip(kv[slot], kv1[slot]):
            np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_experts_must_split_evenly_over_the_serving_expert_axis(params):
    [cell] = split_cells(CellConfig(cell_size=8, serve_tensor=1, serve_expert=8))
    with pytest.raises(ValueError, match=r"4 experts do not split evenly over its 8 'expert' devices \(cells.serve_expert\)"):
        GyreEngine(CFG, params, mesh=cell.mesh(Role.ROLLOUT), max_slots=SLOTS, max_len=MAX_LEN)
    with pytest.raises(ValueError, match=r"cell_size=4 is not a multiple of serve_tensor \* serve_expert=8"):
        CellConfig(cell_size=4, serve_tensor=2, serve_expert=4)
