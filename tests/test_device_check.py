"""tools/device_check.py --dry runs in the default tests, so the one-command device check never rots.

The real mode needs a GPU or TPU (README, "On a GPU or TPU"); the dry mode runs every check
on tiny shapes, the Pallas tree-attention kernel in interpret mode, and must agree with the
references as tightly as the kernel's own tests ask."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from tests.test_tools import assert_header  # noqa: E402

import device_check  # noqa: E402


def test_device_check_dry_prints_one_json_line_with_every_check(capsys):
    out = device_check.main(["--dry"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == json.loads(json.dumps(out))
    assert_header(out, "device_check", quick=False)  # --dry; --quick is the same run
    assert not [k for k in out if k.endswith("_error")], out
    assert out["tree_attention_impl"] == "pallas_interpret"
    assert out["tree_attention_max_diff_vs_xla"] <= 1e-5
    assert out["tree_attention_max_diff_vs_dense"] <= 1e-5
    for key in ("tree_attention_speedup_vs_dense", "train_step_s", "train_compile_s", "train_fraction_of_matmul_peak",
                "decode_tokens_per_s", "decode_fraction_of_measured_bw", "decode_compile_s"):
        assert out[key] > 0, key
    assert out["train_mfu"] is None  # no spec peak for a CPU: never a made-up figure


def test_spec_peaks_by_device_kind():
    assert device_check.spec_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert device_check.spec_peaks("TPU v5 lite") == (197e12, 0.82e12)
    assert device_check.spec_peaks("cpu") == (None, None)


def test_tree_row_is_a_valid_packing():
    seg, sub = device_check.tree_row(128)
    idx = range(128)
    assert seg.min() >= 1 and all(i < sub[0, i] <= 128 for i in idx)
    # A token's subtree ends within its own tree (segment).
    assert all(seg[0, sub[0, i] - 1] == seg[0, i] for i in idx)
