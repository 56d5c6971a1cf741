"""The suite itself (tests/conftest.py): nothing one test does to the worker's environment reaches the next, every
process runs one thread, the fast tier's mark is held (a test that starts a run and is not marked slow fails), and
every subprocess a test starts has a timeout. The tests of this file run in this order, in one worker."""

import ast
import glob
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ORIGINAL_ENVIRONMENT, ROOT, what_it_starts

from rloo_utils.errors import UsageError
from rloo_utils.vllm_colocated import start_colocated_engine

ENGINE_WRITES = ["VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"]


def test_an_in_process_engine_writes_the_workers_environment():
    """What start_colocated_engine does to os.environ before it builds the engine (here it stops at the policy's
    positions, after the writes): the values the next test must not see."""
    policy = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8))
    with pytest.raises(UsageError, match="exceeds the 8 positions"):
        start_colocated_engine(
            policy,
            torch.device("cpu"),
            model_name_or_path="tiny",
            seed=1,
            dtype="float32",
            trust_remote_code=False,
            vllm_max_model_length=None,
            max_prompt_length=64,
            max_completion_length=64,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
            enable_sleep_mode=False,
            cpu_kv_cache_gib=3,
        )
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    os.environ["RANK"] = "1"  # as rloo_multigpu.py's main() run in process does


def test_a_later_process_sees_the_environment_the_suite_started_with():
    """After the test above, in the same worker: a process started now sees the suite's own environment, one thread."""
    shown = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, os, torch; print(json.dumps([dict(os.environ), torch.get_num_threads()]))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    environment, threads = json.loads(shown.stdout)
    for name in [*ENGINE_WRITES, "RANK", "OMP_NUM_THREADS"]:
        assert environment.get(name) == ORIGINAL_ENVIRONMENT.get(name), name
    assert environment["OMP_NUM_THREADS"] == "1" and threads == 1 and torch.get_num_threads() == 1
    assert environment["VLLM_NO_USAGE_STATS"] == "1" and environment["DO_NOT_TRACK"] == "1"


@pytest.mark.parametrize(
    "command,started",
    [
        ([sys.executable, os.path.join(ROOT, "rloo.py"), "--help"], os.path.join(ROOT, "rloo.py")),
        ([sys.executable, "-m", "torch.distributed.run", "--standalone", "x.py"], "torch.distributed.run"),
        ("torchrun --nproc_per_node 2 rloo_multigpu.py", "torchrun"),
        (
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
            "vllm.entrypoints.openai.api_server",
        ),
        (["bash", "benchmark/experiments/arithmetic_cpu.sh", "--dry_run"], "benchmark/experiments/arithmetic_cpu.sh"),
        ([sys.executable, "tests/run_patched.py", "patch", "rloo.py"], "tests/run_patched.py"),
        ("cd /tmp && python3 -u /x/rloo_vllm.py --seed 1", "/x/rloo_vllm.py"),
        ([sys.executable, "-c", "print(1)"], None),
        (["bash", "-c", "sleep 60"], None),
        (["git", "status"], None),
        (["ruff", "format", "--check", "rloo.py"], None),  # a tool reading the script, not running it
    ],
)
def test_what_makes_a_command_a_run(command, started):
    assert what_it_starts(command) == started


def test_a_test_that_starts_a_run_without_the_slow_mark_fails():
    with pytest.raises(pytest.fail.Exception, match="starts .*rloo.py: mark it @pytest.mark.slow"):
        subprocess.run([sys.executable, os.path.join(ROOT, "rloo.py"), "--help"], timeout=60)


@pytest.mark.slow
def test_a_slow_test_may_start_one():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "rloo.py"), "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "--model_name_or_path" in proc.stdout


def calls_without_a_timeout(source: str) -> list[str]:
    """subprocess.run/call/check_call/check_output, and .wait()/.communicate(), called with no timeout."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        timed = any(k.arg == "timeout" for k in node.keywords)
        name = node.func.attr
        of_subprocess = isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
        if of_subprocess and name in ("run", "call", "check_call", "check_output") and not timed:
            found.append(f"line {node.lineno}: subprocess.{name}")
        if name in ("wait", "communicate") and not node.args and not timed:
            found.append(f"line {node.lineno}: .{name}()")
    return found


def test_the_timeout_check_finds_a_call_without_one():
    source = "import subprocess\nsubprocess.run(['x'])\np = subprocess.Popen(['x'])\np.wait()\np.wait(5)\n"
    assert calls_without_a_timeout(source) == ["line 2: subprocess.run", "line 4: .wait()"]


def test_every_subprocess_the_tests_start_has_a_timeout():
    """A command that hangs, or an experiment started by mistake, ends at its test's timeout, never at CI's limit."""
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "*.py"))):
        with open(path) as f:
            missing = calls_without_a_timeout(f.read())
        if missing:
            found[os.path.basename(path)] = missing
    assert not found, found
