"""Synthetic training (job 'train_synthetic'): the tiny model on synthetic tree-packed data (CPU).

Command:
    python -m launch.main --config configs/synthetic_train.py --workdir /tmp/synth

Expected runtime: ~20-30 s on 2 CPU cores (about half of it start-up and compiling).
Expected result: a progress bar whose loss falls from ~4-4.7 (random init; ln 63
= 4.14 is uniform) to ~1.8 (mean of the last 20 steps), accuracy on trainable
targets rising from ~0.03 to ~0.6; per-step metrics in /tmp/synth/metrics.jsonl.
The floor is well above 0: the first token of every model output is random.
Every field can be overridden, e.g. ``--config.steps=100``.

Data parallel over every device of every process (rows must split evenly), e.g.
two processes of 2 CPU devices each, training like one process of 4 (loss and
gradient norm to an ulp or two: the cross-process all-reduce sums in another order;
params within 1e-6; tests/test_multihost.py):
    for i in 0 1; do python -m launch.main --config configs/synthetic_train.py --config.num_cpu_devices=2 \
        --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=$i --workdir /tmp/synth2 & done; wait
Process 0 prints and writes the metrics; the others train silently.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "train_synthetic"  # gyre_jax.jobs name -> gyre_jax.synthetic_train.run
    c.seed = 0  # one seed for data, init and everything else
    c.num_cpu_devices = 1  # host devices per process on CPU (the launcher sets it before JAX starts); rows split over all
    c.steps = 200  # optimizer steps
    c.rows = 4  # packed rows per step (fixed, so the step compiles once)
    c.row_len = 128  # tokens per row, L
    c.learning_rate = 1e-2  # AdamW peak learning rate (tiny model, short run)
    c.warmup_steps = 5  # linear warm-up, then cosine decay to 10% of the peak
    c.weight_decay = 0.0  # AdamW decoupled weight decay
    c.grad_clip = 1.0  # global-norm gradient clipping
    # Synthetic trees (gyre_jax.synthetic_train.TreeSampler): arithmetic progressions mod V.
    c.prompt_len = 16  # mean prompt tokens (system + task), +-25%
    c.node_len = 6  # mean tokens per model output / tool result, +-50%
    c.depth = 2  # turns along each path
    c.max_branches = 2  # retries per turn: uniform in [1, max_branches]
    c.subagent_prob = 0.2  # chance a tree is a sub-agent's (its own root and segment)
    c.compaction_prob = 0.3  # chance a tree gets a fresh context sharing only the system prompt
    c.max_step = 3  # progression step s drawn from 1..max_step per tree
    c.log_every = 20  # steps averaged for the first/last loss summary line
    c.save_params = False  # write <workdir>/params.npz at the end (tests compare process layouts with it)
    c.model = ml_collections.ConfigDict(
        dict(
            vocab_size=64,  # token ids 1..63 (0 is padding)
            d_model=64,  # residual width
            n_layers=2,  # decoder blocks
            n_heads=4,  # query heads
            n_kv_heads=2,  # k/v heads (grouped-query attention)
            head_dim=16,  # per-head width
            d_ff=128,  # SwiGLU hidden width
            rope_theta=10000.0,  # RoPE base
            norm_eps=1e-6,  # RMSNorm epsilon
            tie_embeddings=True,  # unembedding = embedding.T
            dtype="float32",  # activations ("bfloat16" selectable)
            param_dtype="float32",  # stored parameters
            attention_impl="blockwise",  # tiled tree attention (the default); "dense" = the [L, L]-mask reference
            max_seq_len=128,  # longest position used
            remat=False,  # recompute activations in the backward pass
        )
    )
    return c
