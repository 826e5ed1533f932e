"""``python -m tests.fuzz``: see :mod:`tests.fuzz.runner`."""

from __future__ import annotations

import sys

from tests.fuzz.runner import main

sys.exit(main())
