"""A screenshot of a run report in headless Chromium (Debian's /usr/bin/chromium; nothing outside 127.0.0.1).

    python tools/report_screenshot.py /tmp/gyre_learn/elastic/report/index.html --out report.png
    python tools/report_screenshot.py REPORT --rollout g00012-3 --call 2 --out rollout.png   # a rollout open
    python tools/report_screenshot.py REPORT --tab timeline --out timeline.png
    python tools/report_screenshot.py REPORT --branching --out rollout.png   # the first rollout whose tree branches

Prints the PNG's path and any JavaScript error the page raised; with a rollout open, one JSON line of what its
view rendered (tree nodes, branch labels, trained nodes, calls, the open call's turns by role). Exit 1 on a page
error, or a rollout with calls whose tree or calls table did not render (or, with --branching, no branch label).
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre_jax.testing.chromium import HeadlessChromium  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)


def main(argv=None) -> int:
    ap = benchkit.tool_parser(__file__, __doc__)
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
            seen = rendered(b)
        time.sleep(1.0)  # plotly's transitions
        b.screenshot(args.out)
        print(args.out)
        ok = not b.errors
        if args.rollout or args.branching:
            print(json.dumps(seen))
            # a rollout with calls must show its tree and every call; a branching one its branch labels
            ok &= seen["calls_recorded"] == 0 or (seen["tree_nodes"] > 0 and seen["call_rows"] == seen["calls_recorded"])
            ok &= not args.branching or bool(seen["branch_labels"])
        for e in b.errors:
            print("page error:", e, file=sys.stderr)
        return 0 if ok else 1


def rendered(b: HeadlessChromium) -> dict:
    """What the open rollout's view shows: its tree's nodes, branch labels and trained nodes, its calls
    table, and the open call's turns by role (read from the page, not from the data files)."""
    return b.eval("""(() => {
      const q = s => Array.from(document.querySelectorAll(s));
      const calls = (document.querySelector('#detail').textContent.match(/calls: (\\d+)/) || [0, 0])[1];
      return {rollout: (document.querySelector('#detail h3') || {}).textContent || '',
              calls_recorded: Number(calls), tree_nodes: q('#tree .node').length,
              kept_nodes: q('#tree .node.kept').length, branch_labels: q('#tree .branch').map(e => e.textContent),
              call_rows: q('#calls tbody tr').length, call_kinds: q('#calls tbody tr .branch').map(e => e.textContent),
              open_call_turns: q('#call-view > .turn .who').map(e => e.textContent)};
    })()""")


if __name__ == "__main__":
    sys.exit(main())
