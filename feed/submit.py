"""Entry file for ``spark-submit``: ``spark-submit [options] …/feed/submit.py emit …``.

spark-submit runs a file as ``__main__`` with the file's own folder first on ``sys.path``;
this file takes that folder off (so the package's modules cannot shadow the standard
library's) and runs the installed ``tidefeed`` command line.
"""

import os
import sys

__all__: list[str] = []

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from feed.cli.main import main

    sys.exit(main())
