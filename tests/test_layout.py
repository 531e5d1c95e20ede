"""The package's imports run one way (docs/design.md, Layers): serve -> runtime -> model -> parallel -> checkpoint;
`hunyuan_kernels` imports nothing of `engine`; the web UI uses only the serving client, events and
requests; nothing at run time (`engine/`, `hunyuan_kernels/`, `webui/`, `app.py`; the command line
included) imports the development tools, the trainer, the tests or the benchmarks. Imports needed only
for type hints (`if TYPE_CHECKING:`) are not imports at run time and are not counted."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["checkpoint", "parallel", "model", "runtime", "serve"]          # each may import only those before it
WEBUI_MAY_IMPORT = {"engine", "engine.serve.client", "engine.serve.server", "engine.serve.info",
                    "engine.runtime.events", "engine.runtime.request",
                    # the studio checks a reference on upload by /v1's own rules and loader (issue 29): one
                    # implementation of the limits, not a copy in the UI
                    "engine.runtime.images", "engine.serve.openai_errors", "engine.serve.openai_params",
                    # the step cache's settings are request fields; the page offers them by name (issue 27)
                    "engine.runtime.step_cache",
                    # the results a page and a link show again, and the settings each PNG carries, are the
                    # server's: one store and one record for the page and /v1 (issue 43)
                    "engine.serve.results", "engine.serve.image_meta"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file of `module`, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    me = module.split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
    return out


def _files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "engine" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def _run_time() -> dict[Path, str]:
    """Every file of the run time and its module name."""
    return {p: _module_name(p) for p in _files("engine", "hunyuan_kernels", "webui") + [ROOT / "app.py"]}


def _violations(files: dict[Path, str] | None = None) -> list[str]:
    """What breaks the rules in `files` (file -> module name; default: the whole run time)."""
    bad = []
    for path, me in (files or _run_time()).items():
        for line, mod in _imports(path, me):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} imports {mod}"
            top = mod.split(".")[0]
            if top in ("tools", "train", "tests", "bench"):
                bad.append(where + " (a development tool at run time)")
            if me.split(".")[0] == "hunyuan_kernels" and top in ("engine", "webui"):
                bad.append(where + " (kernels import nothing of the engine)")
            if me.startswith("engine"):
                if top == "webui":
                    bad.append(where + " (the engine never imports the UI)")
                mine, theirs = _layer(me), _layer(mod)
                if mine is not None and theirs is not None and theirs > mine:
                    bad.append(where + f" (engine.{LAYERS[mine]} may not import engine.{LAYERS[theirs]})")
                if me == "engine" and theirs is not None:
                    bad.append(where + " (the root package holds constants only)")
            if me.startswith("webui") and top == "engine" and mod not in WEBUI_MAY_IMPORT:
                bad.append(where + " (the UI uses only the serving client, events and requests)")
    return bad


def test_imports_run_one_way():
    assert _violations() == []


def test_the_check_sees_a_wrong_way_import(tmp_path):
    """The walker must catch an import against the arrows (a test that cannot fail is a defect). The probe
    lies outside the tree, read as a module of engine.checkpoint: in the tree, the tests that walk it on another
    worker (pytest -n) would meet it, or lose it between listing and reading it."""
    assert ROOT / "engine" / "checkpoint" / "__init__.py" in _run_time()
    bad = tmp_path / "_wrong_way_probe.py"
    bad.write_text("from engine.runtime.engine import Engine\nfrom ..serve import server\n")
    found = [v for v in _violations({bad: "engine.checkpoint._wrong_way_probe"}) if "_wrong_way_probe" in v]
    assert len(found) == 2 and "may not import engine.runtime" in found[0] and "engine.serve" in found[1]


@pytest.mark.parametrize("module", ["app", "engine.__main__", "engine.model.weights", "hunyuan_kernels.registry",
                                    "webui.studio"])
def test_the_check_sees_a_tool_imported_at_run_time(module, tmp_path):
    """tools or train imported by a run-time module, even lazily inside a function, is reported; the command
    line and the studio's entry point have no exemption (both once imported the tiny-checkpoint maker)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def make():\n    from tools.tiny import make_tiny\n    import train.train\n")
    found = _violations({probe: module})
    assert [v.removeprefix(f"{probe}:") for v in found] == [
        "2 imports tools.tiny (a development tool at run time)", "3 imports train.train (a development tool at run time)"]


