"""Metrics sinks: where per-step metrics go besides metrics.jsonl (``gyre_jax.rl.metrics.METRIC_SINKS``).

A sink is a class in a module of this package, built as ``Sink(options, context)`` (its options a
frozen dataclass beside it, ``--config.metrics.sink_options.NAME.OPTION=v``; ``context`` a
``metrics.SinkContext``), with ``write(step, flat, walltime)``, ``flush()`` and ``close()``, and
registered with ``@METRIC_SINKS.register(NAME, config=Options, summary=...)``. ``--config.metrics.sinks``
names the ones a run writes (comma-separated).
"""
