"""Long context: the model's blockwise path = dense at tile sizes that really tile, and
context parallelism (sequence split over 8 host devices) = one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model.config import model_config_tiny
from gyre_jax.model.context_parallel import context_parallel_tree_attention
from gyre_jax.model.transformer import Transformer, init_params
from gyre_jax.model.tree_attention import packed_tree_attention
from tests.test_tree_attention_blockwise import qkv, random_rows

TOL = 1e-5


def test_transformer_blockwise_equals_dense_logits_and_grads():
    seg, sub = random_rows(4, row_len=96, batch=2)
    cfg = model_config_tiny(attention_block_q=16, attention_block_k=32)
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, seg.shape), jnp.int32)
    positions = jnp.asarray(np.random.default_rng(1).integers(0, 96, seg.shape), jnp.int32)
    args = (tokens, positions, jnp.asarray(seg), jnp.asarray(sub))

    def logits_and_grads(c):
        def loss(p):
            lg = Transformer(c).apply(p, *args)
            return jnp.sum(jax.nn.log_softmax(lg)[..., 0]), lg
        (_, lg), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return lg, g

    lg_b, g_b = logits_and_grads(cfg)
    lg_d, g_d = logits_and_grads(cfg.replace(attention_impl="dense"))
    np.testing.assert_allclose(np.asarray(lg_b), np.asarray(lg_d), atol=TOL, rtol=TOL)
    check_grads_close(g_b, g_d)


@pytest.mark.slow
def test_transformer_with_the_pallas_kernel_config():
    """attention_kernel='pallas_interpret' reaches the Pallas kernel through the model's config."""
    seg, sub = random_rows(4, row_len=96, batch=1)
    cfg = model_config_tiny(attention_block_q=16, attention_block_k=32)
    params = init_params(cfg, jax.random.key(0))
    args = (jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, seg.shape), jnp.int32),
            jnp.asarray(np.arange(96)[None]), jnp.asarray(seg), jnp.asarray(sub))
    want = Transformer(cfg).apply(params, *args)
    got = jax.jit(Transformer(cfg.replace(attention_kernel="pallas_interpret")).apply)(params, *args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


def check_grads_close(g_b, g_d):
    for path, a in jax.tree_util.tree_leaves_with_path(g_b):
        b = g_d
        for key in path:
            b = b[key.key]
        scale = float(np.abs(np.asarray(b)).max())
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL * max(1.0, scale), rtol=TOL,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("block", [8, pytest.param(16, marks=pytest.mark.slow)])
def test_context_parallel_equals_single_device(block):
    """8 sequence shards of 24 tokens (a tile size that does and one that does not
    divide a shard): forward and gradients equal the single-device blockwise result."""
    seg, sub = random_rows(5, row_len=192, batch=2)
    q, k, v, d_out = (jnp.asarray(x, jnp.float32) for x in qkv(6, 2, 192, 192))
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    sharded = NamedSharding(mesh, PartitionSpec(None, "seq"))
    seg_j, sub_j = jnp.asarray(seg), jnp.asarray(sub)

    def grads(fn, *qkv_in):
        def loss(q, k, v):
            o = fn(q, k, v)
            return jnp.sum(o * d_out), o
        (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv_in)
        return [np.asarray(x) for x in (o, *g)]

    want = grads(lambda q, k, v: packed_tree_attention(q, k, v, seg_j, sub_j, block_q=block, block_k=block), q, k, v)
    seg_s, sub_s = jax.device_put(seg_j, sharded), jax.device_put(sub_j, sharded)
    got = grads(lambda q, k, v: context_parallel_tree_attention(
        q, k, v, seg_s, sub_s, mesh=mesh, axis="seq", block_q=block, block_k=block),
        *(jax.device_put(x, sharded) for x in (q, k, v)))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL, err_msg=name)


@pytest.mark.slow
def test_transformer_context_parallel_equals_one_device():
    """config.context_parallel_axis: the whole model over rows split 8 ways along their sequence
    (jax.set_mesh) gives the single-device logits."""
    seg, sub = random_rows(9, row_len=128, batch=1)
    cfg = model_config_tiny(attention_block_q=8, attention_block_k=8)
    params = init_params(cfg, jax.random.key(0))
    args = [jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, seg.shape), jnp.int32),
            jnp.asarray(np.arange(128)[None], jnp.int32), jnp.asarray(seg), jnp.asarray(sub)]
    want = jax.jit(Transformer(cfg).apply)(params, *args)
    mesh = Mesh(np.array(jax.devices()[:8]), ("seq",))
    sharded = NamedSharding(mesh, PartitionSpec(None, "seq"))
    with jax.set_mesh(mesh):
        got = jax.jit(Transformer(cfg.replace(context_parallel_axis="seq")).apply)(
            params, *(jax.device_put(a, sharded) for a in args))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


@pytest.mark.slow  # the JetStream driver takes ~10 s to stop
def test_prefix_cache_is_bounded_in_bytes():
    """prefix_cache_bytes evicts least-recently-used prefixes by k/v size (one long prefix can be GiBs)."""
    import asyncio

    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.engine_state import KVBlock
    from gyre_jax.serving.jetstream_backend import JetStreamBackend
    from gyre_jax.testing.tiny_serving_model import CFG, sharp_params

    def block(n):
        z = jnp.zeros((CFG.n_layers, n, CFG.n_kv_heads, CFG.head_dim), CFG.jnp_dtype)
        return KVBlock(z, z, n)

    per = 2 * block(32).k.nbytes
    be = JetStreamBackend(GyreEngine(CFG, sharp_params(), max_slots=2, max_len=64), prefix_cache_bytes=int(2.5 * per))
    try:
        seq = np.arange(1, 40, dtype=np.int32)
        for key in ("a", "b", "c"):
            be._store(key, be.policy_version, seq, block(32))
        assert list(be._cache) == ["b", "c"] and be.prefix_cache_bytes() == 2 * per
        assert be._lookup("a", seq) is None and be._lookup("b", seq) is not None  # b is now most recent
        be._store("d", be.policy_version, seq, block(32))
        assert list(be._cache) == ["b", "d"]
        be._store("long", be.policy_version, seq, block(128))  # over the budget alone: kept, the rest evicted
        assert list(be._cache) == ["long"]
        assert be.stats()["prefix_cache_evicted"] == 4
    finally:
        asyncio.run(be.close())


