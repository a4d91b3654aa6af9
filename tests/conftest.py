"""Shared test setup: keep torch to few threads so the suite fits 2 cores."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.netrig import netrig  # noqa: F401 - the network rig's fixture, for every test