@pytest.mark.parametrize("package", ["engine.checkpoint", "engine.parallel", "engine.model", "engine.runtime",
                                     "engine.serve", "hunyuan_kernels", "tools"])
def test_each_sub_package_says_what_lives_there(package):
    doc = ast.get_docstring(ast.parse((ROOT / package.replace(".", "/") / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 12, f"{package} needs a docstring saying what lives there and what it may import"


# ------------------------------------------------------------------------------------------- kernels

# hunyuan_kernels/ in levels: a module imports only its own level and those before it (no back-arrows)
KERNEL_LEVELS = [
    {"hunyuan_kernels.registry", "hunyuan_kernels._triton", "hunyuan_kernels._flashinfer",
     "hunyuan_kernels.scratch"},                                                   # the machinery
    {"hunyuan_kernels.norm", "hunyuan_kernels.rope", "hunyuan_kernels.decode_attention",
     "hunyuan_kernels.sampling", "hunyuan_kernels.vae", "hunyuan_kernels.moe",
     "hunyuan_kernels.lora"},                                                      # op families
    {"hunyuan_kernels.quant"},                                                     # uses the moe family
    {"hunyuan_kernels"},                                                           # the package: registers all
]


def _kernel_modules() -> set[str]:
    return {_module_name(p) for p in _files("hunyuan_kernels")}


def _module_imports(path: Path, modules: set[str], name: str | None = None) -> set[str]:
    """The modules of `modules` that `path` (module `name`, default: its place in the tree) imports
    (anywhere in it: function bodies and `if TYPE_CHECKING:` blocks too), `from pkg import mod` resolved
    to the module."""
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    name = name or _module_name(path)
    me = name.split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level else (node.module or ""))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
            out |= subs if subs else ({base} if base in modules else set())
    # a module's own packages are initialised before it runs: importing from them is no circle
    return out - {".".join(me[:i]) for i in range(1, len(me) + 1)}


def _kernel_level(module: str) -> int:
    for i, level in enumerate(KERNEL_LEVELS):
        if any(module == m or module.startswith(m + ".") for m in level if m != "hunyuan_kernels"):
            return i
    return len(KERNEL_LEVELS) - 1


def _kernel_graph() -> dict[str, set[str]]:
    modules = _kernel_modules()
    return {_module_name(p): _module_imports(p, modules) for p in _files("hunyuan_kernels")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None
    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_kernels_import_without_circles_or_back_arrows():
    graph = _kernel_graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    back = [f"{a} imports {b}" for a, bs in graph.items() for b in bs if _kernel_level(b) > _kernel_level(a)]
    assert back == []


def test_the_kernel_check_sees_a_circle_and_a_back_arrow(tmp_path):
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _kernel_level("hunyuan_kernels.moe.cuda") < _kernel_level("hunyuan_kernels.quant.moe")
    assert "hunyuan_kernels.quant.formats" in _kernel_graph()["hunyuan_kernels.quant.moe"]
    probe = tmp_path / "_back_arrow_probe.py"    # outside the tree: test_the_check_sees_a_wrong_way_import
    probe.write_text("from ..quant import formats\n")
    assert "hunyuan_kernels.quant.formats" in _module_imports(probe, _kernel_modules(),
                                                              "hunyuan_kernels.moe._back_arrow_probe")


def _kernel_aliases(tree: ast.AST) -> set[str]:
    """Names bound to a kernels module by this file's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "hunyuan_kernels"}
        elif (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hunyuan_kernels"
              and not node.level):
            names |= {a.asname or a.name for a in node.names if a.name.islower()}
    return names


def _assigned_kernel_globals() -> list[str]:
    """`mod.NAME = ...` (or monkeypatch.setattr(mod, "NAME", ...)) on a kernels module, outside hunyuan_kernels/:
    a switch flipped from outside. Spies on functions (lower-case names) in tests are not switches."""
    bad = []
    for path in _files("engine", "webui", "bench", "tools", "tests", "train") + [ROOT / "app.py"]:
        tree = ast.parse(path.read_text(), str(path))
        aliases = _kernel_aliases(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AugAssign) else []
            for t in targets:
                base = t
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    base = base.value
                if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(base, ast.Name) and base.id in aliases:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {ast.unparse(t)}")
            if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("setattr", "setitem"))
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases
                    and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).isupper()):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} sets {node.args[0].id}.{node.args[1].value}")
    return bad


def test_no_kernels_switch_is_flipped_from_outside():
    assert _assigned_kernel_globals() == []
