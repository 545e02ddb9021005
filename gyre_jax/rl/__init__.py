"""The RL loop: rollouts -> store -> processor -> train, with checkpoint/resume, metrics and multi-host setup."""
