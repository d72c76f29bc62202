"""The README's map of the code: every function and test that it and docs/*.md name exists, each file's paper part
ends where the file's plumbing begins, imports run the one way it says, and the README stays a front door (short,
the equation map near its top)."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MAP = "\n".join([README] + [open(path, encoding="utf-8").read() for path in DOCS])  # the README and what it links


def top_level_names(path):
    """Classes, functions, methods (Class.method) and assigned names at the top of a Python file."""
    names = set()
    for node in ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            names |= {f"{node.name}.{m.name}" for m in getattr(node, "body", []) if isinstance(m, ast.FunctionDef)}
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_function_and_test_the_readme_and_docs_name_exists():
    assert DOCS  # the studies and the operational detail live in docs/*.md
    named = set(re.findall(r"`([a-z_/]+\.py):([A-Za-z_][\w.]*)`", MAP))
    tests = set(re.findall(r"`(tests/\w+\.py)::(\w+)", MAP))
    assert len(named) > 100 and len(tests) > 100  # the map is there
    assert sorted((f, n) for f, n in named if n not in top_level_names(f)) == []
    assert sorted((f, t) for f, t in tests if t not in top_level_names(f)) == []


def test_each_paper_part_ends_where_the_plumbing_begins():
    parts = re.findall(r"^\| `(\w+\.py)` \| 1-(\d+) \|", README, flags=re.M)
    assert {f for f, _ in parts} == {"adapters.py", "lorentz.py", "train.py", "data.py", "model.py", "evaluate.py"}
    for f, end in parts:
        lines = open(os.path.join(ROOT, f), encoding="utf-8").read().rstrip("\n").split("\n")
        end = int(end)
        if end == len(lines):  # the whole file is the paper
            continue
        assert end < len(lines) and lines[end].startswith("# ---"), (f, end)  # line end + 1 opens the plumbing
        assert lines[end - 1].strip() == "", (f, end)                          # after the paper's blank line


def test_the_readme_is_a_front_door_with_the_equation_map_near_its_top():
    lines = README.rstrip("\n").split("\n")
    assert len(lines) <= 250, len(lines)
    eq1 = next(i for i, line in enumerate(lines, 1) if line.startswith("| Eq 1"))
    assert lines[eq1 - 3].startswith("| what |") and lines[eq1 - 2].startswith("|---")  # its header, right above
    assert eq1 <= 120, eq1


LEVEL = {"data": 0, "lorentz": 0, "adapters": 0, "model": 1, "train": 2, "evaluate": 3}  # README, "Files"


def test_imports_run_one_way():
    for name, level in LEVEL.items():
        tree = ast.parse(open(os.path.join(ROOT, name + ".py"), encoding="utf-8").read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        upward = {m for m in imported & set(LEVEL) if LEVEL[m] >= level}  # a file at its own level or above
        assert upward == set(), (name, upward)


def test_no_line_is_longer_than_120_characters():
    """The project's line length, checked here rather than by a formatter: a formatter would also rewrap the
    hand-aligned equation comments and tables that make the code read like the paper."""
    tests = [os.path.join("tests", f) for f in sorted(os.listdir(os.path.join(ROOT, "tests"))) if f.endswith(".py")]
    long = [(f, n + 1) for f in [f"{m}.py" for m in LEVEL] + tests
            for n, line in enumerate(open(os.path.join(ROOT, f), encoding="utf-8")) if len(line.rstrip("\n")) > 120]
    assert long == []
