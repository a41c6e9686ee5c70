"""The README's table of files: each row's code lines (blank lines, comments and docstrings
left out) and lines, counted again; with --write, the table rewritten with them.

    python .ci/readme_lines.py [--write]
"""
import ast
import glob
import io
import os
import re
import sys
import tokenize

os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
def code_lines(path):
    src = open(path).read()
    if not path.endswith('.py'):
        return sum(1 for l in src.splitlines() if l.strip()), len(src.splitlines())
    tree = ast.parse(src)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.body and isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], 'value', None), ast.Constant) and isinstance(node.body[0].value.value, str):
                d = node.body[0]
                doc.update(range(d.lineno, d.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        for l in range(tok.start[0], tok.end[0] + 1):
            if l not in doc:
                lines.add(l)
    return len(lines), len(src.splitlines())
ROW = re.compile(r"\| `([^`]+)`(?:, `([^`]+)`)? \| (.*) \| ([\d,]+) \| ([\d,]+) \|$")


def row_counts(row: re.Match) -> tuple[int, int]:
    """A row's files' code lines and lines (the tests' row: every test file and conftest)."""
    files = [row.group(1)] + ([row.group(2)] if row.group(2) else [])
    if files[0].startswith("test_"):
        files = sorted(glob.glob("test_*.py")) + ["conftest.py"]
    counts = [code_lines(f) for f in files]
    return sum(c for c, _ in counts), sum(t for _, t in counts)


def main() -> None:
    with open("README.md", encoding="utf-8") as f:
        readme = f.read()
    core, total = [0, 0], [0, 0]
    in_core = False
    new = []
    for line in readme.splitlines():
        in_core = line.startswith("| **the engine's core**") or (
            in_core and not line.startswith("| **beside it**"))
        row = ROW.match(line)
        if row:
            code, lines = row_counts(row)
            print(f"{row.group(1):24} {row.group(4):>6} -> {code:,}   {row.group(5):>6} -> {lines:,}")
            total = [total[0] + code, total[1] + lines]
            if in_core:
                core = [core[0] + code, core[1] + lines]
            head = line[:line.rfind(row.group(4) + " | " + row.group(5))]
            line = f"{head}{code:,} | {lines:,} |"
        elif line.startswith("| *the core*"):
            line = f"| *the core* | | *{core[0]:,}* | *{core[1]:,}* |"
        elif line.startswith("| **total**"):
            line = f"| **total** | | {total[0]:,} | {total[1]:,} |"
        new.append(line)
    if "--write" in sys.argv:
        with open("README.md", "w", encoding="utf-8") as f:
            f.write("\n".join(new) + "\n")


if __name__ == "__main__":
    main()
