"""Rewrite the keys table of docs/trainer.md from the config's declarations.

    .venv/bin/python docs/keys_table.py

Every config key is declared once, as a field of its section (``named.trainer.config``); the table
is ``config.keys_table()``, and ``tests/test_bad_input_config.py`` fails while the page shows
another. The table is found by its header row and replaced whole.
"""

from __future__ import annotations

import pathlib

from named.trainer.config import keys_table

PAGE = pathlib.Path(__file__).resolve().parent / "trainer.md"


def main() -> None:
    table = keys_table().splitlines()
    lines = PAGE.read_text().splitlines()
    start = lines.index(table[0])
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    PAGE.write_text("\n".join(lines[:start] + table + lines[end:]) + "\n")
    print(f"{PAGE}: the keys table, {len(table) - 2} keys")


if __name__ == "__main__":
    main()
