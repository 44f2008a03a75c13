"""``python -m bench.baseline``: one worker of the seed design (see :mod:`bench.baseline.worker`)."""

import sys

from bench.baseline.worker import main

if __name__ == "__main__":
    sys.exit(main())
