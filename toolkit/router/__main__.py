"""``python -m toolkit.router RUN_DIR [OWNER]``: the router process (``OWNER``: ``pid:start`` of the process
it ends with, ``ProcessRef.arg``)."""

import sys

from toolkit.core.lifecycle import ProcessRef
from toolkit.router.process import serve

if __name__ == "__main__":
    serve(sys.argv[1], ProcessRef.from_arg(sys.argv[2]) if len(sys.argv) > 2 else None)
