"""The RL demo (job 'rl'): the whole elastic loop on CPU on the 'tiny' tasks.

Command:
    python -m launch.main --config configs/demo.py --workdir /tmp/gyre_demo
    python -m launch.main --config configs/demo.py --workdir /tmp/gyre_demo --config.scheduler.mode=colocate
    python -m launch.main --config configs/demo.py --workdir /tmp/gyre_demo --config.scheduler.mode=async

What runs: 8 host CPU devices split into 4 cells of 2; cell 0 is the core (params +
optimizer state). A tiny byte-level transformer is first WARM-STARTED BY A SHORT
SUPERVISED PHASE on scripted demonstrations of the task family (gyre_jax.rl.sft:
the ideal transcript replayed through the real agent loop), because a random
byte model never writes a well-formed tool call. Then RL: JetStream engines on
the rollout cells behind the recording proxy (real HTTP on 127.0.0.1), the
example harness running groups of rollouts of 'tiny' tasks ("copy abc" ->
answer.txt, graded in a subprocess with partial credit), the scheduler's
controller switching cells by its policy, group-normalized advantages, the
clipped policy-gradient loss in the cells' elastic step, and each new version
published to the serving cells.

Expected result: 6-13 minutes on 2 CPU cores (depending on load), training reward and
held-out eval rising by ~0.05 over the supervised warm start's (e.g. eval 0.733 -> 0.802,
v0 -> v60). Every dated measurement of this config (per mode, under load, per objective, and
why RL gains only ~0.05 on one-call tasks) is in docs/results.md; configs/learn.py is the
multi-call family where the trees branch and RL has more to learn.

After the runs, a table of every mode run so far under the workdir (wall time,
utilization by role, reward first/last) is printed.
Outputs in <workdir>/<mode>/: metrics.jsonl (per step: reward, partial credit,
failures by class, staleness, dedup factor, tokens/s, role switches),
timeline.png (cell roles over time), summary.json, the trajectory store,
workspaces and Orbax checkpoints. Rerunning the same command resumes.
Every field can be overridden, e.g. ``--config.steps=10``.

The objective is picked by name (``--config.train.loss/advantage/weights/mismatch``; the README
lists every entry with its paper; docs/results.md has each one's measured eval on this config).
"""
import ml_collections
from ml_collections.config_dict import placeholder

