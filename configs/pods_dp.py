"""Dynamic data parallelism across processes (job 'pods_dp'): a core process and satellite processes.

Command (3 processes of 2 CPU devices on this machine; process 0 is the core cell,
processes 1-2 are training satellites that join each step after the core has
computed ``join_after`` micro-batches):
    python tools/launch_local.py -n 3 -- --config configs/pods_dp.py --workdir /tmp/pods_dp

The same command on every host of a cluster, with that host's coordinator flags:
    python -m launch.main --config configs/pods_dp.py --workdir DIR \
        --coordinator_address=HOST0:PORT --num_processes=N --process_id=I

Expected runtime: ~20-40 s on 2 CPU cores (mostly start-up and compiling).
Expected result: per step a line ``pods_dp: step s loss ... micro-batches by cell {0: a, 1: b, 2: c}``
and the satellites' snapshot pulls (MB, GB/s); workdir/metrics.jsonl (one line per
step), workdir/params.npz (the final params, bit-identical to one process running
the same steps alone: tests/test_pods_dp.py) and workdir/summary.json.
Fault injection: ``--config.hold_satellite=2`` makes process 2 stop at its first
micro-batch and print ``holding``; kill it (kill -9) and the step completes on the others.
Restart it (the same launch.main command, same --process_id, without the hold) and it
rejoins at the next step boundary; ``--config.min_satellites=2`` makes the core wait for it.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "pods_dp"  # gyre_jax.jobs name -> gyre_jax.pods.dp_job.run
    c.recoverable_processes = True  # jax.distributed keeps running when a satellite process dies
    c.num_cpu_devices = 2  # host devices per process on CPU: one cell per process
    c.seed = 0  # init and data
    c.steps = 3  # optimizer steps
    c.micro_batches = 8  # per step, weights normalized over the step
    c.rows = 2  # rows per micro-batch, B
    c.row_len = 32  # tokens per row, L
    c.join_after = 2  # the core computes this many micro-batches of a step before the satellites join
    c.in_flight = 2  # micro-batches a cell keeps dispatched (a satellite: mailed and not yet pulled back)
    c.hold_satellite = -1  # fault injection: this satellite process blocks at its first micro-batch (-1: none)
    c.min_satellites = 0  # before a step, wait for this many live satellites (a restarted one rejoins)
    c.rejoin_wait_s = 300.0  # ... for at most this long, then go on with those there are
    c.learning_rate = 1e-3  # AdamW
    c.weight_decay = 0.01
    c.max_grad_norm = 1.0
    c.model = ml_collections.ConfigDict(
        dict(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=64)
    )  # gyre_jax.model.ModelConfig fields (the tiny test model)
    return c
