"""`python -m orchestrator` is `flotilla`."""

import sys

from orchestrator.entry.cli import main

sys.exit(main())
