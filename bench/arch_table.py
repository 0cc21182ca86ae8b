"""Write docs/architectures.md from the architecture matrix the tests run.

The table is rendered by ``tests/test_architectures.py`` (which also checks it is current), so
it lists exactly what CI covers. Run from the repository root: ``python bench/arch_table.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(REPO))
    from tests.test_architectures import TABLE, render_table

    TABLE.write_text(render_table(), encoding="utf-8")
    print(f"wrote {TABLE.relative_to(REPO)}")


if __name__ == "__main__":
    main()
