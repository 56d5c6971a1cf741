"""The suite itself (tests/conftest.py): nothing one test does to the worker's environment reaches the next, every
process runs one thread, the fast tier's mark is held (a test that starts a run and is not marked slow fails), every
test ends within its timeout (killing what it started), and every wait in tests/ has its bound. Each test holds its
value alone, in any order: what needs two tests in a row runs them in a pytest session of its own."""

import ast
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, what_it_starts

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


def run_a_session(tmp_path, source: str) -> subprocess.CompletedProcess:
    """`source` as a test file run by a pytest of its own, with tests/conftest.py as its plugin (the suite's hooks and
    timeout) and nothing of this session: its tests in their file order (a shuffling plugin off), in one process."""
    (tmp_path / "test_session.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "test_session.py", "-q", "-p", "conftest"]
        + ["-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:random_order"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# Two tests in a row: the first writes what an in-process engine (the test above) and rloo_multigpu.py's main() write,
# the second starts a process
AFTER_A_TEST_THAT_WROTE_THE_ENVIRONMENT = """
import json, os, subprocess, sys
import torch
from conftest import ORIGINAL_ENVIRONMENT

WRITTEN = {written}
wrote = []


def test_writes_the_environment():
    os.environ.update(WRITTEN)
    torch.set_num_threads(2)
    wrote.append(True)


def test_starts_a_process_after_it():
    assert wrote  # in the same process, after it
    show = "import json, os, torch; print(json.dumps([dict(os.environ), torch.get_num_threads()]))"
    shown = subprocess.run(
        [sys.executable, "-c", show],
        capture_output=True,
        text=True,
        timeout=120,
    )
    environment, threads = json.loads(shown.stdout)
    for name in WRITTEN:
        assert environment.get(name) == ORIGINAL_ENVIRONMENT.get(name), name
    assert environment["OMP_NUM_THREADS"] == "1" and threads == 1 and torch.get_num_threads() == 1
    assert environment["VLLM_NO_USAGE_STATS"] == "1" and environment["DO_NOT_TRACK"] == "1"
"""


def test_a_process_started_after_a_test_that_wrote_the_environment_sees_the_suites_own(tmp_path):
    """The environment and torch's threads are put back after each test: a process the next test starts (torchrun's
    too) sees none of the engine's VLLM_*, RANK or OMP_NUM_THREADS, and runs one thread."""
    written = {**{name: "written" for name in ENGINE_WRITES}, "RANK": "1", "OMP_NUM_THREADS": "2"}
    session = run_a_session(tmp_path, AFTER_A_TEST_THAT_WROTE_THE_ENVIRONMENT.format(written=repr(written)))
    assert session.returncode == 0 and "2 passed" in session.stdout, session.stdout[-3000:] + session.stderr[-3000:]


def test_a_test_runs_under_the_suites_timeout_by_signal(request):
    """tests/conftest.py's default, 600 s (docs/tests.md), armed around this test by pytest-timeout's signal method:
    SIGALRM in this process's main thread, where xdist's workers run their tests (else it would take a thread)."""
    given = [a for a in request.config.invocation_params.args if str(a).startswith("--timeout")]
    if given or "PYTEST_TIMEOUT" in os.environ:
        pytest.skip("this session was given its own timeout")
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 540 < left <= 600
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGALRM).__module__ == "pytest_timeout"


@pytest.mark.timeout(1234)
def test_a_mark_gives_a_test_a_timeout_of_its_own():
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 1174 < left <= 1234


def test_processes_are_joined_within_their_bound_and_none_is_left_running():
    """conftest.join_processes, for torch.multiprocessing.start_processes (whose own join waits for ever): processes
    that hang fail the test at the bound, killed; one that fails is raised, with its error."""
    import torch.multiprocessing as mp
    from torch.multiprocessing import ProcessRaisedException

    from conftest import join_processes

    def hang(index):
        time.sleep(600)

    def fail(index):
        raise RuntimeError(f"process {index} failed")

    hung = mp.start_processes(hang, nprocs=2, start_method="fork", join=False)  # (fork: a local function)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not end within 1 s"):
        join_processes(hung, 1)
    assert time.monotonic() - start < 30 and not any(process.is_alive() for process in hung.processes)
    with pytest.raises(ProcessRaisedException, match="process 0 failed"):
        join_processes(mp.start_processes(fail, nprocs=1, start_method="fork", join=False), 60)


# A test that hangs in a wait without a bound, a process of its own started: the next test must still run
A_HUNG_TEST = """
import os, signal, subprocess, sys, threading
import pytest


@pytest.mark.timeout(2)
def test_hangs():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open("child.pid", "w") as f:
        f.write(str(child.pid))
    try:
        threading.Event().wait()  # a deadlock
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=60)


def test_after_it():
    pass
"""


def test_a_hung_test_fails_at_its_timeout_its_process_killed_and_the_next_runs(tmp_path):
    """The signal method (tests/conftest.py): the timeout raises in the test, whose `finally` kills what it started;
    the session goes on. (The thread method's os._exit would leave the child running and end the session there.)"""
    start = time.monotonic()
    session = run_a_session(tmp_path, A_HUNG_TEST)
    child = int((tmp_path / "child.pid").read_text())
    try:
        assert session.returncode == 1 and "1 failed, 1 passed" in session.stdout, session.stdout[-3000:]
        assert "Timeout (>2.0s) from pytest-timeout" in session.stdout and time.monotonic() - start < 120
        assert not os.path.exists(f"/proc/{child}"), "the hung test's process runs on"
    finally:
        if os.path.exists(f"/proc/{child}"):
            os.kill(child, signal.SIGKILL)


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


# Each call that waits (on a process, a thread, a queue, a pipe, a socket) and the positional argument that bounds it
# where a `timeout` keyword does not (None: the keyword only). A bound of None is none.
BOUNDED_BY = {
    "wait": 0,  # Popen, Event, Barrier, Condition
    "join": 0,  # Thread, Process, torch's ProcessContext (a str's join has an argument: never flagged)
    "result": 0,  # Future
    "communicate": 1,  # (input, timeout)
    "acquire": 1,  # Lock (blocking, timeout); blocking False waits not
    "get": 1,  # Queue (block, timeout); block False waits not. A dict's .get(key) is taken for one: not flagged
    "urlopen": 2,  # (url, data, timeout)
    "create_connection": 1,  # socket's (address, timeout)
    "HTTPConnection": 2,  # (host, port, timeout)
    "HTTPSConnection": 2,
    "RolloutQueue": 3,  # (max_staleness, num_updates, generate, timeout): its take() and before_push() wait
}
SUBPROCESS_WAITS = {"run", "call", "check_call", "check_output"}  # subprocess's: the keyword only
PIPE_READS = {"read", "readline", "readlines"}  # a child's .stdout/.stderr: no bound (communicate, conftest.first_line)
SOCKET_WAITS = {"accept", "recv", "recv_into", "recvfrom", "connect"}  # bounded by the socket's settimeout()
NEVER_WAIT = {"acquire": ("blocking", 0), "get": ("block", 0)}  # the argument that, False, makes the call not wait
CALLED_BY_NAME = {"urlopen", "create_connection", "HTTPConnection", "HTTPSConnection", "RolloutQueue"}  # else methods

# Waits bounded otherwise, each with its reason: (file, function, call) -> why. Each must still be found (no stale one).
EXEMPT = {}  # (file, function, call): why that wait is bounded otherwise


def unbounded_waits(source: str) -> list[tuple[str, int, str]]:
    """(the function it is in, its line, the call) of each call in source that may wait for ever: subprocess.run, call,
    check_call, check_output, a RolloutQueue, and each call of BOUNDED_BY without its bound (a queue's .get() and
    .get(block=True); not .get(x), which is a dict's as often); torch.multiprocessing's start_processes and spawn but
    with join=False (then conftest.join_processes); a read of a child's .stdout or .stderr; a socket's accept, recv or
    connect in a function that calls no settimeout()."""

    def given(node: ast.Call, keyword: str, index) -> list:
        values = [k.value for k in node.keywords if k.arg == keyword]
        return values + ([node.args[index]] if index is not None and len(node.args) > index else [])

    def constant(values: list, value) -> bool:
        return any(isinstance(v, ast.Constant) and v.value is value for v in values)

    def unbounded(node: ast.Call, name: str, receiver, sets_a_timeout: bool) -> bool:
        if name in SUBPROCESS_WAITS:
            return isinstance(receiver, ast.Name) and receiver.id == "subprocess" and not given(node, "timeout", None)
        if name in ("start_processes", "spawn"):  # (fn, args, nprocs, join)
            return not constant(given(node, "join", 3), False)
        if name in PIPE_READS:
            return isinstance(receiver, ast.Attribute) and receiver.attr in ("stdout", "stderr")
        if name in SOCKET_WAITS:
            return not sets_a_timeout
        if name not in BOUNDED_BY or (receiver is None and name not in CALLED_BY_NAME):
            return False
        if name == "get" and node.args and not node.keywords:
            return False
        bounds = given(node, "timeout", BOUNDED_BY[name])
        if name in NEVER_WAIT and constant(given(node, *NEVER_WAIT[name]), False):
            return False
        return not bounds or constant(bounds, None)

    found = []

    class Visitor(ast.NodeVisitor):
        functions = [("<module>", False)]

        def visit_FunctionDef(self, node):
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            self.functions.append((node.name, any(n.func.attr == "settimeout" for n in calls)))
            self.generic_visit(node)
            self.functions.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            receiver = func.value if isinstance(func, ast.Attribute) else None
            function, sets_a_timeout = self.functions[-1]
            if name and unbounded(node, name, receiver, sets_a_timeout):
                found.append((function, node.lineno, ast.unparse(func)))
            self.generic_visit(node)

    Visitor().visit(ast.parse(source))
    return found


PLANTED = """
import queue, socket, subprocess, threading, urllib.request
from urllib.request import urlopen
import torch.multiprocessing as mp
from rloo_utils.rollout_queue import RolloutQueue


def planted(proc, thread, q, lock, future, event, url, conn):
    subprocess.run(["x"])
    subprocess.run(["x"], timeout=5)
    proc.wait()
    proc.wait(5)
    proc.wait(timeout=None)
    proc.communicate(b"input")
    proc.communicate(b"input", 5)
    proc.stdout.readline()
    proc.stderr.read()
    thread.join()
    thread.join(timeout=5)
    ", ".join(["a", "b"])
    q.get()
    q.get(block=True)
    q.get(timeout=5)
    q.get(False)
    {}.get("key")
    lock.acquire()
    lock.acquire(blocking=False)
    future.result()
    event.wait()
    event.wait(5)
    urllib.request.urlopen(url)
    urllib.request.urlopen(url, None, 5)
    socket.create_connection(("127.0.0.1", 1))
    conn.recv(1024)
    mp.start_processes(planted, nprocs=2)
    mp.start_processes(planted, nprocs=2, join=False)
    RolloutQueue(1, 3, planted)
    RolloutQueue(1, 3, planted, timeout=60)
    urlopen(url)
    wait = event.wait
    wait()  # (a name, not the method: not known)


def bounded_socket(conn):
    conn.settimeout(5)
    conn.recv(1024)
"""


def test_the_wait_check_finds_every_call_without_its_bound():
    """Each kind of wait the check knows, planted with and without its bound: only those without are found."""
    found = [(function, line - 8, call) for function, line, call in unbounded_waits(PLANTED)]  # lines of planted()
    assert found == [
        ("planted", 1, "subprocess.run"),
        ("planted", 3, "proc.wait"),
        ("planted", 5, "proc.wait"),
        ("planted", 6, "proc.communicate"),
        ("planted", 8, "proc.stdout.readline"),
        ("planted", 9, "proc.stderr.read"),
        ("planted", 10, "thread.join"),
        ("planted", 13, "q.get"),
        ("planted", 14, "q.get"),
        ("planted", 18, "lock.acquire"),
        ("planted", 20, "future.result"),
        ("planted", 21, "event.wait"),
        ("planted", 23, "urllib.request.urlopen"),
        ("planted", 25, "socket.create_connection"),
        ("planted", 26, "conn.recv"),
        ("planted", 27, "mp.start_processes"),
        ("planted", 29, "RolloutQueue"),
        ("planted", 31, "urlopen"),
    ]


def test_every_wait_of_the_tests_is_bounded():
    """A command, a process, a thread, a queue, a pipe or a socket that hangs ends at its own bound (or the test's
    timeout, tests/conftest.py), never at CI's limit; each wait bounded otherwise is in EXEMPT, with its reason."""
    found, exempted = {}, set()
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "*.py"))):
        name = os.path.basename(path)
        with open(path) as f:
            for function, line, call in unbounded_waits(f.read()):
                if (name, function, call) in EXEMPT:
                    exempted.add((name, function, call))
                else:
                    found.setdefault(name, []).append(f"line {line}, {function}: {call}")
    assert not found, found
    assert exempted == set(EXEMPT), f"no longer found, to remove from EXEMPT: {set(EXEMPT) - exempted}"
