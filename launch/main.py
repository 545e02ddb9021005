"""The one entry point: ``python -m launch.main --config configs/X.py [--workdir DIR]``.

Thin on purpose: parse flags, start JAX (multi-process if asked), log where we
run, hand the config to the job it names. Every ``--config.a.b=value`` flag
overrides a config field; a misspelled field fails loudly (the config is locked).

Multi-process (pods, multi-host GPU): the same command on every host, with
``--coordinator_address=HOST0:PORT --num_processes=N --process_id=I``, or with
none of them inside SLURM, Open MPI, a multi-host TPU (GKE) or a launcher that
sets ``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``
(``--cluster=auto`` detects those; ``--cluster=jax`` lets JAX query everything,
e.g. a Cloud TPU VM pod's metadata server). On this machine, two processes of
2 CPU devices each::

    for i in 0 1; do python -m launch.main --config configs/synthetic_train.py \\
        --config.num_cpu_devices=2 --coordinator_address=127.0.0.1:12355 \\
        --num_processes=2 --process_id=$i --workdir /tmp/synth2 & done; wait

``tools/launch_local.py -n N -- <these flags>`` does that for N processes (logs
prefixed ``[pI]``, all killed if one fails), e.g. the pods job, cells in
separate processes: ``python tools/launch_local.py -n 3 -- --config configs/pods_dp.py``,
or the RL job with one cell per process (process 0 the core):
``python tools/launch_local.py -n 4 -- --config configs/demo.py``.
A config with ``recoverable_processes=True`` keeps the run going when one process dies.
"""
import os
import signal
import sys

from launch import early_stop

if __name__ == "__main__":  # first: a stop during the imports below and JAX's start is one line, never rc -15
    early_stop.install()

# After the handler: these imports take seconds.
import logging as pylogging

from absl import app, flags, logging
from ml_collections import config_flags

from gyre_jax import distributed
from gyre_jax.errors import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STORAGE,
    EXIT_TERMINATED,
    ConfigError,
    RunFailed,
    Stopped,
    StorageError,
)
from launch import cli_errors, failure_file

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, metrics and plots.")
flags.mark_flags_as_required(["config"])

# jax.distributed.initialize; gyre_jax/distributed.py says what each does and how 'auto' detects.
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-process); with --num_processes and --process_id.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes (hosts) in the run; unset = detect or 1.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
_CLUSTER = flags.DEFINE_enum(
    "cluster", "auto", distributed.CLUSTERS,
    "auto: explicit flags, else SLURM / Open MPI / multi-host TPU / JAX_* env, else one process; "
    "none: one process; jax: jax.distributed.initialize() detects; or one JAX detection method.")
_LOCAL_DEVICE_IDS = flags.DEFINE_list("local_device_ids", None, "Devices this process drives (default: all visible).")
_CPU_COLLECTIVES = flags.DEFINE_enum(
    "cpu_collectives", "gloo", distributed.CPU_COLLECTIVES, "Cross-process collectives of the CPU backend.")
_TIMEOUT = flags.DEFINE_integer("distributed_timeout_s", 300, "How long processes wait for each other at start.")
_CHECK_TASKS = flags.DEFINE_bool(
    "check_tasks", False, "Check every task's grader through the rollout sandbox and grader path (the untouched "
    "workspace must not score full marks, metadata.solution must), one line per task with its seconds; exit 1 "
    "naming each broken task, 0 if all work. Starts no device or model (gyre_jax/rl/task_gate.py).")
_PLAN = flags.DEFINE_string(
    "plan", None, "KIND:N, e.g. h100-80g:8: print the config's memory plan on N devices of KIND "
    "(gyre_jax/planner.py DEVICE_KINDS) and exit, 0 if it fits, 2 with one line if not; starts no device.")


def distributed_config(config) -> distributed.DistributedConfig:
    ids = _LOCAL_DEVICE_IDS.value
    return distributed.DistributedConfig(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
        local_device_ids=None if ids is None else tuple(int(i) for i in ids),
        cluster=_CLUSTER.value,
        cpu_collectives=_CPU_COLLECTIVES.value,
        initialization_timeout_s=_TIMEOUT.value,
        recoverable=bool(config.get("recoverable_processes", False)),  # a job whose processes may die alone (pods)
    )


