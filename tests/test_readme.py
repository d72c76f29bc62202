"""The README and the shape of the code: every function and test that the README and docs/*.md name exists; the six
files of the paper and each file of lab/ stay within their sizes; imports run one way (the paper's four bottom files,
then lab/, then train.py and evaluate.py) with no circle inside lab/; no line over 120 characters; the README is a
front door (short, the equation map, the two commands) whose Python example runs."""
import ast
import glob
import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MAP = "\n".join([README] + [open(path, encoding="utf-8").read() for path in DOCS])  # the README and what it links
PAPER = ["adapters", "lorentz", "model", "data", "train", "evaluate"]  # the six files, in reading order
WINGS = ["disk", "datasets", "models", "run", "scores", "studies", "cli"]  # lab/'s wings, bottom first
LAB = sorted(os.path.relpath(p, os.path.join(ROOT, "lab"))[:-3].replace(os.sep, ".")
             for p in glob.glob(os.path.join(ROOT, "lab", "*", "*.py")) if not p.endswith("__init__.py"))


def lab_path(module):
    """lab/wing/x.py of "wing.x"."""
    return "lab/" + module.replace(".", "/") + ".py"


def read(path):
    return open(os.path.join(ROOT, path), encoding="utf-8").read()


def top_level_names(path):
    """Classes, functions, methods (Class.method) and assigned names at the top of a Python file."""
    names = set()
    for node in ast.parse(read(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            names |= {f"{node.name}.{m.name}" for m in getattr(node, "body", []) if isinstance(m, ast.FunctionDef)}
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_function_and_test_the_readme_and_docs_name_exists():
    assert DOCS  # the studies and the operational detail live in docs/*.md
    named = set(re.findall(r"`([a-z_/]+\.py):([A-Za-z_][\w.]*)`", MAP))
    tests = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)", MAP))
    assert len(named) > 100 and len(tests) > 100  # the map is there
    assert sorted((f, n) for f, n in named if n not in top_level_names(f)) == []
    assert sorted((f, t) for f, t in tests if t not in top_level_names(f)) == []


def lines(path):
    return len(read(path).rstrip("\n").split("\n"))


def test_the_six_files_hold_the_paper_in_under_2000_lines():
    sizes = {f: lines(f + ".py") for f in PAPER}
    assert {f: n for f, n in sizes.items() if n > 400} == {} and sum(sizes.values()) <= 2000, sizes


def test_each_lab_file_holds_one_concept_in_at_most_400_lines():
    assert len(LAB) > 10 and set(WINGS) == {m.split(".")[0] for m in LAB}  # the harness is there, in its wings
    assert {f: n for f in LAB if (n := lines(lab_path(f))) > 400} == {}
    assert all(ast.get_docstring(ast.parse(read(f"lab/{w}/__init__.py"))) for w in WINGS)  # what a wing holds


def project_imports(path):
    """The project modules a file imports anywhere in it (deferred imports count): "lab.wing.x" for a lab file."""
    found = set()
    for node in ast.walk(ast.parse(read(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            found |= {f"{base}.{a.name}" for a in node.names} if base in {"lab", *(f"lab.{w}" for w in WINGS)} \
                else {base}
    top = {m.split(".")[0] for m in found}
    lab = {m for m in found if m.startswith("lab.")}
    assert lab <= {f"lab.{f}" for f in LAB}, (path, lab)  # a wing's module, never a wing's face or lab's
    return lab | (top & set(PAPER))


# Who may import whom (README, "Files"): data, lorentz, adapters import no project file; model imports those;
# lab/ imports the four and itself, each wing only the wings below it; train.py lab and below; evaluate.py everything.
LEVEL = {"data": 0, "lorentz": 0, "adapters": 0, "model": 1, **{f"lab.{f}": 2 for f in LAB}, "train": 3,
         "evaluate": 4}


def test_imports_run_one_way():
    for name, level in LEVEL.items():
        imported = project_imports(lab_path(name[4:]) if name.startswith("lab.") else name + ".py")
        against = {m for m in imported if LEVEL[m] > level or (LEVEL[m] == level and level != 2) or m == name}
        assert against == set(), (name, against)


def test_the_wings_import_one_way():
    """A module of lab/ imports its own wing and the wings below it (WINGS, bottom first), never one above."""
    up = {(f, m) for f in LAB for m in project_imports(lab_path(f)) if m.startswith("lab.")
          and WINGS.index(m.split(".")[1]) > WINGS.index(f.split(".")[0])}
    assert up == set()


def lab_closure(start):
    """Every lab module that the lab modules `start` import, directly or through others."""
    seen, todo = set(), list(start)
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo += [m[4:] for m in project_imports(lab_path(f)) if m.startswith("lab.")]
    return seen


def test_the_training_and_evaluation_path_imports_no_study_and_no_command_line():
    """Nothing under run/ or datasets/ reaches studies/ or cli/, through any chain of imports."""
    path = lab_closure([f for f in LAB if f.split(".")[0] in ("run", "datasets")])
    assert {f for f in path if f.split(".")[0] in ("studies", "cli")} == set()


def test_no_import_circle_inside_lab():
    graph = {f: {m[4:] for m in project_imports(lab_path(f)) if m.startswith("lab.")} - {f} for f in LAB}
    done, path = set(), []

    def visit(f):
        assert f not in path, " -> ".join(path[path.index(f):] + [f])  # a circle
        if f not in done:
            path.append(f)
            for g in sorted(graph[f]):
                visit(g)
            path.pop()
            done.add(f)
    for f in LAB:
        visit(f)


def test_no_file_of_the_paper_or_of_lab_imports_a_tool():
    """tools/ (the data and twin writers, the benchmarks) serves the tests and runs by hand; the project never imports
    it."""
    tools = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tools", "*.py"))}
    imported = {(f, name.split(".")[0]) for f in [f"{m}.py" for m in PAPER] + [lab_path(m) for m in LAB]
                for node in ast.walk(ast.parse(read(f))) if isinstance(node, (ast.Import, ast.ImportFrom))
                for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])}
    assert "twins" in tools and {(f, m) for f, m in imported if m in tools} == set()


def test_no_line_is_longer_than_120_characters():
    """The project's line length, checked here rather than by a formatter: a formatter would also rewrap the
    hand-aligned equation comments and tables that make the code read like the paper."""
    files = [f"{m}.py" for m in PAPER] + [lab_path(f) for f in LAB] + ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for folder in ("tests", "tools")
        for p in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True))
    long = [(f, n + 1) for f in files for n, line in enumerate(read(f).split("\n")) if len(line) > 120]
    assert long == []


