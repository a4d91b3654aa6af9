"""`python -m orchestrator` is `flotilla`."""

import sys

from orchestrator.cli import main

sys.exit(main())
