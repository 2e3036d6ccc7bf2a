"""``python -m toolkit.report RUN_DIR``: the run's report tables (:mod:`toolkit.report.run_report`)."""

import sys

from toolkit.report.run_report import main

if __name__ == "__main__":
    sys.exit(main())
