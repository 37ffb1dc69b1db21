"""Every complete ```python snippet in docs/ (one that imports fsdpfn and builds a mesh) runs at world 1 and 2."""

import pathlib
import re
import sys
import types

import pytest

from fsdpfn.testing import spmd, torch_version

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
SNIPPETS = [
    (p.name, i, code)
    for p in sorted(DOCS.glob("*.md"))
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))
    if "fsdpfn.init_mesh(" in code and "import fsdpfn" in code  # complete, runnable snippets
]


def _run(code):
    # a real module, as a user's script is one: torch 2.11's dynamo imports the module of what it traces
    module = types.ModuleType("doc_snippet")
    sys.modules["doc_snippet"] = module
    try:
        exec(compile(code, "<doc snippet>", "exec"), module.__dict__)
    finally:
        sys.modules.pop("doc_snippet", None)
    return True


def test_there_are_runnable_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name, index, code", SNIPPETS, ids=[f"{n}:{i}" for n, i, _ in SNIPPETS])
def test_doc_snippet_runs(name, index, code, world):
    if "fsdpfn.compile_step(" in code and torch_version() < (2, 13):
        pytest.skip("compile_step refuses torch < 2.13 (checked by test_traced.py::test_compile_step_refuses_where_it_is_not_verified)")
    assert spmd(world, _run, code) == [True] * world


def test_every_docstring_example_in_the_package_runs():
    # the examples in docstrings (``>>>``) of every fsdpfn module, as `pytest --doctest-modules fsdpfn` runs
    # them; examples that need a process group or a model say `# doctest: +SKIP`
    import doctest
    import importlib
    import pkgutil

    import fsdpfn

    failed = []
    for info in pkgutil.walk_packages(fsdpfn.__path__, "fsdpfn."):
        module = importlib.import_module(info.name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False, report=False)
        if result.failed:
            failed.append(f"{info.name}: {result.failed} of {result.attempted}")
    assert failed == [], failed