# ----------------------------------------------------------------------------- training memory
def test_memory_plan_from_row_length():
    """Short rows: plain; rows >= long_row_len: per-layer remat + chunked logits; big vocab: chunked
    logits only; the config and an explicit logits_chunk override the rule."""
    from gyre_jax.cells.loss import memory_plan

    def _plan(*a, **k):
        p = memory_plan(*a, **k)
        return p.remat, p.logits_chunk

    tiny = model_config_tiny(max_seq_len=1 << 17)
    assert _plan(tiny, 4, 256) == (False, None)
    assert _plan(tiny, 1, 8191) == (False, None)
    assert _plan(tiny, 1, 8192) == (True, 4096)
    assert _plan(tiny, 1, 65536) == (True, 4096)
    assert _plan(tiny, 1, 1000) == (False, None)
    assert _plan(tiny.replace(long_row_len=1000), 1, 1000) == (True, 1000)  # chunk <= row_len
    assert _plan(tiny.replace(long_row_len=0), 1, 65536) == (False, None)  # rule off
    assert _plan(tiny.replace(remat=True), 4, 256) == (True, None)
    assert _plan(tiny, 1, 65536, logits_chunk=None) == (True, None)
    qwen_vocab = tiny.replace(vocab_size=151_936)  # 4096 x 151,936 f32 logits = 2.3 GiB > the budget
    assert _plan(qwen_vocab, 1, 4096) == (False, 128)
    assert _plan(qwen_vocab, 1, 512) == (False, None)
    with pytest.raises(ValueError, match="long_row_len"):
        tiny.replace(long_row_len=-1)
    with pytest.raises(ValueError, match="remat_policy"):
        tiny.replace(remat_policy="some")


def _policy_batch(row_len, rows, seed):
    from gyre_jax.cells.train_step import device_micro_batch
    from gyre_jax.trajectory.binpack import pack_trees
    from tests.test_serialize import random_tree

    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, max_depth=4) for _ in range(6)]
    mb = device_micro_batch(pack_trees(trees, rng.standard_normal(6), row_len, min_rows=rows).rows)
    mb = {k: jnp.asarray(v[:rows]) for k, v in mb.items()}  # the first rows (their weights need not sum to 1)
    assert mb["tokens"].shape[0] == rows and mb["loss_mask"].any()
    return mb


def _long_row_plan_equals_plain(monkeypatch, remat_policy):
    import gyre_jax.cells.loss as cell_loss
    from gyre_jax.losses import PolicyLossConfig, policy_gradient_loss

    monkeypatch.setattr(cell_loss, "MIN_CHUNK", 16)
    monkeypatch.setattr(cell_loss, "MAX_CHUNK", 16)  # 3 chunks over 40 positions, the last padded
    cfg = model_config_tiny(attention_block_q=16, attention_block_k=16, long_row_len=32, remat_policy=remat_policy)
    mb = _policy_batch(40, 2, seed=3)
    loss_cfg = PolicyLossConfig()
    params = init_params(cfg, jax.random.key(1))
    plan = cell_loss.memory_plan(cfg, 2, 40)
    assert (plan.remat, plan.logits_chunk) == (True, 16)

    def reference(p):
        logits = Transformer(cfg.replace(attention_impl="dense", long_row_len=0)).apply(
            p, mb["tokens"], mb["positions"], mb["segment_ids"], mb["subtree_end"])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), mb["targets"][..., None], -1)[..., 0]
        w = jnp.where(mb["loss_mask"].astype(bool), mb["loss_weights"], 0.0)
        return policy_gradient_loss(logp, mb["behavior_logprobs"], mb["advantages"], w)[0]  # PolicyLossConfig()'s

    want_loss, want_g = jax.jit(jax.value_and_grad(reference))(params)
    auto = cell_loss.policy_loss_fn(cfg, loss_cfg)
    plain = cell_loss.policy_loss_fn(cfg.replace(long_row_len=0), loss_cfg, logits_chunk=None)
    # remat2 = jax.checkpoint: once for the scanned layer, once for the chunk of the vocab projection
    assert str(jax.make_jaxpr(lambda p: auto(p, mb)[0])(params)).count("remat2[") == 2
    assert "remat2[" not in str(jax.make_jaxpr(lambda p: plain(p, mb)[0])(params))
    for f in (auto, plain):
        loss, g = jax.jit(jax.value_and_grad(lambda p: f(p, mb)[0]))(params)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=TOL, atol=TOL)
        check_grads_close(g, want_g)


@pytest.mark.slow  # ~14 s; the blockwise-vs-dense equality stays in the default run
def test_long_row_plan_loss_and_grads_equal_plain(monkeypatch):
    """The automatic long-row plan (per-layer remat, logits in chunks that do not divide the
    row) gives the loss and gradients of full logits without remat, both checked against an
    independent reference: dense-mask attention, log_softmax of the whole logits."""
    _long_row_plan_equals_plain(monkeypatch, "full")


@pytest.mark.slow
def test_long_row_plan_with_save_dots_policy(monkeypatch):
    _long_row_plan_equals_plain(monkeypatch, "save_dots")
