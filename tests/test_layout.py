"""The package's shape (DESIGN.md, "The shape of the code"): stage folders whose imports point up the list of
stages, never down and never in a circle; modules and functions of a size one reads; module docstrings of ten
lines or fewer; and docs that name only module paths that exist."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "jaxlm"

# The stages, top first: a module may import from its own stage and from stages above it.
STAGES = ["errors", "config", "configs", "sharding", "params", "runtime", "storage", "launch", "model", "families",
          "data", "store", "infer", "serve", "train", "eval", "rewards", "cli"]
TOP_MODULES_MAX = 10
MODULE_LINES_MAX = 600
FUNCTION_LINES_MAX = 100
DOCSTRING_LINES_MAX = 10
# Kept longer, and why.
LONG_FUNCTIONS: dict[str, str] = {}
LONG_MODULES: dict[str, str] = {}


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    """The jaxlm modules `module` imports (anywhere in it: lazy imports count), with their line numbers."""
    known = modules()
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("jaxlm")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("jaxlm"):
            for a in node.names:  # `from jaxlm.x import y`: y may be a module or a name of x
                sub = f"{node.module}.{a.name}"
                out.append((sub if sub in known else node.module, node.lineno))
    return out


def test_top_level_holds_few_modules():
    top = [p.name for p in SRC.glob("*.py")]
    assert len(top) <= TOP_MODULES_MAX, f"src/jaxlm holds {len(top)} modules (at most {TOP_MODULES_MAX}): {top}"


def test_imports_point_up_the_stages():
    wrong = []
    for module, path in modules().items():
        s = stage(module)
        if s == "__init__":
            continue
        assert s in STAGES, f"{module}: stage {s!r} is not in tests/test_layout.py's STAGES (add it in its place)"
        for target, line in imports(module, path):
            t = stage(target)
            if t in ("__init__",) or t == s:
                continue
            if STAGES.index(t) > STAGES.index(s):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({s}) imports {target} ({t}, a stage below)")
    assert not wrong, "imports point down the stages:\n" + "\n".join(wrong)


def test_no_import_cycles():
    known = modules()
    graph = {m: sorted({t for t, _ in imports(m, p) if t in known and t != m}) for m, p in known.items()}
    cycles, state = [], {}

    def visit(m, trail):
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(trail[trail.index(t):] + [t]))
            elif t not in state:
                visit(t, trail + [t])
        state[m] = 2

    for m in graph:
        if m not in state and m != "jaxlm":
            visit(m, [m])
    cycles = [c for c in cycles if not c.startswith("jaxlm ->")]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_modules_and_functions_fit_a_reading():
    long_modules, long_functions, long_docs = [], [], []
    for module, path in modules().items():
        text = path.read_text()
        n = text.count("\n")
        if n > MODULE_LINES_MAX and module not in LONG_MODULES:
            long_modules.append(f"{path.relative_to(ROOT)}: {n} lines")
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False)
        if doc is not None and doc.strip().count("\n") + 1 > DOCSTRING_LINES_MAX:
            long_docs.append(f"{path.relative_to(ROOT)}: docstring of {doc.strip().count(chr(10)) + 1} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                name = f"{module}.{node.name}"
                if length > FUNCTION_LINES_MAX and name not in LONG_FUNCTIONS:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    problems = long_modules + long_functions + long_docs
    assert not problems, (f"over {MODULE_LINES_MAX} lines a module, {FUNCTION_LINES_MAX} a function or "
                          f"{DOCSTRING_LINES_MAX} a module docstring:\n" + "\n".join(problems))


DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"\bjaxlm(?:\.[a-z_][a-z0-9_]*)+")
FILE_PATH = re.compile(r"\b(?:src/)?jaxlm/[a-z_/]+\.py\b")


FILE_SUFFIXES = {"sock", "sbatch", "yaml", "json", "jsonl", "log", "txt", "md", "py", "toml"}


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_docs_name_modules_that_exist(doc):
    """Paths such as src/jaxlm/train/step.py and dotted names such as jaxlm.train.step.setup in the README and
    docs/ point at modules (and names in them) that exist."""
    known = modules()
    missing = []
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        for m in FILE_PATH.finditer(line):
            if not (SRC.parent / m.group(0).removeprefix("src/")).exists():
                missing.append(f"{doc.name}:{i}: {m.group(0)}")
        for m in DOTTED.finditer(line):
            parts = m.group(0).split(".")
            if parts[-1] in FILE_SUFFIXES:  # a file name such as jaxlm.sock
                continue
            k = max(j for j in range(1, len(parts) + 1) if ".".join(parts[:j]) in known)
            if k < len(parts) and not hasattr(importlib.import_module(".".join(parts[:k])), parts[k]):
                missing.append(f"{doc.name}:{i}: {m.group(0)}")
    assert not missing, "docs name module paths that do not exist:\n" + "\n".join(missing)
