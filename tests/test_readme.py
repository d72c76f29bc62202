"""The README and the shape of the code: every name, test, path and link that the README and docs/*.md write exists,
and every name and path the tests' docstrings and comments write;
the six files of the paper stay small together; imports run one way (the paper's four bottom files, then lab/'s wings
bottom first, then train.py and evaluate.py, then lab's command line, lab/cli/commands.py and modes.py, which alone
import the two scripts: the README's Files table) with no circle inside lab/; no line over 120 characters; the README
is a front door (short, the equation map, the two commands) whose Python example runs."""
import ast
import functools
import glob
import io
import os
import re
import subprocess
import sys
import tokenize

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
MAP = "\n".join([README] + [open(path, encoding="utf-8").read() for path in DOCS])  # the README and what it links
DOC_FILES = ["README.md", "CHANGELOG.md"] + [os.path.relpath(p, ROOT) for p in DOCS]
TEST_FILES = sorted(os.path.relpath(p, ROOT)
                    for p in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True))
PAPER = ["adapters", "lorentz", "model", "data", "train", "evaluate"]  # the six files, in reading order
WINGS = ["disk", "datasets", "models", "methods", "run", "scores", "studies", "cli"]  # lab/'s wings, bottom first
LAB = sorted(os.path.relpath(p, os.path.join(ROOT, "lab"))[:-3].replace(os.sep, ".")
             for p in glob.glob(os.path.join(ROOT, "lab", "*", "*.py")) if not p.endswith("__init__.py"))


def lab_path(module):
    """lab/<wing>/<x>.py of "<wing>.<x>"."""
    return "lab/" + module.replace(".", "/") + ".py"


def read(path):
    return open(os.path.join(ROOT, path), encoding="utf-8").read()


@functools.lru_cache(maxsize=None)
def top_level_names(path):
    """Classes, functions, assigned names at the top of a Python file, and Class.method, Class.field inside a class."""
    def named(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                yield node.name
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = getattr(node, "targets", None) or [node.target]  # x = ... or x: int = ...
                yield from (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    tree = ast.parse(read(path)).body
    return set(named(tree)) | {f"{c.name}.{n}" for c in tree if isinstance(c, ast.ClassDef) for n in named(c.body)}


def commentary(path):
    """A Python file's prose: its docstrings (module, classes, functions) and its comments, one to a line."""
    source = read(path)
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    return "\n".join([d for d in map(ast.get_docstring, nodes) if d] + comments)


def prose(text):
    """A markdown text without its fenced blocks (shell commands, examples, file records)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


# A reference in the docs, anywhere in README.md or docs/*.md (prose, tables, code spans and fenced blocks), is
# either `<path>.py:<name>` or `<path>.py::<test>` (path from the project's root) or a dotted `module.name`
# (`module.Class.method`) whose first part is one of the six files or a module of lab/ by its bare name (`runs.start`;
# unique across the wings) or a dotted path from `lab` (`lab.run`, `lab.run.runs.start`). A dotted name whose last part
# is a file ending (`data.py`, `history.json`, `adapter.safetensors`) names a file; one that starts with anything else
# (`torch.cuda`, `0.7.3`, `backbone.model`) or follows a letter, a dot, a slash or a dash (`lab/run/runs.py`) is no
# reference. The name must be a top-level name of that file, Class.method or Class.field, or nothing (`lab.run`).
MODULES = {**{f: f + ".py" for f in PAPER}, **{m.split(".")[1]: lab_path(m) for m in LAB},
           **{f"lab.{m}": lab_path(m) for m in LAB}, **{f"lab.{w}": f"lab/{w}/__init__.py" for w in WINGS}}
FILE_ENDINGS = {"py", "json", "jsonl", "pt", "safetensors", "txt", "md", "png", "tmp", "lock", "csv", "parquet"}


def broken_references(doc, text=None):
    """The references of one doc (or of `text`, written in it) that name nothing, each once, as "doc: reference"."""
    text, broken = read(doc) if text is None else text, []
    for path, name in re.findall(r"(?<![\w./<-])((?:[\w-]+/)*\w+\.py)::?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text):
        if not os.path.isfile(os.path.join(ROOT, path)) or name not in top_level_names(path):
            broken.append(f"{doc}: {path}:{name}")
    for dotted in re.findall(r"(?<![\w./-])([a-z_]\w*(?:\.[A-Za-z_]\w*)+)", text):
        parts = dotted.split(".")
        if parts[0] not in {*MODULES, "lab"} or parts[-1] in FILE_ENDINGS:
            continue  # no reference
        module = max((k for k in MODULES if f"{dotted}.".startswith(k + ".")), key=len, default="")
        if not module or dotted != module and dotted[len(module) + 1:] not in top_level_names(MODULES[module]):
            broken.append(f"{doc}: {dotted}")
    return list(dict.fromkeys(broken))


def test_every_name_and_test_the_readme_and_docs_name_exists():
    """Every reference (the rule above MODULES) in README.md and docs/*.md names a function, class, method,
    constant, module or test that is there; the failure lists all that are not, at once."""
    assert DOCS and len(MODULES) == len(PAPER) + 2 * len(LAB) + len(WINGS)  # a lab module's bare name is unique
    assert len(set(re.findall(r"`([\w/]+\.py):([A-Za-z_][\w.]*)`", MAP))) > 100  # the map is there
    assert len(set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)", MAP))) > 100
    broken = [b for doc in DOC_FILES for b in broken_references(doc)]
    assert broken == [], "names that are not there:\n" + "\n".join(broken)


def test_every_name_and_path_the_tests_docstrings_and_comments_write_exists():
    """The tests' prose (docstrings and comments of tests/**/*.py) follows the docs' rules: every reference (the rule
    above MODULES) names what is there, and every lab/, tests/, tools/ or docs/ path exists."""
    assert len(TEST_FILES) > 40 and "tests/test_readme.py" in TEST_FILES
    broken = [b for path in TEST_FILES for b in broken_references(path, commentary(path))]
    broken += [m for path in TEST_FILES for m in missing_paths(path, commentary(path))]
    assert broken == [], "names and paths that are not there:\n" + "\n".join(broken)


def headings(path):
    """The anchors of a markdown file's headings, as GitHub makes them."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", prose(read(path)), flags=re.M)}


