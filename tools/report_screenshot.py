"""A screenshot of a run report in headless Chromium (Debian's /usr/bin/chromium; nothing outside 127.0.0.1).

    python tools/report_screenshot.py /tmp/gyre_learn/elastic/report/index.html --out report.png
    python tools/report_screenshot.py REPORT --rollout g00012-3 --call 2 --out rollout.png   # a rollout open
    python tools/report_screenshot.py REPORT --tab timeline --out timeline.png
    python tools/report_screenshot.py REPORT --branching --out rollout.png   # the first rollout whose tree branches

Prints the PNG's path and any JavaScript error the page raised (exit 1 if it raised one).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre_jax.testing.chromium import HeadlessChromium  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", help="the report's index.html")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tab", default="overview", choices=("overview", "tasks", "steps", "timeline", "rollouts"))
    ap.add_argument("--rollout", default="", help="open this rollout")
    ap.add_argument("--branching", action="store_true", help="open the first rollout whose tree has a branch point")
    ap.add_argument("--call", type=int, default=-1, help="show this call of the rollout (default: its last)")
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--height", type=int, default=1000)
    args = ap.parse_args(argv)
    url = "file://" + os.path.abspath(args.report)
    with HeadlessChromium(width=args.width, height=args.height) as b:
        b.open(url + ("#rollouts" if args.rollout or args.branching else f"#{args.tab}"))
        if args.rollout or args.branching:
            b.wait_for("document.querySelectorAll('#rollout-table tbody tr').length > 0")
            if args.branching:
                b.click("#f-branch")
                b.wait_for("document.querySelectorAll('#rollout-table tbody tr').length > 0")
                sel = "#rollout-table tbody tr"
            else:
                sel = f'#rollout-table tbody tr[data-id="{args.rollout}"]'
            b.click(sel)
            b.wait_for("document.querySelector('#detail h3') !== null")  # a rollout with no call has no tree
            if args.call >= 0:
                b.click(f'#calls tbody tr[data-i="{args.call}"]')
        time.sleep(1.0)  # plotly's transitions
        b.screenshot(args.out)
        print(args.out)
        for e in b.errors:
            print("page error:", e, file=sys.stderr)
        return 1 if b.errors else 0


if __name__ == "__main__":
    sys.exit(main())
