"""``python -m polymq.gateway``: the ``polymq`` command, without its script on PATH."""

import sys

from polymq.gateway.cli import main

sys.exit(main())
