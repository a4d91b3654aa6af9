"""Write docs/configuration-reference.md from the config models, as `flotilla config` prints it.

Why: the reference page must not drift from the code; it is generated, committed, and a
unit test (tests/unit/test_docs_config.py) fails when the committed page differs.
Run from the repository root: `python scripts/docs_config.py` (`--check` only compares).
"""

from __future__ import annotations

import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration-reference.md"

HEADER = """# Configuration reference

Every field of the run config, with its type, default and what it does. This page is
generated from the pydantic models by `python scripts/docs_config.py` (the same text as
`flotilla config`; `flotilla config SECTION` prints one section). Do not edit it by hand.

"""


def render() -> str:
    """The page's full text."""
    from orchestrator.entry.confighelp import config_help

    return HEADER + "```toml\n" + config_help().rstrip("\n") + "\n```\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is out of date: run python scripts/docs_config.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
