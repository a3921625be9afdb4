"""``python -m analysis_queue``: the ``analysis-queue`` command."""

from __future__ import annotations

import sys

from analysis_queue.cli import main

sys.exit(main())
