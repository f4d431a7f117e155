"""The contributor tools (tools/*.py, tools/*.sh) on CPU. They run only on a GPU machine, so a name they read that a
refactor removed would otherwise break the next GPU session instead of CI. Here:
  * each tool imports on CPU without touching CUDA, keeps its work in functions (a main() behind
    `if __name__ == "__main__":`), and every attribute it reads or sets on a taesd_fast module or class, and every
    keyword it passes to a taesd_fast function, exists (checked through ast against the live package);
  * the shell tools parse (`bash -n`);
  * triton_sanitize.py has cases for exactly the kernel rows of kernels/rows.py, each inside its row's support rule
    on a pretend H200 (the rules' device queries are patched, as in test_kernel_rows_cpu.py);
  * the shared checks (tools/kernel_checks.py) flag NaN and errors over the bound, and restore the poison flags."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_kernel_rows_cpu import h200  # noqa: F401  (the pretend-H200 fixture)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
PY_TOOLS = sorted(TOOLS.glob("*.py"))
SH_TOOLS = sorted(TOOLS.glob("*.sh"))


def load_tool(path: Path) -> types.ModuleType:
    """Import tools/<name>.py as a module (not as __main__), with tools/ on sys.path as when it runs as a script."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"tools_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- names the tools read off taesd_fast


