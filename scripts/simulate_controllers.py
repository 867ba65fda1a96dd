"""Compare the draft-length controllers on synthetic rounds: the table of `eesd simulate`.

    python scripts/simulate_controllers.py                 # every controller, process and cost profile
    python scripts/simulate_controllers.py --timing        # plus what a decision costs
    python scripts/simulate_controllers.py --help
"""

from __future__ import annotations

import argparse
import sys

from eesd_local.base.errors import EesdError
from eesd_local.cli import report_error
from eesd_local.commands import simulate


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="simulate_controllers.py",
        description=__doc__.splitlines()[0],
        epilog=simulate.epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    simulate.add_arguments(parser)
    args = parser.parse_args()
    try:
        return simulate.run(args)
    except EesdError as exc:
        report_error(exc)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