from gyre_jax.rl.config import HarnessKnobs, LoraKnobs, section
from gyre_jax.scheduler.policy import DEFAULT_MIN_WORK_PER_SWITCH_S, DEFAULT_SERVE_RESERVE


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "rl"  # gyre_jax.jobs name -> gyre_jax.rl.loop.run
    c.seed = 0  # tasks, init, SFT order
    c.steps = 60  # RL optimizer steps (N)
    c.num_cpu_devices = 8  # host devices on CPU (set before JAX starts)
    c.recoverable_processes = True  # pods (one process per cell): a satellite process may die alone
    c.first_last = 10  # steps averaged for "reward first -> last"
    c.checkpoint_every = 10  # Orbax checkpoint every k steps (and at the end)
    c.progress = True  # a progress bar on a terminal; one line per step in a log file
    c.progress_every_s = 60.0  # off a terminal: a heartbeat line at least this often while a step runs
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=272,  # byte tokenizer: 256 bytes + 11 special tokens, rounded up
        d_model=128,  # residual width
        n_layers=2,  # decoder blocks
        n_heads=4,  # query heads
        n_kv_heads=2,  # grouped-query attention
        head_dim=32,
        d_ff=256,  # SwiGLU hidden width
        rope_theta=10000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        dtype="float32",
        param_dtype="float32",
        max_seq_len=160,  # longest context (prompt ~60 + answer ~76 tokens)
        remat=False,
    ))
    c.cells = ml_collections.ConfigDict(dict(
        cell_size=2,  # devices per cell: 8 devices -> 4 cells
        train_tensor=1,  # training mesh ('fsdp', 'tensor') = (2, 1)
        train_expert=1,  # expert-parallel degree (MoE models): > 1 adds an 'expert' axis to the training mesh
        serve_tensor=1,  # serving mesh ('data', 'tensor') = (2, 1): decode slots split over the 2 devices
        serve_expert=1,  # expert-parallel degree when serving (MoE models): > 1 adds an 'expert' axis to the serving mesh
        max_slots=16,  # concurrent decode slots per engine
        max_len=160,  # KV-cache length per slot
        tokens_per_call=8,  # decode steps per engine call: amortizes JetStream's per-call host work on CPU
        switch_retries=2,  # a failing role switch / weight load is retried, then its cell is taken out of service
        start_timeout_s=300.0,  # engines serving within this many seconds of the start, else an error: line (exit 1)
        kv_cache="contiguous",  # or "paged": pages for live tokens only, calls admitted by free pages
        page_size=16,  # tokens per KV page (paged)
        kv_pages=0,  # pages per engine (paged); 0 = the memory of max_slots x max_len
        prefill_chunk=4096,  # prompts longer than this prefill chunk by chunk (a power of two)
        fixed_prefill=False,  # True: every prompt does, into a max_len buffer (one prefill program for all)
    ))
    c.scheduler = ml_collections.ConfigDict(dict(
        mode="elastic",  # elastic | colocate | async (baselines), or async_stream | elastic_no_stream
        groups_per_step=8,  # G: groups per optimizer step (64 rollouts: less gradient noise than 32)
        group_size=8,  # rollouts per group (one task), compared for the advantage
        staleness_bound=1,  # S: admission keeps every rollout <= S updates stale
        # k optimizer updates per weight publication: 1 = one-step (each step's rows globally
        # shuffled); >= 2 = multi-step (rows stream into the running step; needs S >= k - 1)
        updates_per_publication=1,
        async_train_cells=1,  # async modes: cells 0..k-1 train, the rest serve
        # priors until the controller measured them (the policy's defaults; scheduler/policy.py says why)
        min_work_per_switch_s=DEFAULT_MIN_WORK_PER_SWITCH_S,  # elastic: cell-seconds a role switch costs
        serve_reserve=DEFAULT_SERVE_RESERVE,  # slots kept per running agent
        # measured costs as priors: a pilot run's <workdir>/<mode>/scheduler_costs.json ("" = none)
        priors="",
        poll_s=0.05,  # controller tick (it also wakes on every event)
    ))
    c.task = ml_collections.ConfigDict(dict(
        family="tiny",  # gyre_jax.agents.tasks family
        ops="copy",  # tiny ops drawn per task (copy: learnable by a 2-layer model in ~1 min of SFT)
        min_len=3,  # argument length range
        max_len=3,
        # tiny_tests family (family="tiny_tests"): x each task's run_tests suite time, 1-30 s heavy-tailed at 1.0
        # (tools/bench_demo_modes.py runs the three modes on it; see the README's demo section)
        run_tests_scale=1.0,
        demo_test_fraction=0.3,  # tiny_agent family: share of warm-start demonstrations that test (configs/learn.py)
        dataset="",  # a task set instead of a family: gyre or SWE-bench JSONL, Harbor task directories
        eval_dataset="",
        dataset_options="",  # JSON: the set's format and its options, e.g. '{"environment": "host"}' (tasks/formats)
        check="start",  # check every task file's grader at start (untouched + solution): start | off
        skip_broken=False,  # a broken task stops the run (one error: line); True: train without it, counted
        grader_ro_paths="",  # comma-separated host paths graded commands see read-only (the run's Python always)
    ))
    c.harness = ml_collections.ConfigDict(section(
        HarnessKnobs,  # kind, entry, command, env, ...: the built-in agent here (configs/external.py: others)
        sandbox="auto",  # where tool commands run: auto (bubblewrap where it works) | bubblewrap | docker | podman | none
        max_tokens=88,  # per call (the ideal answer is 76 tokens)
        temperature=1.0,  # sampling temperature of rollouts
        max_turns=1,  # one model call per rollout: the ideal transcript is one call
        deadline_s=60.0,  # per rollout (a timed-out rollout is graded for partial credit)
        deadline_scale=1.0,  # a task's own timeout_s (task files) times this
        request_timeout_s=60.0,
        max_retries=2,  # per call, on 5xx / connection errors
        backoff_base_s=0.05,
        grader_timeout_s=30.0,
        system_prompt="Write the answer to answer.txt.",  # replaces the task's (shorter contexts); "" = the task's
    ))
    c.train = ml_collections.ConfigDict(dict(
        row_len=160,  # packed row length
        micro_batch_rows=2,  # rows per micro-batch (one compiled shape for every step)
        learning_rate=1e-4,  # AdamW, constant (see the docstring: 3e-4+ degrades, sharp SFT minimum)
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        adam_b2=0.999,
        adam_eps=1e-8,
        # The objective: one name per registry of gyre_jax.losses (the README lists each with its paper).
        loss="ppo_clip",  # ppo_clip | gspo | cispo | decoupled_ppo | reinforce | nll
        advantage="grpo",  # grpo (group mean/std) | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline
        weights="rollout_token_mean",  # rollout_token_mean (1 / (N_r R)) | token_mean | constant (Dr. GRPO)
        mismatch="off",  # train-inference correction: off | measure | tis | tis_seq | mis | mis_seq | icepop
        # Options; unset = the chosen entry's paper default (e.g. ppo_clip 0.2 / 0.28, gspo 3e-4 / 4e-4).
        eps_low=placeholder(float),  # clip of the ratio below (ppo_clip, gspo, decoupled_ppo; cispo's IS weight)
        eps_high=placeholder(float),  # and above (DAPO's clip-higher)
        clip_c=placeholder(float),  # dual clip for A < 0 (ppo_clip, decoupled_ppo; e.g. 3.0)
        behavior_cap=placeholder(float),  # decoupled_ppo: drop tokens with pi_prox / pi_behav above this
        is_cap=placeholder(float),  # reinforce: truncate the IS weight at this
        mismatch_cap=placeholder(float),  # tis / tis_seq: w = min(rho, cap) (default 2)
        mismatch_low=placeholder(float),  # mis / mis_seq / icepop: keep rho in [low, high]
        mismatch_high=placeholder(float),
        kl_coef=0.0,  # KL to the reference (the warm start), on the step's rows
        kl_estimator="k3",  # k1 | k2 | k3 (overflow-safe)
        entropy_coef=0.0,  # entropy bonus (the entropy is reported either way)
        log_ratio_clamp=20.0,  # log(ratio) clamped before exp: loss and gradient finite for any engine/trainer gap
        advantage_eps=placeholder(float),  # grpo / reinforce_pp*: added to the std (default 1e-6)
        negative_advantage_scale=1.0,  # 0 = reinforce only better-than-group rollouts (see gyre_jax.rl.config)
        weights_normalizer=placeholder(int),  # weights=constant: C tokens (default row_len)
        dynamic_sampling=False,  # DAPO: drop groups whose rewards are all equal, launch replacements
        dynamic_sampling_budget=1.0,  # at most this x groups_per_step x steps groups dropped
        overlong_max_tokens=0,  # DAPO overlong shaping: Lmax generated tokens per rollout (0 = off)
        overlong_buffer_tokens=0,  # its soft-penalty band Lc below Lmax
        overlong_penalty=1.0,  # the penalty at and beyond Lmax
        work_s_per_row=0.05,  # first estimate of training cost (then measured)
        routing_replay=False,  # MoE models: train on the experts the engine recorded per sampled token (R3)
        # LoRA instead of full fine-tuning: --config.train.lora.rank=16 (README "LoRA"; rank 0 = off)
        lora=section(LoraKnobs),
    ))
    c.sft = ml_collections.ConfigDict(dict(
        steps=600,  # supervised warm-start steps on scripted demonstrations
        rows=6,  # packed rows per step
        learning_rate=1e-3,
        demos=512,  # demonstration tasks (disjoint seeds from the RL tasks)
        noisy_fraction=0.0,  # share of deliberately bad demonstrations (off: see the docstring)
        noisy_kind="reverse",  # how they are bad: reverse | one_char | random | give_up
        cache_dir="",  # a directory of warm starts keyed by what determines them: runs differing only in RL knobs share one
        seed=-1,  # the warm start's seed (init, demonstration order); -1 = config.seed
    ))
    c.eval = ml_collections.ConfigDict(dict(  # held-out eval, logged as eval/* per step
        every=10,  # evaluate before step 0, after every 10th step and after the last (0 = off)
        # first_call: the fast extra for one-call families (gyre_jax.rl.evaluate; 'tiny' ends in one call, so it
        # is the whole episode here); episodes: whole episodes through the harness (gyre_jax.rl.episode_eval)
        kind="first_call",
        tasks=32,  # fixed tasks, seeds disjoint from the RL and SFT tasks
        samples_per_task=8,  # first model call sampled 8x per task with one fixed key (~2 s per eval on 2 cores)
        temperature=1.0,  # the rollouts' temperature (0 = greedy)
        pass_score=1.0,  # pass@k counts samples scoring at least this
        deadline_scale=4.0,  # episodes: harness.deadline_s x this (an eval beside a busy run must not time out)
    ))
    c.metrics = ml_collections.ConfigDict(dict(  # metrics.jsonl and TensorBoard always; Weights & Biases optionally
        wandb="off",  # off | offline (<workdir>/<mode>/wandb, `wandb sync` later; no network) | online
        wandb_project="gyre_jax",
    ))
    c.faults = ml_collections.ConfigDict(dict(  # injected faults (gyre_jax.rl.faults); 0 = off
        grader_crash_every=0,  # every k-th rollout's grader crashes -> verifier_error, never trained
        timeout_every=0,  # every k-th rollout stalls past its deadline -> timeout, partial credit
        engine_error_every=0,  # every k-th rollout's first call fails in the engine -> the harness retries
        pause_at_step=0,  # print PAUSED and block when step k starts (the kill -9 resume test)
        switch_delay_s=0.0,  # role switches, joins and leaves wait a random time in [0, x)
        switch_fail_every=0,  # every k-th switch attempt raises (retried)
        satellite_fail_every=0,  # every k-th micro-batch a satellite pulls fails it (its work goes to the others)
        chaos_seed=0,
        core_fail_at_step=0,  # the core fails when step k starts: the run saves what it can and exits 1
    ))
    return c
