"""``python -m gateway``: the ``polymq`` command without installing the package."""

import sys

from gateway.cli import main

sys.exit(main())
