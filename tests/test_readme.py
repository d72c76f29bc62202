"""The README's map of the code: every function and test it names exists, each file's paper part ends where the
file's plumbing begins, and imports run the one way it says."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


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


def test_every_function_and_test_the_readme_names_exists():
    named = set(re.findall(r"`([a-z_]+\.py):([A-Za-z_][\w.]*)`", README))
    tests = set(re.findall(r"`(tests/\w+\.py)::(\w+)", README))
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


LEVEL = {"data": 0, "lorentz": 0, "adapters": 0, "model": 1, "train": 2, "evaluate": 3}  # README, "Files"


def test_imports_run_one_way():
    for name, level in LEVEL.items():
        tree = ast.parse(open(os.path.join(ROOT, name + ".py"), encoding="utf-8").read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        upward = {m for m in imported & set(LEVEL) if LEVEL[m] >= level}  # a file at its own level or above
        assert upward == set(), (name, upward)
