"""The policy as a Hugging Face checkpoint (``config.model.hf_export``): ``<workdir>/hf_export`` after the
last update, in the source checkpoint's dtype and layout (what vLLM or SGLang serve as is)."""
from __future__ import annotations

import os
import time

from gyre_jax.rl.config import RLConfig
from gyre_jax.rl.hooks import UpdateInfo


def export_hf(cfg: RLConfig, params, workdir: str, version: int) -> str:
    """The policy as a HF checkpoint in <workdir>/hf_export (servable by vLLM/SGLang); its path."""
    from gyre_jax.model.hf import read_config, save_pretrained, source_dtype

    out = os.path.join(workdir, "hf_export")
    t0 = time.perf_counter()
    # In the source's dtype (bf16 for released checkpoints: what servers expect), else the params'.
    dtype = source_dtype(read_config(cfg.hf_path)) if cfg.hf_path else None
    save_pretrained(params, cfg.model, out, like=cfg.hf_path or None, dtype=dtype)
    with open(os.path.join(out, "gyre_version.txt"), "w") as f:
        f.write(f"{version}\n")
    print(f"rl: exported policy version {version} as a Hugging Face checkpoint to {out} "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return out


class ExportHook:
    """The update hook that exports the last version (``add_hook(ExportHook(...).on_update, every=0)``); a LoRA
    run's (``frozen``: its base) is the base with the adapter merged in."""

    def __init__(self, cfg: RLConfig, workdir: str, frozen=None):
        self.cfg, self.workdir, self.frozen = cfg, workdir, frozen

    def on_update(self, info: UpdateInfo) -> None:
        params = info.snapshot.state.params
        if self.frozen is not None:
            from gyre_jax.rl import lora_run

            params = lora_run.merged(self.frozen, params)
        export_hf(self.cfg, params, self.workdir, info.version)


class PeftExportHook:
    """The update hook that saves a LoRA run's last adapters as PEFT directories (rl/lora_run.py: export_peft)."""

    def __init__(self, cfg: RLConfig, workdir: str):
        self.cfg, self.workdir = cfg, workdir

    def on_update(self, info: UpdateInfo) -> None:
        from gyre_jax.rl import lora_run

        lora_run.export_peft(self.cfg, info.snapshot.state.params, self.workdir, info.version)
