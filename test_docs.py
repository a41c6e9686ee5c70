"""The docs name only what exists: every code name in the README and in the modules' docstrings
is a name in the code, so a rename cannot leave a doc behind.

A code name is a span in backticks that reads as an identifier (`Scheduler`, `seq.block_table`,
`verify()`, `--max-num-seqs`, `swap.py`), and, in docstrings, also an unquoted word that can only
be code (`num_computed_tokens`, `Engine.step`: a snake_case word or Class.attribute). A dotted
name whose head is one of our classes must be that class's own: `Engine._detokenize` fails when
`Engine` has no `_detokenize`, even if some other class has one."""
import ast
import functools
import glob
import keyword
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?$")
FILE_NAME = re.compile(r"^[\w.-]+\.py$")
# unquoted words in docstrings that can only be code: snake_case, or Class.attribute
CODE_WORD = re.compile(r"(?<![\w./-])([A-Za-z_][A-Za-z0-9]*_\w+|[A-Z]\w+\.[a-z_]\w*)(?:\(\))?"
                       r"(?![\w/-])")
# Names the docs use that are not ours, each for a reason.
OUTSIDE_NAMES = {
    # math in the derivations (kernels.py's online softmax, model.py's rotation)
    "m_j", "l_j", "w_j", "acc_j", "sum_j", "m_max", "x_i", "s_t", "E", "the", "cat", "sat", "ran",
    # other projects' functions the docs compare with
    "apply_chat_template", "fused_add_rms_norm", "repeat_kv", "rotate_half", "guidance",
    "ignore_merges", "num_queries_per_kv", "device_ms",
    # checkpoint files, GPT-2's weights and special tokens as checkpoints spell them
    "pytorch_model", "adapter_model", "c_attn", "begin_of_text", "end_of_text", "eom_id", "im_end", "tool_call",
    # a usage line's placeholders
    "CHECKPOINT_DIR", "ADAPTER_DIR",
    # vLLM's, which our LLM does not have
    "LLM.chat",
}
DATA_FILE = re.compile(r"^[\w.-]+\.(txt|json|jsonl|bin|safetensors|gguf|html|png|md|toml)$")


def code_files() -> list[str]:
    """The project's Python files, this one left out: its examples name what does not exist."""
    paths = glob.glob(os.path.join(HERE, "*.py")) + glob.glob(os.path.join(HERE, ".ci", "*.py"))
    return sorted(path for path in paths if os.path.basename(path) != "test_docs.py")


class CodeNames(ast.NodeVisitor):
    """Every identifier the code defines or uses, every string constant (option values and JSON
    keys are code too), and each of our classes' own members."""

    def __init__(self):
        self.names = set()
        self.strings = set()
        self.members: dict[str, set[str]] = {}
        self.bases: dict[str, list[str]] = {}

    def visit_ClassDef(self, node: ast.ClassDef):
        own = self.members.setdefault(node.name, set())
        self.bases[node.name] = [base.id for base in node.bases if isinstance(base, ast.Name)]
        for child in ast.walk(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.add(child.name)
            elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                own.add(child.target.id)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                own.add(child.id)
            elif isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store):
                own.add(child.attr)  # self.x = ...
        self.names.add(node.name)
        self.generic_visit(node)

    def generic_visit(self, node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.names.add(node.name)
        elif isinstance(node, ast.Name):
            self.names.add(node.id)
        elif isinstance(node, ast.Attribute):
            self.names.add(node.attr)
        elif isinstance(node, ast.arg):
            self.names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            self.names.add(node.arg)
        elif isinstance(node, ast.alias):
            self.names.update(node.name.split("."))
            self.names.add(node.asname or node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            self.strings.add(node.value)
        super().generic_visit(node)

    def has_member(self, cls: str, name: str) -> bool:
        if name in self.members.get(cls, set()):
            return True
        return any(self.has_member(base, name) for base in self.bases.get(cls, []))


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def docstrings(tree: ast.Module) -> list[str]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [ast.get_docstring(node, clean=False) or "" for node in ast.walk(tree)
            if isinstance(node, kinds)]


@functools.cache
def scan_code() -> tuple[CodeNames, list[tuple[str, str]]]:
    """The code's names, and (file, text) of each module docstring (tests excluded)."""
    code = CodeNames()
    texts = []
    for path in code_files():
        name = os.path.basename(path)
        tree = ast.parse(read(path))
        code.names.add(name.removesuffix(".py"))
        code.visit(tree)
        if not name.startswith("test_") and name != "conftest.py":
            texts += [(name, text) for text in docstrings(tree)]
    return code, texts


def unknown_names(span: str, code: CodeNames) -> list[str]:
    """The parts of a code name that the code does not have ([] if it is all there)."""
    if span in OUTSIDE_NAMES or DATA_FILE.match(span):
        return []
    if FILE_NAME.match(span):
        return [] if os.path.exists(os.path.join(HERE, span)) else [span]
    if span.startswith("--"):
        flag = span.split()[0].split("=")[0]
        field = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
        found = field in code.names or any(flag in s for s in code.strings)
        return [] if found else [flag]
    if not IDENTIFIER.match(span):
        return []
    parts = span.removesuffix("()").split(".")
    known = code.names | code.strings | OUTSIDE_NAMES | set(keyword.kwlist)
    missing = [part for part in parts if part not in known]
    head, *rest = parts
    if rest and head in code.members and not code.has_member(head, rest[0]):
        missing.append(f"{head} has no {rest[0]}")
    return missing


def stale_names(texts: list[tuple[str, str]], code: CodeNames, unquoted: bool
                ) -> list[str]:
    stale = []
    for where, text in texts:
        spans = [span.strip() for span in re.findall(r"`([^`\n]+)`", text)]
        if unquoted:
            spans += CODE_WORD.findall(text)
        for span in spans:
            missing = unknown_names(span, code)
            if missing:
                stale.append(f"{where}: {span} ({', '.join(missing)})")
    return stale


def test_every_code_name_in_the_readme_exists():
    code, _ = scan_code()
    readme = [("README.md", read(os.path.join(HERE, "README.md")))]
    assert stale_names(readme, code, unquoted=False) == []


def test_every_code_name_in_a_docstring_exists():
    code, texts = scan_code()
    assert stale_names(texts, code, unquoted=True) == []


def test_a_renamed_name_is_seen():
    """The check itself: a method that no longer exists, a file, a flag and a class's missing
    member are all caught."""
    code, _ = scan_code()
    text = ("`Engine.step` and `Scheduler.schedule()` exist; `make_proposer`, `nanoserve.py`, "
            "`gone.py`, `--max-num-seqs`, `--no-such-flag` and `Engine._detokenize`")
    stale = stale_names([("doc", text)], code, unquoted=False)
    assert stale == ["doc: make_proposer (make_proposer)", "doc: gone.py (gone.py)",
                     "doc: --no-such-flag (--no-such-flag)",
                     "doc: Engine._detokenize (_detokenize, Engine has no _detokenize)"]
