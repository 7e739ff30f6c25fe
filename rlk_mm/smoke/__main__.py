"""`python -m rlk_mm.smoke [options]`: the same run as `rlk-mm smoke`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
