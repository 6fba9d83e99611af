"""``python -m router``: the router as its own process."""

import sys

from router.cli import main

if __name__ == "__main__":
    sys.exit(main())
