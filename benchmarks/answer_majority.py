"""How often one constant answer is right: the most common expected answer of every shipped environment graded on a
final answer (the built-in ones and each reasoning-gym generator) over 200 training items, and its share.

Curation leaves an environment out of training where that share is above ``curation.max_majority_share`` (0.25):
``python benchmarks/answer_majority.py`` prints the table and writes ``benchmarks/results/answer_majority.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import save  # noqa: E402
from evertrain.config import CurationConfig  # noqa: E402
from evertrain.envs import registry  # noqa: E402
from evertrain.envs.quality import MAJORITY_SAMPLE, answer_majority  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sample", type=int, default=MAJORITY_SAMPLE, help="training items per environment")
    args = parser.parse_args()
    limit = CurationConfig().max_majority_share
    names = registry.names(include_rg=True)
    rows, began = [], time.monotonic()
    for name in names:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # some generators print as they draw
                majority = answer_majority(registry.get(name), sample=args.sample)
        except Exception as error:  # an environment that cannot build here (a missing optional package)
            rows.append({"env": name, "error": f"{type(error).__name__}: {error}"[:200]})
            continue
        if majority is None:
            rows.append({"env": name, "measured": False})
            continue
        rows.append({"env": name, "measured": True, "answer": majority.answer[:60], "share": round(majority.share, 4),
                     "items": majority.items, "classes": majority.classes, "left_out": majority.share > limit})
    measured = sorted((r for r in rows if r.get("measured")), key=lambda r: -r["share"])
    print(f"{'environment':32s} {'share':>6s} {'items':>5s} {'classes':>7s}  most common answer")
    for r in measured:
        mark = "  <- left out" if r["left_out"] else ""
        print(f"{r['env']:32s} {r['share']:6.2f} {r['items']:5d} {r['classes']:7d}  {r['answer'][:30]!r}{mark}")
    print(f"{sum(r['left_out'] for r in measured)} of {len(measured)} measured environments above {limit}; "
          f"{sum(not r.get('measured', True) for r in rows)} grade no final answer as text; "
          f"{sum('error' in r for r in rows)} could not be built")
    path = save("answer_majority", {"sample": args.sample, "max_majority_share": limit,
                                    "wall_s": round(time.monotonic() - began, 1), "environments": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