def test_the_readme_is_a_front_door():
    """At most 165 lines: what it is, the two commands, the map from every equation to its code, the real-model
    commands, your own data, lmms-eval, results, the files, a Python example."""
    assert len(README.rstrip("\n").split("\n")) <= 165
    for command in ("python train.py && python evaluate.py", "python -m pytest tests/paper", "python -m pytest -q"):
        assert command in README, command
    mapped = {n for a, b in re.findall(r"^\| Eq (\d+)(?:-(\d+))? \|", README, flags=re.M)
              for n in range(int(a), int(b or a) + 1)}
    assert mapped == set(range(1, 20))  # Eq 1-19, each in a row of the equation map
    assert {f for f in PAPER if f"| `{f}.py` |" in README} == set(PAPER) and "| `lab/` |" in README  # Files


def readme_example():
    """The README's Python example: the one ```python block."""
    blocks = re.findall(r"^```python\n(.*?)^```$", README, flags=re.M | re.S)
    assert len(blocks) == 1 and len(blocks[0].rstrip("\n").split("\n")) <= 7, blocks
    return blocks[0]


def test_the_readme_python_example_runs(tmp_path):
    """The example as the README prints it, run in a fresh interpreter in a folder that holds a trained adapter at
    the default job's path: here an adapter on toy-idefics2 with random parameters, saved by the harness (a real
    training run is the default job's own test). It must print one answer per item it asks about."""
    code = readme_example()
    path = re.search(r'"(runs/[^"]+\.safetensors)"', code).group(1)
    import model as M
    from lab.models import backbones
    from lab.run import checkpoints
    backbone = backbones.load_backbone("toy-idefics2")
    M.attach(backbone.model, "hyper-icl", rank=4)
    for p in M.adapter_modules(backbone.model).parameters():
        torch.nn.init.normal_(p, std=0.1)
    os.makedirs(tmp_path / os.path.dirname(path))
    checkpoints.save_adapter(tmp_path / path, backbone)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = ast.literal_eval(run.stdout.strip().split("\n")[-1])
    assert isinstance(answers, list) and len(answers) == 4 and all(isinstance(a, str) for a in answers), run.stdout
