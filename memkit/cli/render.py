"""Plain-text rendering shared by the subcommands (no colours, stable for golden tests)."""
from __future__ import annotations


def format_table(headers: list[str], rows: list[list], *, right: set[int] = frozenset()) -> str:
    """Columns padded to their widest cell; column indexes in `right` are right-aligned (numbers)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def format_markdown(headers: list[str], rows: list[list], *, right: set[int] = frozenset()) -> str:
    """A GitHub markdown table."""
    align = ["---:" if i in right else "---" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