def missing_paths(doc, text):
    """The lab/, tests/, tools/ or docs/ paths of `text`, written in doc, that are not there (from the project's root;
    a * a glob that must match), as "doc: path"."""
    missing = []
    for path in re.findall(r"(?<![\w./~-])(?:\./)?((?:lab|tests|tools|docs)/[\w./*<>-]*)", text):
        if "<" in path:
            continue  # a placeholder: tests/test_<file>.py
        missing += [] if glob.glob(os.path.join(ROOT, path.rstrip("."))) else [f"{doc}: {path}"]
    return missing


def test_every_path_and_link_in_the_readme_and_docs_exists():
    """Every lab/, tests/, tools/ or docs/ path written in README.md or docs/*.md (fenced blocks included) is there,
    and so is every local markdown link's file and #anchor."""
    missing = []
    for doc in DOC_FILES:
        text = read(doc)
        missing += missing_paths(doc, text)
        for link in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
            target, _, anchor = link.partition("#")
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            target = os.path.normpath(os.path.join(os.path.dirname(doc), target)) if target else doc
            found = os.path.exists(os.path.join(ROOT, target)) and (not anchor or anchor in headings(target))
            missing += [] if found else [f"{doc}: ({link})"]
    missing = list(dict.fromkeys(missing))
    assert missing == [], "paths and links that are not there:\n" + "\n".join(missing)


def lines(path):
    return len(read(path).rstrip("\n").split("\n"))


def test_the_six_files_hold_the_paper_together_in_at_most_1400_lines():
    """No file has a cap of its own (a cap decided where code went); the six together stay small (1,631 at 60f5ec9):
    what is not the paper (pixel helpers, SEED's likelihood protocol, the default job's bookkeeping) lives in lab/."""
    assert sum(lines(f + ".py") for f in PAPER) <= 1400


