"""The checkout's layout: the installed library (ds_acco/) never reaches into the benchmarks or the
tests, and tests/ mirrors the library, each rank worker beside the tests that spawn it."""
import ast
import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
_OUTSIDE = re.compile(r"^(benchmarks|tests)(\.|$)")  # packages of the checkout that the wheel leaves out


def library_reaches_outside(root: Path = ROOT / "ds_acco") -> list:
    """``file:line name`` (file relative to ``root``) for every import of, or module path string naming,
    benchmarks/ or tests/ in the modules under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else []
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # importlib.import_module("benchmarks.x"), runpy, find_spec ...
            else:
                continue
            found += [(str(path.relative_to(root)), node.lineno, n) for n in names if _OUTSIDE.match(n)]
    return [f"{f}:{line} {n}" for f, line, n in sorted(found)]


def test_the_library_never_imports_the_benchmarks_or_the_tests():
    assert library_reaches_outside() == []


def test_the_check_finds_an_import_and_a_module_string(tmp_path):
    (tmp_path / "a.py").write_text("import os\nfrom benchmarks import gpt\nfrom . import tests\n")
    (tmp_path / "b.py").write_text("import importlib\nimportlib.import_module('benchmarks.worker')\nX = 'bench'\n"
                                   "import tests.dist\n")
    assert library_reaches_outside(tmp_path) == ["a.py:2 benchmarks", "b.py:2 benchmarks.worker", "b.py:4 tests.dist"]


def _worker_dirs() -> list:
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    return [ROOT / p for p in ini["pytest"]["pythonpath"].split()]


def test_workers_sit_beside_their_tests_on_the_suites_path():
    loose = sorted(p.name for p in TESTS.glob("*workers.py"))
    assert loose == [], f"rank workers at the root of tests/: {loose}; move each beside the tests that spawn it"
    on_path = set(_worker_dirs())
    assert all(d.is_dir() for d in on_path), sorted(map(str, on_path))
    # run_ranks pickles a worker function by module name: its folder must be on every rank's sys.path.
    stray = sorted(str(p.relative_to(ROOT)) for p in TESTS.rglob("*workers.py") if p.parent not in on_path)
    assert stray == [], f"workers in folders pytest.ini's pythonpath does not list: {stray}"


def test_every_benchmark_and_test_double_file_is_one_concern_under_400_lines():
    # One concern per file, named in the docstring's first line (issue 35); the rest of the library is
    # checked by the layering tests.
    found = {}
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "ds_acco" / "testing").glob("*.py")]):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text))
        if len(text.splitlines()) >= 400 or not doc:
            found[path.name] = (len(text.splitlines()), (doc or "no docstring").splitlines()[0])
    assert found == {}
