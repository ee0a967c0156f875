"""The GPU acceptance suite (`make gpu-check`, bench/gpu_check.py) checked on a CPU: its plan lists
every test that needs a GPU and every gauntlet case a GPU checks more of (a new one it missed would
go unrun on every GPU session), its parts read real pytest and gauntlet output, and where CUDA is
missing every part is reported as not run, by name."""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gauntlet import load_cases

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"
PYTEST_PARTS = ("fp8-engine", "gpu-tests")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def the_plan(*extra: str) -> dict:
    """Part name -> the part, as `bench/gpu_check.py --plan --json` prints it (and "budget_s")."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--plan", "--json", *extra], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    return {p["name"]: p for p in printed["parts"]} | {"budget_s": printed["budget_s"]}


def marks(decorators: list[ast.expr]) -> tuple[bool, bool]:
    """(marked gpu, skipped without CUDA) among a test's or a module's marks, read from the syntax."""
    gpu = cuda = False
    for node in decorators:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr == "gpu" and isinstance(sub.value, ast.Attribute) \
                    and sub.value.attr == "mark":
                gpu = True
            if isinstance(sub, ast.Call) and getattr(sub.func, "attr", "") == "skipif" and sub.args and \
                    isinstance(sub.args[0], ast.UnaryOp) and isinstance(sub.args[0].op, ast.Not) and \
                    "cuda.is_available" in ast.unparse(sub.args[0].operand):
                cuda = True
    return gpu, cuda


def needing_a_gpu() -> dict[str, list[str]]:
    """Module -> its tests marked gpu; and every test skipped without CUDA must carry the mark."""
    out, unmarked = {}, []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marks = [n.value for n in tree.body if isinstance(n, ast.Assign)
                        and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)]
        module_gpu, module_cuda = marks(module_marks)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                gpu, cuda = marks(node.decorator_list)
                if gpu or module_gpu:
                    out.setdefault(f"tests/{path.name}", []).append(node.name)
                elif cuda or module_cuda:
                    unmarked.append(f"{path.name}::{node.name}")
    assert unmarked == [], "skipped without CUDA but not marked gpu, so `make gpu-check` would not run them"
    return out


def test_the_plan_lists_every_test_module_that_needs_a_gpu():
    parts = the_plan()
    assert list(parts) == ["fp8-engine", "gauntlet", "serve", "gpu-tests", "budget_s"]
    planned = [m for name in PYTEST_PARTS for m in parts[name]["covers"]]
    assert sorted(planned) == sorted(needing_a_gpu()) and len(set(planned)) == len(planned)
    assert "tests/test_gpu_engine.py" in parts["fp8-engine"]["covers"]
    for name in PYTEST_PARTS:  # each part's pytest runs its modules, and only the tests marked gpu
        (argv,) = parts[name]["commands"]
        assert argv[argv.index("-m", 2) + 1] == "gpu" and argv[-len(parts[name]["covers"]):] == parts[name]["covers"]
    # within the 9 minutes of one device call, the parts before the last leave it time
    assert parts["budget_s"] <= 540 and sum(parts[n]["limit_s"] for n in ("fp8-engine", "gauntlet", "serve")) <= 360


def test_a_new_gpu_test_module_joins_the_plan(tmp_path):
    (tmp_path / "test_new_kernel.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpu\ndef test_it():\n    pass\n")
    (tmp_path / "test_cpu_only.py").write_text("def test_it():\n    pass\n")
    parts = the_plan("--tests", str(tmp_path))
    assert parts["gpu-tests"]["covers"] == ["tests/test_new_kernel.py"]


def test_the_plan_lists_every_gauntlet_case_a_gpu_checks_more_of():
    cases = load_cases()
    planned = the_plan()["gauntlet"]["covers"]
    assert planned == [c.name for c in cases if c.gpu_only or c.gpu]
    assert {"rmsnorm/honest_cuda_graph", "rmsnorm/side_stream", "rmsnorm/skips_work_captured"} <= set(planned)
    # a case whose note speaks of a GPU is marked as one
    spoken = [c.name for c in cases if "GPU" in c.note or "CUDA" in c.note]
    assert spoken and set(spoken) <= set(planned), set(spoken) - set(planned)


def test_gauntlet_gpu_selects_the_manifests_gpu_cases(capsys):
    from cli.main import main

    assert main(["gauntlet", "--gpu", "--op", "silu_mul"]) == 2
    assert "no gauntlet case of silu_mul is one a GPU checks more of" in capsys.readouterr().err


def test_a_part_reads_real_pytest_output_and_names_each_skip(tmp_path):
    """On a CPU the GPU tests skip: the part lists each, with pytest's reason."""
    gpu_check = load_script()
    part = gpu_check.Part("gpu-tests", "", [[sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
                                             "-m", "gpu", "tests/test_pool_health.py"]], 120)
    outcome = gpu_check.run_part(part, 120, tmp_path / "log")
    assert outcome.status == "pass" and "1 skipped" in outcome.detail, outcome
    assert outcome.items == [{"name": "tests/test_pool_health.py::"
                                      "test_a_candidate_printing_a_gpu_error_on_a_healthy_gpu_is_its_own_crash",
                              "status": "skipped", "detail": "needs a CUDA GPU"}]
    late = gpu_check.run_part(gpu_check.Part("gpu-tests", "", [[sys.executable, "-c", "import time; time.sleep(60)"]],
                                             2), 2, tmp_path / "late")
    assert late.status == "timeout" and late.detail == "stopped at its limit of 2 s" and late.seconds < 30


def test_the_gauntlet_part_reads_the_commands_rows(tracking_home, tmp_path):
    gpu_check = load_script()
    cases = ["rmsnorm/patches_timer_hidden", "rmsnorm/skips_work_captured"]
    part = gpu_check.Part("gauntlet", "", [[sys.executable, "-m", "cli", "gauntlet", "--gpu", "--op", "rmsnorm",
                                            "--case", "patches_timer_hidden", "--case", "skips_work_captured"]],
                          240, cases)
    outcome = gpu_check.run_part(part, 240, tmp_path / "log")
    # on a CPU slot the GPU-only case is not run, and the part says so by name
    assert outcome.status == "fail", outcome
    assert outcome.items == [
        {"name": "rmsnorm/patches_timer_hidden", "status": "pass",
         "detail": "expected fail timer_integrity, got fail timer_integrity"},
        {"name": "rmsnorm/skips_work_captured", "status": "not run", "detail": "not in the command's output"}]


@pytest.mark.skipif(sys.platform != "linux", reason="the suite runs on Linux hosts")
def test_without_cuda_every_part_is_reported_as_not_run(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHONPATH": str(ROOT),
                               "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1, done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["verdict"] == "fail" and report["environment"]["cuda_available"] is False
    assert [(p["part"], p["status"], p["detail"]) for p in report["parts"]] == [
        (name, "not run", "CUDA is not available here") for name in ("fp8-engine", "gauntlet", "serve", "gpu-tests")]
    md = (tmp_path / "gpu-check.md").read_text()
    assert md.startswith("# GPU acceptance: fail") and "| serve | not run |" in md and "torch " in md
