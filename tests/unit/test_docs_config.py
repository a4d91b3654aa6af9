"""docs/configuration-reference.md is exactly what scripts/docs_config.py generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("docs_config", ROOT / "scripts" / "docs_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_matches_the_models() -> None:
    script = _script()
    committed = (ROOT / "docs" / "configuration-reference.md").read_text(encoding="utf-8")
    assert committed == script.render(), "run: python scripts/docs_config.py"


def test_reference_lists_every_section() -> None:
    text = _script().render()
    for header in ("[model]", "[task]", "[rollout]", "[recipe]", "[trainer]", "[[pools]]", "[checkpoint]"):
        assert header in text
