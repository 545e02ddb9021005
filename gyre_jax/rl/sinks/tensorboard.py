"""TensorBoard event files (tensorboardX: real event files with only numpy and protobuf)."""
from __future__ import annotations

from gyre_jax.registry import NoConfig
from gyre_jax.rl.metrics import METRIC_SINKS, SinkContext


@METRIC_SINKS.register("tensorboard", summary="TensorBoard event files in the run's directory (tensorboardX)")
class TensorBoardSink:
    """Event files in ``logdir``: one scalar per number, text for strings; ``purge_step`` hides a crashed
    attempt's steps (TensorBoard's own mechanism)."""

    def __init__(self, options: NoConfig, context: SinkContext):
        from tensorboardX import SummaryWriter  # only process 0 pays for it

        self._tb = SummaryWriter(logdir=context.logdir, purge_step=context.purge_step,
                                 flush_secs=context.flush_secs)

    def write(self, step, flat, walltime) -> None:
        for k, v in flat.items():
            if isinstance(v, str):
                self._tb.add_text(k, v, global_step=step, walltime=walltime)
            else:
                self._tb.add_scalar(k, v, global_step=step, walltime=walltime)

    def flush(self) -> None:
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()
