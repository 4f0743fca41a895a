"""`python -m server ...` is `xpulora serve ...`."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