def quiet_logs() -> None:
    """Only gyre_jax's own lines by default; ``--verbosity=0`` (or higher) shows every library's INFO.

    JAX, XLA, Orbax and JetStream log INFO lines a person does not act on (a missing libtpu on a CPU
    host, checkpoint manager internals); absl shows them all unless told otherwise.
    """
    if flags.FLAGS["verbosity"].present:
        return
    logging.set_verbosity(logging.WARNING)  # the root logger: every library
    pylogging.getLogger("gyre_jax").setLevel(pylogging.INFO)  # our own progress and resume lines


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_logs()
    try:
        config = _CONFIG.value
    except Exception as e:  # noqa: BLE001 - a missing file, a misspelled override: one line, exit 2
        cli_errors.fail(cli_errors.explain_config_failure(
            getattr(flags.FLAGS["config"], "config_filename", None), sys.argv[1:], e))
    _no_device_modes(config)  # --plan, --check_tasks: they exit here
    import jax

    # A persistent compilation cache by default: a rerun (a resume, the next run of the same config) loads the
    # engines' and the train step's executables instead of compiling them again (minutes for a 30-layer model
    # on 2 cores), and cells of the same shape on other devices load what the first one compiled.
    # JAX_COMPILATION_CACHE_DIR, when set, is used as it is.
    from gyre_jax import compile_cache

    compile_cache.enable()

    from gyre_jax import jobs

    job = jobs.get(config.job)  # an unknown job fails here, before waiting on other processes
    # Before JAX's backend starts (the layout below starts it): XLA fixes the host
    # device count once. A job's own check (e.g. the RL loop's) then only verifies it.
    n_cpu = config.get("num_cpu_devices", None)
    if n_cpu:
        jax.config.update("jax_num_cpu_devices", int(n_cpu))
    # Sized for the threads that dispatch to the devices (distributed.cpu_client_threads).
    distributed.size_cpu_client_threads(int(n_cpu or os.environ.get("JAX_NUM_CPU_DEVICES") or 1))
    info = distributed.layout(distributed.initialize(distributed_config(config)))
    workdir = _WORKDIR.value or config.get("workdir", None) or f"/tmp/gyre_jax/{config.job}"
    if info.process_index == 0:  # the other processes of a multi-process run write nothing there
        cli_errors.check_workdir(workdir)
    kinds = sorted({d.device_kind for d in info.local_devices})
    line = (f"process {info.process_index} of {info.process_count} ({info.how}): {len(info.local_devices)} local "
            f"devices ({', '.join(kinds)}), {info.global_device_count} global")
    print(f"launch: {line}; job={config.job} workdir={workdir}", flush=True)
    # From here the job answers: SIGTERM like Ctrl-C (the loop saves, then one line), Ctrl-C as KeyboardInterrupt.
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        job(config, workdir)
        _exit_cleanly()
    except ConfigError as e:  # a bad value: its dotted name and why, no traceback
        _exit(f"error: {e}", EXIT_CONFIG)
    except StorageError as e:  # our disk: the path and why; nothing became a rollout failure
        _exit(f"error: {e}; free space (or fix the device) and rerun the same command to resume"
              f"{failure_file.save(workdir, e)}", EXIT_STORAGE)
    except RunFailed as e:  # what failed; the job saved what it could and a rerun resumes
        _exit(f"error: {e}{failure_file.save(workdir, e)}", EXIT_FAILED)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the job saved what it trained
        code = EXIT_TERMINATED if isinstance(e, Stopped) and e.signum == signal.SIGTERM else EXIT_INTERRUPTED
        _exit(f"stopped: {e or 'SIGINT'}; what was trained is saved: rerun the same command to resume", code)
    except Exception as e:  # noqa: BLE001 - a bug, or a job that does not say what failed: still one line
        _exit(f"error: {type(e).__name__}: {e}{failure_file.save(workdir, e)}", EXIT_FAILED)


def _no_device_modes(config) -> None:
    """--plan and --check_tasks answer before `import jax` starts anything, and exit."""
    if _PLAN.value:  # arithmetic
        from launch import plan

        try:
            plan.run(config, cli_errors.config_path(sys.argv[1:]), _PLAN.value)
        except ConfigError as e:
            cli_errors.fail(str(e))
        _end(0)
    if _CHECK_TASKS.value:  # no device, no model: the tasks' graders only
        from gyre_jax.rl import task_gate

        try:
            _end(task_gate.check_command(config, _WORKDIR.value or config.get("workdir", None) or "/tmp/gyre_jax/check"))
        except ConfigError as e:
            cli_errors.fail(str(e))


def _stop_on_signal(signum, frame):
    raise Stopped(signum)


def _exit_cleanly() -> None:
    """Exit 0 once the job has returned (it closed its files and waited for its checkpoints)."""
    _end(0)


def _exit(line: str, code: int) -> None:
    """One line, then exit with ``code`` (gyre_jax.errors lists them), by the same path as a finished run."""
    print(line, file=sys.stderr, flush=True)
    _end(code)


def _end(code: int) -> None:
    """Flush, then ``os._exit``: never through interpreter teardown.

    By the time the job has returned or raised, it has closed what it owns (the store's writes are
    synchronous, checkpoints are waited for), so nothing durable is left to do. Teardown would join
    non-daemon threads (one that waits for ever keeps the process alive) and stop daemon threads that are
    still inside C++ (a stop during the SFT warm start finds the gyre-warm thread compiling; a finished
    run may find engine or XLA threads): Python ends those with a forced unwind that C++ cannot pass,
    and the process aborts with "terminate called ... FATAL: exception not rethrown" instead of its
    documented exit code."""
    pylogging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.argv[1:] = cli_errors.precheck(sys.argv[1:])
    app.run(main)
