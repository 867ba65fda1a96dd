"""Do the controllers draft longer where B(k) is flatter? The simulator on measured B(k) curves.

    python scripts/weights_controllers.py COSTS.json     # the output of `eesd models costs ... --json`

For each model's measured B(k) and a few acceptance processes (a free drafter, like prompt
lookup: draft cost 0.02 of a target token), prints the best fixed draft length in hindsight,
cost-ts's throughput relative to it and cost-ts's mean draft length.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np

from eesd_local.tools.simulator import PROCESSES, best_fixed, simulate, throughput

DRAFT_COST = 0.02  # prompt lookup: a draft costs next to nothing
PROCESS_NAMES = ("iid-0.9", "iid-0.7", "decay")


@dataclass(frozen=True)
class Measured:
    """A cost profile from a measured B(k) table (duck-types simulator.CostProfile)."""

    name: str
    b: tuple[float, ...]  # B(1..K+1)
    draft_cost: float = DRAFT_COST

    def verify(self, max_draft: int) -> np.ndarray:
        return np.array(self.b[: max_draft + 1])


def main(path: str) -> int:
    rows = json.loads(open(path).read())
    print(f"{'model':44s} {'process':8s} {'best k':>6s} {'cost-ts/best':>12s} {'cost-ts mean k':>14s}")
    for row in rows:
        b = tuple(row["B"][str(k)] for k in range(1, 10))
        prof = Measured(row["name"], b)
        for name in PROCESS_NAMES:
            proc = PROCESSES[name]
            k_best, best = best_fixed(proc, prof, rounds=3000)  # type: ignore[arg-type]
            out = simulate("cost-ts", proc, prof, rounds=3000)  # type: ignore[arg-type]
            print(f"{row['name'][-44:]:44s} {name:8s} {k_best:6d} {throughput(out) / best:12.3f} {out[:, 2].mean():14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
