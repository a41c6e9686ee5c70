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
readme = open('README.md').read()
out = []
for line in readme.splitlines():
    m = re.match(r"\| `([^`]+)`(?:, `([^`]+)`)? \| (.*) \| ([\d,]+) \| ([\d,]+) \|$", line)
    if not m:
        continue
    files = [m.group(1)] + ([m.group(2)] if m.group(2) else [])
    if files[0].startswith('test_'):
        files = sorted(glob.glob('test_*.py')) + ['conftest.py']
    c = t = 0
    for f in files:
        a, b = code_lines(f); c += a; t += b
    print(f"{files[0]:24} {m.group(4):>6} -> {c:,}   {m.group(5):>6} -> {t:,}")

# rewrite the table
lines = readme.splitlines()
core = [0, 0]; total = [0, 0]; in_core = False
new = []
for line in lines:
    m = re.match(r"\| `([^`]+)`(?:, `([^`]+)`)? \| (.*) \| ([\d,]+) \| ([\d,]+) \|$", line)
    if line.startswith("| **the engine's core**"): in_core = True
    if line.startswith("| **beside it**"): in_core = False
    if m:
        files = [m.group(1)] + ([m.group(2)] if m.group(2) else [])
        if files[0].startswith('test_'):
            files = sorted(glob.glob('test_*.py')) + ['conftest.py']
        c = t = 0
        for f in files:
            a, b = code_lines(f); c += a; t += b
        total[0] += c; total[1] += t
        if in_core: core[0] += c; core[1] += t
        head = line[:line.rfind(m.group(4) + " | " + m.group(5))]
        line = f"{head}{c:,} | {t:,} |"
    elif line.startswith("| *the core*"):
        line = f"| *the core* | | *{core[0]:,}* | *{core[1]:,}* |"
    elif line.startswith("| **total**"):
        line = f"| **total** | | {total[0]:,} | {total[1]:,} |"
    new.append(line)
if "--write" in sys.argv:
    open('README.md', 'w').write("\n".join(new) + "\n")
