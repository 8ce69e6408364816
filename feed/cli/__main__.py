"""``python -m feed.cli …``: the ``tidefeed`` command."""

import sys

from feed.cli.main import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
