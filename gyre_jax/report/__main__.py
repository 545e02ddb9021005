"""``python -m gyre_jax.report WORKDIR``: the run report without a config (``report.job``)."""
import sys

from gyre_jax.report.job import main

sys.exit(main())
