"""The package's import graph, read from the source (ast; nothing is imported): no cycle, and layers that read top
to bottom (LAYERS): apps -> the package's public names -> models -> graphs -> dispatch -> kernels -> _backend ->
leaves. A module-level cycle makes the import order decide which names exist when, and it is how a helper module ends
up importing half the package. Imports inside functions run later, at call time: they are how a module reaches an
optional or slow dependency (Triton) on first use; they count for the layers and the cycles all the same."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "taesd_fast"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(node: ast.ImportFrom | ast.Import, current: str, is_package: bool, known: set[str]) -> list[str]:
    """The package modules an import statement names: `from X import name` counts X.name where that is a module,
    else X. (Parent packages, which Python loads first, are left out: every module would otherwise import its
    package's __init__.)"""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if node.level:
        base = current.split(".") if is_package else current.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    found = {f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names}
    return sorted(found & known)


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level edges, function-level edges): module -> the package modules it imports."""
    mods = _modules()
    known = set(mods)
    top: dict[str, set[str]] = {m: set() for m in mods}
    inner: dict[str, set[str]] = {m: set() for m in mods}

    def visit(node: ast.AST, module: str, is_package: bool, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _resolve(child, module, is_package, known)
                (inner if in_function else top)[module].update(t for t in targets if t != module)
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, module, is_package, nested)

    for module, path in mods.items():
        visit(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py", False)
    return top, inner


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def _describe(comps: list[list[str]]) -> str:
    return "; ".join(" <-> ".join(c) for c in comps)


def test_the_graph_reader_sees_cycles_and_function_level_imports(tmp_path, monkeypatch):
    """The reader on a made-up package: a <-> b at module level is a cycle, c -> a inside a function is not."""
    pkg = tmp_path / "fakepkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("try:\n    from .a import thing\nexcept ImportError:\n    pass\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from ..a import thing\n    return thing\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    top, inner = import_graph()
    assert top["fakepkg.a"] == {"fakepkg.b"} and top["fakepkg.b"] == {"fakepkg.a"}
    assert inner["fakepkg.sub.c"] == {"fakepkg.a"} and not top["fakepkg.sub.c"]
    assert cycles(top) == [["fakepkg.a", "fakepkg.b"]]
    assert cycles(inner) == []


def test_kernels_module_level_imports_form_no_cycle():
    """The kernel layer: every kernel module imports the shared helpers (triton_import, gluon_import, device,
    tma_pdl, conv_contract, conv_epilogue, conv_pack, head_g_layout, ...), never the other way round."""
    top, inner = import_graph()
    kernels = {m: {t for t in ts if t.startswith("taesd_fast.kernels")} for m, ts in top.items()
               if m.startswith("taesd_fast.kernels")}
    assert not cycles(kernels), f"module-level import cycles in taesd_fast.kernels: {_describe(cycles(kernels))}"
    helpers = ("triton_import", "gluon_import", "device", "tma_pdl", "tma", "conv_contract", "conv_epilogue",
               "conv_pack", "head_g_layout", "head_math", "row", "derived", "conv_schedule")
    for h in helpers:
        assert not any(t.startswith("taesd_fast.kernels.triton_conv") for t in top[f"taesd_fast.kernels.{h}"]), h
    assert not top["taesd_fast.kernels.rows"] - {"taesd_fast.kernels.row"}, "rows.py must import kernels lazily"
    assert not top["taesd_fast.kernels.row"] | inner["taesd_fast.kernels.row"], "row.py is a leaf"


def _reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def test_backend_imports_only_its_leaves():
    """_backend compiles, loads and launches; every layer imports it, so it imports none of them (the dispatcher
    least of all), not even at call time: only resources and kernel_env."""
    top, inner = import_graph()
    both = {m: top[m] | inner[m] for m in top}
    reached = _reachable(both, {"taesd_fast._backend"}) - {"taesd_fast._backend"}
    assert reached == {"taesd_fast.resources", "taesd_fast.kernel_env"}, sorted(reached)


def test_dispatch_imports_no_kernel_module_at_import_time():
    """Importing the dispatcher imports, of taesd_fast.kernels, only the row registry (row, rows) and the head's
    PyTorch arithmetic (head_math): the kernel modules (and Triton, ~1 s) are reached through the rows' loaders at
    the first call that needs them."""
    top, _ = import_graph()
    dispatch = {m for m in top if m == "taesd_fast.dispatch" or m.startswith("taesd_fast.dispatch.")}
    kernels = {m for m in _reachable(top, dispatch) if m.startswith("taesd_fast.kernels.")}
    assert kernels == {"taesd_fast.kernels.row", "taesd_fast.kernels.rows", "taesd_fast.kernels.head_math"}, kernels


def test_package_imports_form_no_cycle():
    """No cycle in the whole package, counting imports inside functions too (a call-time import is still a
    dependency a reader has to follow)."""
    top, inner = import_graph()
    assert not cycles(top), f"module-level import cycles: {_describe(cycles(top))}"
    both = {m: top[m] | inner[m] for m in top}
    assert not cycles(both), f"import cycles through call-time imports: {_describe(cycles(both))}"


# The layers, top to bottom: a module imports only modules of its own layer or of the layers below it, at module
# level or at call time. A layer is a list of packages and modules (a package stands for everything in it); the
# package's __init__ (its public names) is a layer of its own, between the applications and the models, so importing
# taesd_fast never imports an application. A module in no layer fails the test: put it in one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("applications", ("taesd_fast.apps",)),
    ("public names", ("taesd_fast",)),
    ("models", ("taesd_fast.models",)),
    ("graphs", ("taesd_fast.graphs",)),
    ("dispatch", ("taesd_fast.dispatch",)),
    ("kernels", ("taesd_fast.kernels",)),
    ("backend", ("taesd_fast._backend",)),
    ("leaves", ("taesd_fast.host_memory", "taesd_fast.kernel_env", "taesd_fast.resources", "taesd_fast.timing", "taesd_fast.validation",
                "taesd_fast.value_range")),
)
# Inside models: the shared modules (models/*.py) import no model, and a model imports another only where listed
# here (AutoencoderTinyWan, TAEHV's diffusers drop-in, builds on TAESD's AutoencoderTinyFast).
MODELS = "taesd_fast.models"
MODEL_IMPORTS = {"taesd": set(), "head": set(), "taehv": {"taesd"}}


def layer_of(module: str) -> int:
    """The index in LAYERS (0 is the top) of the layer `module` belongs to."""
    for index, (_, members) in enumerate(LAYERS):
        # taesd_fast stands for its __init__ only: every module is under it
        if any(module == m or (m != "taesd_fast" and module.startswith(m + ".")) for m in members):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_import_graph.py")


def _model_of(module: str) -> str | None:
    """The model sub-package (taesd, taehv, head) `module` is in; None for the shared modules under models/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == MODELS.split(".") else None


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer, or across models where MODEL_IMPORTS does not allow it, as 'a -> b'."""
    found = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if layer_of(b) < layer_of(a):
                found.append(f"{a} -> {b} ({LAYERS[layer_of(a)][0]} imports {LAYERS[layer_of(b)][0]})")
            elif a.startswith(MODELS + ".") and b.startswith(MODELS + "."):
                ma, mb = _model_of(a), _model_of(b)
                if mb is not None and ma != mb and (ma is None or mb not in MODEL_IMPORTS[ma]):
                    found.append(f"{a} -> {b} ({'shared models code' if ma is None else ma} imports model {mb})")
    return found


def test_the_layer_check_sees_back_arrows():
    """On made-up edges: models importing apps, dispatch importing models, the package importing apps, a shared
    models module importing a model, and TAESD importing TAEHV are back arrows; the other way round they are not."""
    up = {"taesd_fast.models.taesd.model": {"taesd_fast.apps.cli", "taesd_fast.models.taehv.model"},
          "taesd_fast.dispatch.calls": {"taesd_fast.models.layers"}, "taesd_fast": {"taesd_fast.apps.media"},
          "taesd_fast.models.layers": {"taesd_fast.models.taesd.tiling"}}
    assert len(back_arrows(up)) == 5, back_arrows(up)
    down = {"taesd_fast.apps.cli": {"taesd_fast", "taesd_fast.models.taesd.model", "taesd_fast.timing"},
            "taesd_fast.models.taehv.diffusers": {"taesd_fast.models.taesd.diffusers", "taesd_fast.models.layers"},
            "taesd_fast.models.layers": {"taesd_fast.dispatch"}, "taesd_fast.graphs": {"taesd_fast.dispatch"},
            "taesd_fast.dispatch.decide": {"taesd_fast._backend", "taesd_fast.kernel_env"}}
    assert back_arrows(down) == []
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("taesd_fast.new_module")


def test_layers_read_top_to_bottom():
    """apps -> taesd_fast -> models -> graphs -> dispatch -> kernels -> _backend -> leaves: no import goes up, at
    module level or at call time, and every module is in a layer."""
    top, inner = import_graph()
    both = {m: top[m] | inner[m] for m in top}
    for m in both:
        layer_of(m)
    assert not back_arrows(both), "imports against the layers:\n" + "\n".join(back_arrows(both))


def test_importing_the_package_imports_no_application():
    """`import taesd_fast` (a fresh process) loads the models and the runtime, never taesd_fast.apps (the CLI, PyAV,
    Pillow): the layers say it from the source, this says it of the running interpreter."""
    code = "import sys, taesd_fast; print(sorted(m for m in sys.modules if m.startswith('taesd_fast.apps')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


if __name__ == "__main__":  # a report: python tests/test_import_graph.py
    top, inner = import_graph()
    print("module-level cycles:", _describe(cycles(top)) or "none")
    both = {m: top[m] | inner[m] for m in top}
    print("cycles counting function-level imports:", _describe(cycles(both)) or "none")
    print("imports against the layers:", "; ".join(back_arrows(both)) or "none")
    for m in sorted(inner):
        if inner[m]:
            print(f"  {m} imports at call time: {', '.join(sorted(inner[m]))}")


def test_numpy_is_a_core_requirement():
    """A plain install (no [media]) printed torch's 'Failed to initialize NumPy' on every command, and latents files
    need NumPy: it is declared where it is needed, in the core requirements, not only in an extra."""
    from importlib.metadata import requires

    assert "import numpy" in (PACKAGE / "apps" / "latents_io.py").read_text()  # the module that reads latents files
    core = [r for r in requires("taesd_fast") or [] if "extra ==" not in r]
    assert any(r.replace(" ", "").lower().startswith("numpy") for r in core), core
