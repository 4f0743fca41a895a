"""`python -m server.cli_main ...` runs the `xpulora` command (for environments without the script)."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
