"""The engine's house rules beyond the layers (tests/test_layout.py): no import circle anywhere in
`engine/` (every import counted: function-local ones and `if TYPE_CHECKING:` ones too, since a circle
closed by a deferred or type-only import is still two rooms that must be read together), no function
longer than MAX_LINES lines and no signature of more than MAX_PARAMS parameters (self and cls not
counted), except the ones listed below with the reason they stay."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layout import ROOT, _cycle, _files, _module_imports, _module_name

MAX_LINES = 60
MAX_PARAMS = 9

# "path:qualified name" -> why it stays long (lines) or wide (parameters)
MODULE = ("a module's shapes, one argument each as its tests build it standalone (one MoE or attention layer "
          "at the shapes of a kernel case, not a config's layer)")
LONG_FUNCTIONS: dict[str, str] = {}
WIDE_SIGNATURES = {
    "engine/model/attention.py:Attention.__init__": MODULE,
    "engine/model/moe.py:MoE.__init__": MODULE,
}


def _engine_graph(extra: dict[Path, str] | None = None) -> dict[str, set[str]]:
    """module -> the engine modules it imports (anywhere in it); `extra`: probe files and their names."""
    files = {p: _module_name(p) for p in _files("engine")} | (extra or {})
    modules = set(files.values())
    return {name: _module_imports(path, modules, name) for path, name in files.items()}


def _circles(graph: dict[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """Each group of modules that import one another (strongly connected), with one circle through it
    (a -> b -> ... -> a)."""
    reach = {}
    for n in graph:
        seen, todo = set(), [n]
        while todo:
            for m in graph.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        reach[n] = seen
    groups = {frozenset(m for m in reach[n] if n in reach[m]) for n in graph if n in reach[n]}
    return {g: _cycle({a: graph[a] & g for a in g}) for g in sorted(groups, key=sorted)}


def test_engine_imports_have_no_circle():
    circles = _circles(_engine_graph())
    assert circles == {}, "\n".join(" -> ".join(c) for c in circles.values())


def test_the_circle_check_sees_a_deferred_and_a_type_only_import(tmp_path):
    """A circle closed only by an import inside a function, or under `if TYPE_CHECKING:`, is found (a test
    that cannot fail is a defect): probes outside the tree read as modules of engine.checkpoint import a
    module that (through others) imports engine.checkpoint.config, which the probe then stands in for."""
    deferred = tmp_path / "deferred.py"
    deferred.write_text("def f():\n    from engine.model.hunyuan import HunyuanImage3\n")
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.model import hunyuan\n")
    for probe in (deferred, typed):
        graph = _engine_graph({probe: "engine.checkpoint.config"})      # the probe replaces config.py
        found = [g for g in _circles(graph) if {"engine.model.hunyuan", "engine.checkpoint.config"} <= g]
        assert found, probe.read_text()


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """("engine/x.py:Class.method", node) of every function in engine/, nested ones included."""
    out = []
    for path in _files("engine"):
        rel = path.relative_to(ROOT).as_posix()

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    walk(child, prefix + child.name + ".")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((f"{rel}:{prefix}{child.name}", child))
                    walk(child, prefix + child.name + ".")
        walk(ast.parse(path.read_text(), str(path)), "")
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len([n for n in names if n not in ("self", "cls")])


def test_engine_functions_are_short_and_narrow():
    long = {where: fn.end_lineno - fn.lineno + 1 for where, fn in _functions()
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES}
    wide = {where: _params(fn) for where, fn in _functions() if _params(fn) > MAX_PARAMS}
    assert {w: n for w, n in long.items() if w not in LONG_FUNCTIONS} == {}, f"longer than {MAX_LINES} lines"
    assert {w: n for w, n in wide.items() if w not in WIDE_SIGNATURES} == {}, f"more than {MAX_PARAMS} parameters"
    # an exception that no longer applies is dropped from the list, so that the list stays the truth
    assert set(LONG_FUNCTIONS) <= set(long) and set(WIDE_SIGNATURES) <= set(wide)


def test_the_size_check_counts_lines_and_parameters():
    fn = ast.parse("def f(self, a, b=1, *c, d, **e):\n    x = 1\n\n    return x\n").body[0]
    assert _params(fn) == 5 and fn.end_lineno - fn.lineno + 1 == 4
    assert any(where.endswith("engine/runtime/scheduler.py:Scheduler.step") for where, _ in _functions())


def test_the_code_cites_its_own_design_doc_by_section_name():
    """The code cites docs/design.md by section name ("docs/design.md, Layers"), never the founding brief's
    section numbers (they moved under the code once); every cited section exists."""
    sections = {line[3:].strip() for line in (ROOT / "docs" / "design.md").read_text().splitlines()
                if line.startswith("## ")}
    stale, missing = [], []
    for folder in ("engine", "hunyuan_kernels", "webui", "tests", "bench", "tools", "train"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            stale += [str(path.relative_to(ROOT))] * ("DESIGN " + "§" in text)
            for cited in re.findall(r"docs/design\.md, ([A-Z][\w ,]*?)[):]", text):
                if cited not in sections:
                    missing.append(f"{path.relative_to(ROOT)}: {cited!r}")
    assert not stale, f"cite docs/design.md by section name instead: {stale}"
    assert not missing, f"no such section in docs/design.md: {missing}"
