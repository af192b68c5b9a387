"""`python -m tests.idioms.page docs/compatibility.md` writes docs/compatibility.md: the composition
matrix (tests/layouts/compatibility.py), then the idiom corpus's table (tests/idioms/table.py);
without an argument it prints the page."""

from __future__ import annotations

from phalanx.config import generated_page
from tests.layouts import compatibility
from tests.idioms import table


def page_text() -> str:
    return compatibility.page_text(table.section())


def main(argv: list[str] | None = None) -> int:
    return generated_page.main(argv, page_text, compatibility.COMMAND)


if __name__ == "__main__":
    raise SystemExit(main())