def _bindings(tree: ast.AST) -> dict[str, object]:
    """Local name -> taesd_fast module / object, for every import of taesd_fast anywhere in the file."""
    names: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "taesd_fast":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    names[alias.asname or alias.name] = getattr(module, alias.name)
                else:  # a submodule not imported by its package yet; ImportError if it does not exist either
                    names[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "taesd_fast":
                    module = importlib.import_module(alias.name)
                    names[alias.asname or "taesd_fast"] = module if alias.asname else importlib.import_module(
                        "taesd_fast")
    return names


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """`a.b.c` -> ("a", ["b", "c"]); None where the chain does not start at a plain name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def _resolve(obj: object, attrs: list[str], where: str, problems: list[str]) -> object | None:
    """Follow attrs from obj while it is a module or a class; record a problem for the first missing one."""
    for attr in attrs:
        if not isinstance(obj, (types.ModuleType, type)):
            return None  # an instance or function: its attributes are not checked
        if not hasattr(obj, attr) and isinstance(obj, types.ModuleType):
            try:
                importlib.import_module(f"{obj.__name__}.{attr}")
            except ImportError:
                pass
        if not hasattr(obj, attr):
            problems.append(f"{where}: {getattr(obj, '__name__', obj)} has no attribute {attr!r}")
            return None
        obj = getattr(obj, attr)
    return obj


def stale_names(path: Path) -> list[str]:
    """Every attribute of a taesd_fast module or class that the file reads or sets but that does not exist, and
    every keyword it passes to a taesd_fast function that the function does not take."""
    tree = ast.parse(path.read_text(), str(path))
    names = _bindings(tree)
    problems: list[str] = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):  # a.b.c is visited as a.b.c and a.b: the same problem once
            chain = _chain(node)
            if chain and chain[0] in names:
                _resolve(names[chain[0]], chain[1], where, problems)
        if isinstance(node, ast.Call) and node.keywords:
            func = node.func
            target = None
            if isinstance(func, ast.Name) and func.id in names:
                target = names[func.id]
            elif isinstance(func, ast.Attribute) and (chain := _chain(func)) and chain[0] in names:
                target = _resolve(names[chain[0]], chain[1], where, [])
            if target is None or not callable(target):
                continue
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):  # a builtin or op without a Python signature
                continue
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                continue
            for kw in node.keywords:
                if kw.arg is not None and kw.arg not in params:
                    problems.append(f"{where}: {getattr(target, '__qualname__', target)}() takes no keyword "
                                    f"{kw.arg!r}")
    return list(dict.fromkeys(problems))


@pytest.mark.parametrize("path", PY_TOOLS, ids=[p.name for p in PY_TOOLS])
def test_tool_reads_only_names_that_exist(path):
    problems = stale_names(path)
    assert not problems, "\n".join(problems)


def test_the_name_check_catches_a_removed_name(tmp_path):
    """The checker itself: names removed in the kernel redesign (and a setter of one) are reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("from taesd_fast.kernels import triton_conv as tc, gluon_conv_rows\nimport taesd_fast.timing\n"
                     "tc.POISON_OUTPUT = True\nx = gluon_conv_rows._rows_per_program\n"
                     "tc.conv3x3_tc_launch(1, 2, 3, 4, 5, 6, config=None, out=None)\n"
                     "tc.TCConfig(64, tile_w=16)\ntaesd_fast.timing.no_such_function()\n")
    problems = "\n".join(stale_names(probe))
    for missing in ("POISON_OUTPUT", "_rows_per_program", "'out'", "'tile_w'", "no_such_function"):
        assert missing in problems, f"{missing} not reported:\n{problems}"
    assert "'config'" not in problems  # conv3x3_tc_launch still takes a config


# --------------------------------------------------------------------------- importable, no work at import


def _top_level_work(tree: ast.Module) -> list[str]:
    """Module-level statements that do work: anything but imports, definitions, assignments, the docstring,
    sys.path.insert(...) and the `if __name__ == "__main__":` guard."""
    work = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == \
                "sys.path.insert":
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"'):
            continue
        work.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return work


@pytest.mark.parametrize("path", PY_TOOLS, ids=[p.name for p in PY_TOOLS])
def test_tool_imports_on_cpu_without_doing_work(path):
    tree = ast.parse(path.read_text(), str(path))
    assert not _top_level_work(tree), f"{path.name} does work at import: {_top_level_work(tree)}"
    helper = path.name == "kernel_checks.py"  # the tools' shared module has no main
    module = load_tool(path)
    assert helper or callable(getattr(module, "main", None)), f"{path.name} has no main()"
    assert not torch.cuda.is_initialized(), f"importing {path.name} initialised CUDA"


@pytest.mark.parametrize("path", SH_TOOLS, ids=[p.name for p in SH_TOOLS])
def test_shell_tool_parses(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- triton_sanitize's cases


def test_sanitizer_cases_cover_exactly_the_kernel_rows():
    from taesd_fast.kernels import rows

    sanitize = load_tool(TOOLS / "triton_sanitize.py")
    assert set(sanitize.CASES) == {(r.kind, r.name) for r in rows.KERNEL_ROWS}
    assert all(sanitize.CASES.values()), "every row needs at least one case"


def test_sanitizer_cases_are_inside_their_rows_rules_on_an_h200(h200):  # noqa: F811
    from taesd_fast.dispatch import table

    sanitize = load_tool(TOOLS / "triton_sanitize.py")
    refused = []
    for (kind, name), cases in sanitize.CASES.items():
        row = table.row(kind, name)
        for case in cases:
            spec = sanitize.case_spec(kind, name, case)
            why = row.supports(spec)
            if why is not None:
                refused.append(f"{name} {sanitize.describe(spec)}: {why}")
    assert not refused, "\n".join(refused)


# --------------------------------------------------------------------------- the shared checks


def test_kernel_checks_flag_nan_and_errors_over_the_bound():
    checks = load_tool(TOOLS / "kernel_checks.py")
    ref = torch.randn(3, 4, 5, dtype=torch.float64)
    assert checks.rel_err(ref.clone(), ref) == 0.0
    noisy = ref * (1 + 1e-3 * torch.randn_like(ref))
    err = checks.rel_err(noisy, ref)
    assert abs(err - ((noisy - ref).norm() / ref.norm()).item()) < 1e-12
    assert checks.verdict(noisy, ref, torch_err=err)[1] == "ok"  # within 2x
    assert checks.verdict(noisy, ref, torch_err=err / 3)[1] == "ERR>2x"
    poisoned = noisy.clone()
    poisoned[1, 2, 3] = float("nan")
    assert checks.verdict(poisoned, ref, torch_err=1.0)[1] == "NaN"


def test_poisoned_sets_every_flag_and_restores_it():
    checks = load_tool(TOOLS / "kernel_checks.py")
    before = [getattr(m, name) for m, name in checks.POISON_FLAGS]
    with checks.poisoned():
        assert all(getattr(m, name) is True for m, name in checks.POISON_FLAGS)
    assert [getattr(m, name) for m, name in checks.POISON_FLAGS] == before
    for module, name in checks.POISON_FLAGS:  # each flag is one the kernels read
        assert name in inspect.getsource(module).split(f"{name} = ", 1)[1], f"{module.__name__}.{name} is never read"


def test_sanitizer_arguments_match_the_spec_the_rule_was_asked():
    """The random arguments of each case are the call its Spec describes (shapes, layout, optional operands), as
    the dispatcher would key it: the rule was asked about the call that runs."""
    from taesd_fast.dispatch.spec import call_key, spec_of

    sanitize = load_tool(TOOLS / "triton_sanitize.py")
    for (kind, name), cases in sanitize.CASES.items():
        for case in cases:
            spec = sanitize.case_spec(kind, name, case, device="cpu")
            args = sanitize.make_args(spec, 0, "cpu")
            if kind == "conv2d":
                x, w, b, stride, residual, relu, upsample, pre_clamp = args
                key = call_key(kind, x, w, b, stride, residual, relu, upsample, pre_clamp)
            elif kind == "mem_conv":
                x, memory, w, b, frames, relu = args
                key = call_key(kind, x, w, b, 1, memory, relu, frames=frames)
            elif kind == "head":
                key = call_key(kind, *args, 1, None, False)
            else:
                x, cache, _gamma, w, b, _eps, patch = args
                key = call_key(kind, x, w, b, 1, cache, False, patch=patch)
            assert spec_of(key) == spec, f"{name} {sanitize.describe(spec)}"


def test_compile_check_compiles_the_triton_rows_for_hopper_without_a_gpu():
    """tools/compile_check.py on this CPU-only machine: the Triton conv rows go through Triton's whole pipeline for
    sm_90 (ptxas included) and report their shared memory; a row that does not compile would exit 1."""
    proc = subprocess.run([sys.executable, str(TOOLS / "compile_check.py"), "--rows", "triton_conv,triton_conv_tma"],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(TOOLS.parent)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [ln.split() for ln in lines[:2]] == [["triton_conv", "ok"], ["triton_conv_tma", "ok"]], proc.stdout
    assert any("_conv3x3_tc_tma_kernel" in ln and "shared" in ln for ln in lines), proc.stdout


def test_row_errors_names_the_call_with_one_wrong_element(monkeypatch, capsys):
    """tools/row_errors.py on the CPU: with one element of every 256-channel conv's output (memory-block convs
    included) pushed off, exactly those calls head its list, at that element; the PyTorch calls around them show no
    error (fp32 on the CPU)."""
    tool = load_tool(TOOLS / "row_errors.py")
    from taesd_fast.dispatch import calls

    real = calls._choose

    def choose(key, args, layer):
        run = real(key, args, layer)

        def wrong(*a):
            out = run(*a).clone()
            if key[0] in ("conv2d", "mem_conv") and out.shape[1] == 256:
                out[0, 5, 1, 2] += 0.5
            return out
        return wrong

    monkeypatch.setattr(calls, "_choose", choose)
    assert tool.main(["--device", "cpu", "--latents", "2", "--height", "2", "--width", "3", "--top", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split(" | ") for ln in lines[2:] if ln.count(" | ") == 7]
    off = [r for r in rows if float(r[1]) > 0]
    assert off and all(r[6].split(", ")[1] == "256" and r[7] == "(0, 5, 1, 2)" for r in off), lines
    assert len(off) == sum(r[6].split(", ")[1] == "256" for r in rows), lines
    assert abs(float(off[0][1]) - 0.5) < 1e-3, off[0]


def test_step_swaps_makes_one_variant_per_graph_decision_swap_within_the_slack():
    from taesd_fast import dispatch

    swaps = load_tool(TOOLS / "step_swaps.py")
    spec = dispatch.Spec("conv2d", "cuda:0", (1, 128, 80, 128), (128, 128, 3, 3), torch.float16, 1, True, False, True,
                         "channels_last")
    ms = {"torch": 16e-3, "triton_conv_tma": 9e-3, "cuda_conv_tiles": 9.5e-3, "triton_conv": 10.5e-3}
    rec = dispatch.decide.Record(spec, "triton_conv_tma", "t", ms, {}, None)
    base = {("auto", True, "graph"): rec, ("auto", False, "eager"): rec}
    out = swaps.variants(base, 0.12)
    assert list(out)[0] == "tuner's decisions" and out["tuner's decisions"] is base
    assert len(out) == 2  # cuda_conv_tiles (5.6% slower alone); not triton_conv (16.7%), torch or the eager call
    swapped = list(out.values())[1]
    assert swapped[("auto", True, "graph")].choice == "cuda_conv_tiles" and swapped[("auto", False, "eager")] is rec