def test_each_wing_of_lab_says_what_it_holds():
    assert len(LAB) > 10 and set(WINGS) == {m.split(".")[0] for m in LAB}  # the harness is there, in its wings
    assert all(ast.get_docstring(ast.parse(read(f"lab/{w}/__init__.py"))) for w in WINGS)  # what a wing holds


def project_imports(path):
    """The project modules a file imports anywhere in it (deferred imports count): "lab.<wing>.<x>" for a lab file."""
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
# lab/ imports the four and itself, each wing only the wings below it; train.py lab and below; evaluate.py lab and
# below; lab's command line (python -m lab: lab/cli/commands.py, modes.py) everything.
LEVEL = {"data": 0, "lorentz": 0, "adapters": 0, "model": 1, **{f"lab.{f}": 2 for f in LAB}, "train": 3,
         "evaluate": 3, "lab.cli.modes": 4, "lab.cli.commands": 5}


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



def test_the_house_has_at_most_54_import_edges_between_the_six_files_and_the_wings():
    """Counted with each wing one node beside the six files: an edge is one node importing another (was 150 between
    files when lab/ was flat; 54 at 60f5ec9, before the doors and the family records: not grown since)."""
    node = lambda m: "lab." + m.split(".")[1] if m.startswith("lab.") else m
    edges = {(node(f), node(m)) for f in [*PAPER, *(f"lab.{f}" for f in LAB)]
             for m in project_imports(lab_path(f[4:]) if f.startswith("lab.") else f + ".py") if node(m) != node(f)}
    assert 30 < len(edges) <= 54, sorted(edges)

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


def test_the_scripts_reach_no_study_and_not_labs_command_line():
    """train.py and evaluate.py, through any chain of imports, reach neither lab/studies/ nor python -m lab's modes
    (lab/cli/commands.py, modes.py and the studies' flag checks, study_flags.py)."""
    for script in ("train", "evaluate"):
        path = lab_closure([m[4:] for m in project_imports(script + ".py") if m.startswith("lab.")])
        assert {f for f in path if f.startswith("studies.") or f in ("cli.commands", "cli.modes", "cli.study_flags")} \
            == set(), script


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
    commands, your own data, lmms-eval, results, the files (a table in import order, each wing a row), a Python
    example."""
    assert len(README.rstrip("\n").split("\n")) <= 165
    for command in ("python train.py && python evaluate.py", "python -m pytest tests/paper", "python -m pytest -q"):
        assert command in README, command
    mapped = {n for a, b in re.findall(r"^\| Eq (\d+)(?:-(\d+))? \|", README, flags=re.M)
              for n in range(int(a), int(b or a) + 1)}
    assert mapped == set(range(1, 20))  # Eq 1-19, each in a row of the equation map
    rows = re.findall(r"^\| `(\w+\.py|lab/\w+/|python -m lab)` \|", README, flags=re.M)  # Files, in import order
    assert {f"{f}.py" for f in PAPER} | {f"lab/{w}/" for w in WINGS} | {"python -m lab"} <= set(rows)
    row = {m: rows.index("python -m lab" if LEVEL[m] > LEVEL["evaluate"] else f"lab/{m.split('.')[1]}/"
                         if m.startswith("lab.") else m + ".py") for m in LEVEL}  # lab's command line: the last row
    assert {(m, i) for m in LEVEL for i in project_imports(lab_path(m[4:]) if m.startswith("lab.") else m + ".py")
            if row[i] > row[m]} == set()  # each file imports only files above it in the table


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
    from lab.methods import registry
    from lab.models import backbones
    from lab.run import adapter_files
    backbone = backbones.load_backbone("toy-idefics2")
    registry.attach(backbone.model, "hyper-icl", rank=4)
    for p in M.adapter_modules(backbone.model).parameters():
        torch.nn.init.normal_(p, std=0.1)
    os.makedirs(tmp_path / os.path.dirname(path))
    adapter_files.save_adapter(tmp_path / path, backbone)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = ast.literal_eval(run.stdout.strip().split("\n")[-1])
    assert isinstance(answers, list) and len(answers) == 4 and all(isinstance(a, str) for a in answers), run.stdout
