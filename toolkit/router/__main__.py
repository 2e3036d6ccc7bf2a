"""``python -m toolkit.router RUN_DIR``: the router process."""

import sys

from toolkit.router.process import serve

if __name__ == "__main__":
    serve(sys.argv[1])
