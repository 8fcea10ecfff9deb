"""`nnscaler-plan`: look at plans from the shell.

    nnscaler-plan show plan.json      # the JSON, summarised per op pattern
    nnscaler-plan explain plan.json   # the same summary plan.explain() gives
    nnscaler-plan strategies          # registered strategy names

`search`, `simulate` and `render` arrive with the plan search.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from .errors import PlanError
from .plan import Plan


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="nnscaler-plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("show", "explain"):
        p = sub.add_parser(name)
        p.add_argument("plan")
    sub.add_parser("strategies")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "strategies":
            from .plugins import strategies
            print("\n".join(strategies()))
            return 0
        plan = Plan.load(a.plan)
    except (OSError, PlanError) as e:
        print(f"nnscaler-plan: {e}", file=sys.stderr)
        return 2
    if a.cmd == "show":
        d = plan.to_json()
        ops = d.pop("ops")
        print(json.dumps(d, indent=1))
        print(f"{len(ops)} ops")
    print(plan.explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
