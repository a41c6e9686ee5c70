"""The statements only CUDA runs that no CPU test reaches (issue 47, item 8): every statement
inside a CUDA branch of the engine's modules (an `if` on is_cuda, a device's type,
torch.cuda...; for `if not ...cuda...`, its else, or, when it returns early, what follows it)
and every statement of cuda_runtime.py's functions, less those coverage saw run (a statement
by its first line, as coverage counts it). The goal: only calls into the CUDA runtime remain
(BENCHMARKS.md lists them, with the reason each is left).

How to run, from the repository root (the tests that run the CUDA path with fake_cuda; the
whole suite reaches no more of it):
    python -m coverage run -m pytest -q -p no:cacheprovider test_model_runner.py \
        test_model.py test_structured_output.py test_kernels.py test_swap.py \
        test_nanoserve.py test_tensor_parallel.py -k "cuda or grid or device or sms"
    python -m coverage json -o /tmp/coverage.json
    python .ci/cuda_lines.py /tmp/coverage.json
"""
import ast
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the engine's modules (bench.py's CUDA branches are .ci/gpu's, run on a GPU alone)
MODULES = ("nanoserve", "scheduler", "input_batch", "paged_cache", "model", "kernels",
           "model_runner", "sampling", "spec_decode", "draft_proposer", "structured_output",
           "swap", "checkpoint", "tensor_parallel")
RUNTIME = "cuda_runtime"  # its function bodies are the CUDA runtime's calls, every line


def is_cuda_test(node: ast.expr) -> bool:
    """Whether an `if`'s test asks if something is on CUDA."""
    return "cuda" in ast.unparse(node)


def lines_of(statements: list[ast.stmt]) -> set[int]:
    """The first line of each statement among these and those nested in them."""
    return {node.lineno for s in statements for node in ast.walk(s)
            if isinstance(node, ast.stmt)}


def returns_early(statements: list[ast.stmt]) -> bool:
    return isinstance(statements[-1], (ast.Return, ast.Raise))


def cuda_lines(tree: ast.Module) -> set[int]:
    """The lines inside the module's CUDA branches."""
    found = set()
    for block in ast.walk(tree):
        for field in ("body", "orelse"):
            statements = getattr(block, field, None)
            if not isinstance(statements, list):
                continue
            for i, s in enumerate(statements):
                if not isinstance(s, ast.If) or not is_cuda_test(s.test):
                    continue
                if not isinstance(s.test, ast.UnaryOp):  # if ...cuda...: its body
                    found |= lines_of(s.body)
                    continue
                # if not ...cuda...: its else, or (its body returning) the rest of the block
                if s.orelse:
                    found |= lines_of(s.orelse)
                elif returns_early(s.body):
                    found |= lines_of(statements[i + 1:])
    return found


def runtime_lines(tree: ast.Module) -> set[int]:
    """The lines of cuda_runtime.py's function bodies (their docstrings aside)."""
    found = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body
            found |= lines_of(body)
    return found


def main(coverage_json: str) -> int:
    with open(coverage_json) as f:
        files = json.load(f)["files"]
    unreached = 0
    for name in (*MODULES, RUNTIME):
        path = os.path.join(ROOT, name + ".py")
        with open(path) as f:
            source = f.read()
        tree = ast.parse(source)
        lines = runtime_lines(tree) if name == RUNTIME else cuda_lines(tree)
        executed = set(files.get(name + ".py", {}).get("executed_lines", []))
        code = source.splitlines()
        for line in sorted(lines - executed):
            print(f"{name}.py:{line}: {code[line - 1].strip()}")
            unreached += 1
    print(f"{unreached} CUDA lines no test reached", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
