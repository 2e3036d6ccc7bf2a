from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from toolkit.bench import BENCHMARKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--json", type=Path, required=True, help="write the result object here")
    parser.add_argument("--quick", action="store_true", help="a smaller run (smoke test), same fields")
    args = parser.parse_args(argv)
    module = importlib.import_module(BENCHMARKS[args.name])
    result = module.run(quick=args.quick)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
