"""``python -m prefixkv``: the same command line as the ``prefixkv`` script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
