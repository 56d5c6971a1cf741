"""code_reward (rloo_utils/code_reward.py) and its sandbox (rloo_utils/sandbox.py): the schemas of the tests, the
program found in a completion, the comparison of outputs, the scores and counts; each hostile program contained and
scored, a normal one beside it still scored right; the rlimits-only mode's own protections; the refusals; a run of
rloo.py whose rewards are the sandbox's. Hostile runs get 2 s (the wall clock and the CPU) and 256 MiB."""

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from conftest import ROOT, check_one_line_error, read_metrics, run_rloo
from rloo_utils import checks
from rloo_utils.code_reward import CodeReward, RowTest, check_code_reward, program_of, row_tests, same_output
from rloo_utils.errors import UsageError
from rloo_utils.sandbox import OUTPUT_BYTES, PROCESSES, Sandbox

SYSTEM_PYTHON = "/usr/bin/python3"  # reachable by nobody: the rlimits mode's interpreter as root (Debian's python3)
SUM_TESTS = {"language": "python", "test_cases": [{"type": "stdin_stdout", "input": "2 3\n", "output": "5\n"}]}
SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}\n```\n"


def scored(reward: CodeReward, completions: list, **columns) -> tuple[list, dict]:
    """The rewards of the completions, each row with the tests of `columns` (one value for all), and the counts the
    call logged (log_metric), the zero ones left out."""
    counts = {}
    rows = {name: [value] * len(completions) for name, value in columns.items()}
    rewards = reward(completions, **rows, log_metric=lambda name, value: counts.__setitem__(name, value))
    return rewards, {name.removeprefix("code_reward/"): value for name, value in counts.items() if value}


def hostile_beside_normal(reward: CodeReward, program: str) -> tuple[list, dict]:
    """The hostile program and a normal one scored in the same call (they run at once, on the pool's two workers),
    both against SUM_TESTS: the hostile one fails it, the normal one must pass."""
    return scored(reward, [fenced(program), SUM], verification_info=SUM_TESTS)


@pytest.fixture(scope="module")
def bwrap_reward():
    reward = CodeReward("bwrap", timeout=2, memory_mb=256, workers=2)
    reward.sandbox.start()
    return reward


@pytest.fixture(scope="module")
def rlimits_reward():
    reward = CodeReward("rlimits", timeout=2, memory_mb=256, workers=2, python=SYSTEM_PYTHON)
    reward.sandbox.start()
    return reward


@pytest.fixture(params=["bwrap", "rlimits"])
def each_reward(request, bwrap_reward, rlimits_reward):
    return {"bwrap": bwrap_reward, "rlimits": rlimits_reward}[request.param]


def processes_with(marker: str) -> list[str]:
    """The processes of this machine whose command line holds marker."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if marker.encode() in f.read():
                    found.append(path.split("/")[2])
        except OSError:  # ended meanwhile
            pass
    return found


def count_processes(marker: str, counts: list, seconds: float) -> None:
    """Append the number of processes_with(marker) every 0.2 s for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        counts.append(len(processes_with(marker)))
        time.sleep(0.2)


def wait_until_none(marker: str, seconds: float = 5) -> list[str]:
    """processes_with(marker) once it is empty, or when `seconds` have passed (a pid namespace dies within ms)."""
    deadline = time.monotonic() + seconds
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return processes_with(marker)


# ---- The tests' schemas, the program, the comparison -----------------------------------------------------------------
def test_row_tests_reads_open_r1s_and_mbpps_schemas():
    cases = [{"type": "stdin_stdout", "input": "1\n", "output": "2\n"}, {"input": "x", "output": "y"}]
    expected = [RowTest(input="1\n", output="2\n"), RowTest(input="x", output="y")]
    assert row_tests({"language": "python", "test_cases": cases}) == expected
    assert row_tests(json.dumps({"language": "python", "test_cases": cases})) == expected  # its JSON text
    assert row_tests({"test_cases": cases[:1]}) == expected[:1]  # no language: Python
    assert row_tests(test_list=["assert f(1) == 2", "assert f(0) == 1"]) == [
        RowTest(check="assert f(1) == 2"),
        RowTest(check="assert f(0) == 1"),
    ]
    assert row_tests(test_list=["assert f(1)"], test_setup_code="x = 1", test_imports=["import math"]) == [
        RowTest(check="import math\nx = 1\nassert f(1)")
    ]
    both = row_tests({"language": "python", "test_cases": cases[:1]}, ["assert f(1)"])
    assert both == [RowTest(input="1\n", output="2\n"), RowTest(check="assert f(1)")]
    for nothing in [None, float("nan"), "", [], {}]:  # a row without tests
        assert row_tests(nothing) is None and row_tests(test_list=nothing) is None
    assert row_tests({"language": "python", "test_cases": []}) is None


@pytest.mark.parametrize(
    "columns, message",
    [
        (
            {"verification_info": {"language": "cpp", "test_cases": []}},
            "language is 'cpp', and code_reward runs Python",
        ),
        ({"verification_info": "{not json"}, "its verification_info is not JSON"),
        ({"verification_info": ["a list"]}, 'is not {"language": ..., "test_cases": [...]}'),
        ({"verification_info": {"test_cases": "abc"}}, 'is not {"language": ..., "test_cases": [...]}'),
        ({"verification_info": {"test_cases": [{"type": "function_call", "input": "", "output": ""}]}}, "not a stdin"),
        ({"verification_info": {"test_cases": [{"type": "stdin_stdout", "input": "1"}]}}, "lacks its input or output"),
        ({"test_list": "assert f(1)"}, "not a list of assert statements"),
        ({"test_list": ["assert f(1)", 3]}, "not a list of assert statements"),
        ({"test_list": ["assert f(1)", "  "]}, "not a list of assert statements"),
        ({"test_list": ["assert f(1)"], "test_imports": "import os"}, "not a list of import statements"),
        ({"test_list": ["assert f(1)"], "test_setup_code": ["x = 1"]}, "its test_setup_code is"),
    ],
)
def test_row_tests_names_a_mistake_in_the_data(columns, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        row_tests(**columns)


@pytest.mark.parametrize(
    "completion, program",
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("a\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```\nend", "print(2)\n"),  # the last block
        ("```py\nx = 1\n```", "x = 1\n"),
        ("```python3\nx = 1\n```", "x = 1\n"),
        ("```Python \nx = 1\n```", "x = 1\n"),  # a capital, a space before the newline
        ("```\nx = 1\n```", "x = 1\n"),  # a block without a language, where no Python one is
        ("```python\nx = 1\n```\nOutput:\n```\n3\n```", "x = 1\n"),  # the Python block, not the output's after it
        ("```cpp\nint main() {}\n```", None),  # another language
        ("```python\nx = 1\n```\n```python\nprint(x", "x = 1\n"),  # the last block unclosed (cut): the one before
        ("print(1)", None),  # no block
        ("```python\n   \n```", None),  # blank code
        ("", None),
        ([{"role": "assistant", "content": "```python\nprint(3)\n```"}], "print(3)\n"),  # chat messages: the last
    ],
)
def test_program_of_takes_the_last_python_block(completion, program):
    assert program_of(completion) == program


@pytest.mark.parametrize(
    "printed, expected, same",
    [
        ("5\n", "5", True),
        ("  5  \n\n", "5\n", True),  # the whole and each line stripped
        ("1 2 \n3\n", "1 2\n 3", True),
        ("1\r\n2\r\n", "1\n2\n", True),  # Windows line ends in either
        ("1\n2", "1\n2\n3", False),  # a missing line (open-r1's zip would pass it)
        ("1\n2\n3", "1\n2", False),  # an extra line
        ("1 2", "1  2", False),  # the spaces inside a line count
        ("", "", True),
        ("", "0", False),
        ("1\n\n2", "1\n2", False),  # a blank line inside counts
    ],
)
def test_same_output_compares_stripped_lines(printed, expected, same):
    assert same_output(printed, expected) is same


# ---- Scores and counts -----------------------------------------------------------------------------------------------
def test_code_reward_scores_the_share_of_tests_passed_and_counts_each_outcome(each_reward):
    info = {
        "language": "python",
        "test_cases": [
            {"type": "stdin_stdout", "input": "2 3\n", "output": "5\n"},
            {"type": "stdin_stdout", "input": "10 -4\n", "output": "6\n"},
            {"type": "stdin_stdout", "input": "0 0\n", "output": "0\n"},
        ],
    }
    completions = [
        SUM,  # 3 of 3
        "```python\nprint(5)\n```",  # 1 of 3: the first case's answer, printed whatever the input
        "```python\nprint(int(input().split()[0]))\n```",  # 2 wrong, the 0 0 case right
        "I would add them.",  # no code
        "```python\nprint(a + b\n```",  # a syntax error: 3 errors
        SUM,  # a row without tests
    ]
    infos = [info] * 5 + [None]
    counts = {}
    rewards = each_reward(completions, verification_info=infos, log_metric=lambda n, v: counts.__setitem__(n, v))
    assert rewards == [1.0, 1 / 3, 1 / 3, 0.0, 0.0, None]
    assert counts == {
        "code_reward/passed": 5,
        "code_reward/wrong": 4,
        "code_reward/errors": 3,
        "code_reward/timeouts": 0,
        "code_reward/memory": 0,
        "code_reward/output_limit": 0,
        "code_reward/no_code": 1,
    }


def test_assert_tests_pass_only_when_the_check_ran(each_reward):
    tests = {"test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], "test_setup_code": "import math"}
    completions = [
        fenced("def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(int(input()), 1))"),
        fenced("def add(a, b):\n    return a - b"),  # -1 and -2: neither
        fenced("import os\nos._exit(0)"),  # ends the process before the check: not a pass
        fenced("import sys\nsys.exit(0)"),
        fenced("import __main__, os\nos.write(1, b'\\n' + getattr(__main__, 'mark', b'?') + b'\\n')\nos._exit(0)"),
        fenced("exit()"),  # what `site` would give, given without it
        fenced("def add(a, b):\n    return a + b if a > 0 else -1"),  # one of two
        fenced("def add(a, b):\n    assert math.pi\n    return a + b"),  # the set-up code's import, in its namespace
    ]
    rewards, counts = scored(each_reward, completions, **tests)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0]
    assert counts == {"passed": 5, "wrong": 11}


# ---- Hostile programs: each scored and counted, nothing escaped, a normal one beside it scored right ----------------
@pytest.mark.parametrize("program", ["while True:\n    pass", "import time\ntime.sleep(100)"])
def test_an_infinite_loop_is_stopped_at_the_wall_clock(each_reward, program):
    start = time.monotonic()
    rewards, counts = hostile_beside_normal(each_reward, program)
    assert time.monotonic() - start < 30  # its 2 s and the runs' start; slack for a loaded machine: bounded, not timed
    assert rewards == [0.0, 1.0] and counts == {"timeouts": 1, "passed": 1}


@pytest.mark.parametrize(
    "program", ["x = bytearray(10**10)", "chunks = []\nwhile True:\n    chunks.append(b'x' * 10**7)"]
)
def test_a_memory_bomb_stops_at_its_memory(each_reward, program):
    rewards, counts = hostile_beside_normal(each_reward, program)
    assert rewards == [0.0, 1.0] and counts == {"memory": 1, "passed": 1}


def test_a_fork_bomb_is_bounded_and_leaves_no_process_behind(each_reward):
    """Every process forks until RLIMIT_NPROC refuses, then becomes a sleeper named by the marker: the sleepers are
    all gone once the run is scored, and this process still starts others."""
    marker = f"fork-bomb-{uuid.uuid4().hex}"
    program = "\n".join(
        ["import os", "while True:", "    try:", "        os.fork()", "    except OSError:"]
        + [f"        os.execv('/bin/sleep', ['{marker}', '1000'])"]  # argv[0]: its name, for processes_with
    )
    seen = []
    watcher = threading.Thread(target=count_processes, args=(marker, seen, 1.6))
    watcher.start()
    rewards, counts = hostile_beside_normal(each_reward, program)
    watcher.join(timeout=30)
    assert rewards == [0.0, 1.0] and counts == {"timeouts": 1, "passed": 1}
    assert 0 < max(seen) <= PROCESSES  # it ran, and no further than its limit
    assert wait_until_none(marker) == []
    assert subprocess.run(["true"], timeout=30).returncode == 0


# Forks until refused, then prints how many processes it was: itself and its children, each sleeping a while
COUNTING_BOMB = "\n".join(
    [
        "import os, time",
        "count = 1",
        "while True:",
        "    try:",
        "        if os.fork() == 0:",
        "            time.sleep(5)",
    ]
    + ["            os._exit(0)", "        count += 1", "    except OSError:", "        print(count)", "        break"]
)


def test_each_run_counts_its_own_processes_alone(bwrap_reward):
    """Two fork bombs at once (and other processes of the uid on the machine) do not share RLIMIT_NPROC: each run
    counts in a user namespace of its own. As root the code's namespace holds it alone; as another user bwrap's
    reaper is in it too."""
    runs = bwrap_reward.sandbox.run_all([({"program": COUNTING_BOMB, "check": None}, "")] * 2)
    expected = PROCESSES if os.geteuid() == 0 else PROCESSES - 1
    assert [run.stdout for run in runs] == [f"{expected}\n".encode()] * 2


NOT_ROOT = """\
import json
from rloo_utils.sandbox import Sandbox
box = Sandbox("bwrap", timeout=2, memory_mb=256, workers=2, python="/usr/bin/python3")
line = box.start()
probe = "\\n".join(["import os, socket", "try:", "    socket.create_connection(('1.1.1.1', 53), timeout=1)",
    "    print('connected')", "except OSError:", "    print('blocked')",
    "print(os.getuid(), sorted(os.environ), os.path.exists(%r))" % __import__("os").getcwd(),
    "for folder in ['/', '/dev', '/dev/shm', '/etc', '/usr', '/sandbox', '/tmp']:",
    "    try:", "        open(folder.rstrip('/') + '/x', 'w').write('x')", "        print('wrote', folder)",
    "    except OSError:", "        pass"])
runs = box.run_all([({"program": BOMB, "check": None}, ""), ({"program": probe, "check": None}, "")])
print(json.dumps({"line": line, "outputs": [run.stdout.decode() for run in runs]}))
"""


def test_a_trainer_that_is_not_root_gets_the_same_sandbox(tmp_path):
    """bwrap run by a user (here nobody, from root): it makes the user namespace itself, and the run is as contained
    as root's: its processes counted alone, no network, no environment variable of the trainer's, no file of ours."""
    user = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    script = NOT_ROOT.replace("BOMB", repr(COUNTING_BOMB))
    proc = subprocess.run(
        [SYSTEM_PYTHON, "-B", "-c", script],
        env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin", "RLOO_TEST_SECRET": "s3cret"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **user,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    assert f"as your uid {uid} without capabilities" in result["line"]
    assert result["outputs"] == [
        f"{PROCESSES - 1}\n",
        f"blocked\n{uid} ['HOME', 'LANG', 'PATH', 'PWD'] False\nwrote /sandbox\nwrote /tmp\n",  # its folders alone
    ]


def test_writes_outside_its_folder_leave_nothing(bwrap_reward, tmp_path):
    name = f"escaped-{uuid.uuid4().hex}"
    targets = [str(tmp_path / name), f"/tmp/{name}", os.path.join(ROOT, name), f"/root/{name}", f"/usr/{name}"]
    targets += [f"/{name}", f"/dev/shm/{name}", f"/etc/{name}"]
    program = "\n".join(
        [
            "import os",
            f"for path in {targets!r}:",
            "    try:",
            "        open(path, 'w').write('x')",
            "    except OSError:",
            "        pass",
        ]
        + ["open('/sandbox/inside', 'w').write('x')", "open('/tmp/inside', 'w').write('x')", "print('done')"]
    )
    rewards, counts = scored(
        bwrap_reward,
        [fenced(program), SUM],
        verification_info={
            "language": "python",
            "test_cases": [{"type": "stdin_stdout", "input": "", "output": "done"}],
        },
    )
    assert rewards == [1.0, 0.0]  # it ran to its end (SUM has no input here: EOFError)
    assert [path for path in targets if os.path.exists(path)] == []
    # and a fresh folder for the next run: nothing of the last one's writes
    (run,) = bwrap_reward.sandbox.run_all(
        [({"program": "import os\nprint(os.listdir('.'), os.listdir('/tmp'))", "check": None}, "")]
    )
    assert run.stdout == b"[] []\n"


# rlimits as root: the code runs as nobody, who cannot read root's processes' environ; as your own uid it can, and the
# start line says so (NOT protected: your own files and processes)
@pytest.mark.parametrize("mode", ["bwrap", "rlimits"] if os.geteuid() == 0 else ["bwrap"])
def test_the_trainers_environment_is_not_read(mode, bwrap_reward, rlimits_reward, monkeypatch):
    each_reward = {"bwrap": bwrap_reward, "rlimits": rlimits_reward}[mode]
    secret = f"token-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLOO_TEST_SECRET", secret)
    reader = (
        "import glob, os\n"
        "seen = [repr(dict(os.environ))]\n"
        "for path in glob.glob('/proc/*/environ') + [f'/proc/{os.getppid()}/environ', '/proc/1/environ']:\n"
        "    try:\n"
        "        seen.append(open(path, 'rb').read().decode('latin-1'))\n"
        "    except OSError:\n"
        "        pass\n"
        "print('\\n'.join(seen))\n"
    )
    (run,) = each_reward.sandbox.run_all([({"program": reader, "check": None}, "")])
    assert run.status == "exited" and run.returncode == 0 and b"PATH" in run.stdout
    assert secret.encode() not in run.stdout
    finder = reader.replace("print('\\n'.join(seen))", f"print('LEAK' if {secret!r} in ''.join(seen) else 'clean')")
    rewards, counts = scored(
        each_reward, [fenced(finder)], verification_info={"test_cases": [{"input": "", "output": "clean"}]}
    )
    assert rewards == [1.0] and counts == {"passed": 1}


def test_a_socket_reaches_nothing(bwrap_reward):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = "\n".join(
        ["import socket", f"for address in [('127.0.0.1', {port}), ('8.8.8.8', 53), ('1.1.1.1', 443)]:", "    try:"]
        + ["        socket.create_connection(address, timeout=1)", "        print('connected')", "    except OSError:"]
        + ["        print('blocked')"]
    )
    rewards, counts = scored(
        bwrap_reward,
        [fenced(program), SUM],
        verification_info={"test_cases": [{"input": "1 1", "output": "blocked\nblocked\nblocked"}]},
    )
    assert rewards == [1.0, 0.0] and counts == {"passed": 1, "wrong": 1}  # (SUM prints 2)
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_killing_its_parent_kills_nothing_of_ours(bwrap_reward):
    program = "\n".join(
        [
            "import os, signal",
            "for kill in [lambda: os.kill(os.getppid(), 9), lambda: os.killpg(os.getpgid(os.getppid()), 9),",
        ]
        + [
            "             lambda: os.killpg(0, 9), lambda: os.kill(-1, 9)]:",
            "    try:",
            "        kill()",
            "    except OSError:",
        ]
        + ["        pass", "print('survived')"]
    )
    rewards, counts = hostile_beside_normal(bwrap_reward, program)
    assert rewards == [0.0, 1.0] and counts["passed"] == 1  # this process lives on, and so did the run beside it
    assert counts.get("errors", 0) + counts.get("wrong", 0) == 1
    assert hostile_beside_normal(bwrap_reward, "print(5)")[0] == [1.0, 1.0]  # the pool goes on


def test_printing_gigabytes_is_cut_at_the_output_cap(each_reward):
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 10**6)"
    start = time.monotonic()
    rewards, counts = hostile_beside_normal(each_reward, program)
    assert time.monotonic() - start < 30  # bounded (a loaded machine's slack), not timed; the counts say why it ended
    assert rewards == [0.0, 1.0] and counts == {"output_limit": 1, "passed": 1}
    (run,) = each_reward.sandbox.run_all(
        [({"program": "import sys\nwhile True:\n    sys.stderr.write('y' * 4096)", "check": None}, "")]
    )
    assert run.status == "output_limit" and len(run.stdout) + len(run.stderr) <= OUTPUT_BYTES


# ---- The rlimits-only mode's own protections -------------------------------------------------------------------------
@pytest.fixture
def own_tempdir(monkeypatch):
    """A temporary folder of this test's (world-writable, as /tmp is, for nobody's runs) for the runs' folders."""
    folder = tempfile.mkdtemp(prefix="code-reward-test-")
    os.chmod(folder, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_rlimits_runs_each_program_in_a_fresh_folder_removed_after(rlimits_reward, own_tempdir):
    writer = "\n".join(
        ["import os", "print(os.getcwd(), sorted(os.listdir('.')))", "os.makedirs('a/b')"]
        + ["open('a/b/c', 'w').write('x')", "os.chmod('a', 0)"]  # a folder made unreadable: removed all the same
    )
    runs = rlimits_reward.sandbox.run_all([({"program": writer, "check": None}, "")] * 2)
    folders = [run.stdout.decode().split()[0] for run in runs]
    assert [run.stdout.decode().split(" ", 1)[1] for run in runs] == ["[]\n", "[]\n"]
    assert len(set(folders)) == 2 and all(os.path.dirname(f) == own_tempdir for f in folders)
    rewards, counts = hostile_beside_normal(rlimits_reward, "open('left', 'w').write('x')\nwhile True:\n    pass")
    assert rewards == [0.0, 1.0] and counts == {"timeouts": 1, "passed": 1}
    assert os.listdir(own_tempdir) == []  # a timed-out run's folder too


def test_rlimits_runs_with_a_clean_environment_as_nobody(rlimits_reward, monkeypatch):
    monkeypatch.setenv("RLOO_TEST_SECRET", "s3cret")
    (run,) = rlimits_reward.sandbox.run_all(
        [({"program": "import os\nprint(os.getuid(), sorted(os.environ))", "check": None}, "")]
    )
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    assert run.stdout.decode() == f"{uid} ['HOME', 'LANG', 'PATH']\n"


TRAINER = """\
import os, sys
from rloo_utils.sandbox import Sandbox
mode, python, marker = sys.argv[1], sys.argv[2], os.environ["MARKER"]  # (not in argv: the trainer's own command line)
box = Sandbox(mode, timeout=60, python=python)
box.start()
box.run_all([({"program": "import os\\nos.execv('/bin/sleep', [%r, '100'])" % marker, "check": None}, "")])
"""


@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
def test_a_run_dies_with_its_trainer(mode, own_tempdir):
    """A trainer killed (SIGKILL: nothing of its own runs) while a test run sleeps: the run goes with it (bwrap's
    --die-with-parent; setpriv --pdeathsig KILL without bwrap). (Without bwrap its folder stays: no code of the
    trainer's removes it; here in a temporary folder of the test's own.)"""
    marker = f"orphan-{uuid.uuid4().hex}"
    env = {"PYTHONPATH": ROOT, "PATH": os.environ["PATH"], "MARKER": marker, "TMPDIR": own_tempdir}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, mode, SYSTEM_PYTHON], env=env)
    try:
        deadline = time.monotonic() + 30
        while not processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker), "the test run never started"
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    assert wait_until_none(marker) == []


# ---- The start line and the refusals ---------------------------------------------------------------------------------
def test_the_start_line_says_the_protections_in_force(bwrap_reward, rlimits_reward):
    line = bwrap_reward.sandbox.start()
    assert (
        line.startswith("code_reward: bubblewrap ")
        and "no network; own pid, ipc, uts, mount and user namespaces" in line
    )
    assert "cpu 2 s, memory 256 MiB, 64 processes, 64 open files" in line and line.endswith("wall 2 s; 2 at once")
    assert f"as uid 65534 without capabilities" in line if os.geteuid() == 0 else "as your uid" in line
    line = rlimits_reward.sandbox.start()
    assert line.startswith("code_reward: rlimits only (--code_sandbox rlimits; NOT protected: the network")


def test_without_bwrap_the_sandbox_is_refused_with_the_way_out(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, no prlimit
    with pytest.raises(UsageError, match=r"bwrap is not installed: apt install bubblewrap .* --code_sandbox rlimits"):
        Sandbox("bwrap").start()
    with pytest.raises(UsageError, match=r"needs prlimit and setpriv of util-linux, which the PATH does not hold"):
        Sandbox("rlimits").start()


def test_a_sandbox_that_cannot_run_python_is_refused_in_one_line():
    with pytest.raises(UsageError, match=r"could not run a test program in its bwrap sandbox .* --code_memory_mb 8"):
        Sandbox("bwrap", memory_mb=8).start()
    if os.geteuid() == 0:  # nobody cannot reach an interpreter under /root
        private = tempfile.mkdtemp()  # 0700, root's
        python = os.path.join(private, "python3")
        os.symlink(os.path.realpath(SYSTEM_PYTHON), python)
        try:
            with pytest.raises(
                UsageError, match=r"the code runs as uid 65534, which must be able to run .* bubblewrap"
            ):
                Sandbox("rlimits", python=python).start()
        finally:
            shutil.rmtree(private)
    with pytest.raises(UsageError, match="one of bwrap, rlimits, got 'docker'"):
        Sandbox("docker")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--code_timeout", "3"], "--code_timeout 3.0 is for the reward function code_reward"),
        (["--code_sandbox", "rlimits", "--code_workers", "2"], "--code_sandbox rlimits and --code_workers 2 are for"),
        (["--reward_funcs", "code_reward", "--code_timeout", "0"], "--code_timeout must be > 0, got 0.0"),
        (["--reward_funcs", "code_reward", "--code_memory_mb", "-1"], "--code_memory_mb must be > 0, got -1"),
        (["--reward_funcs", "code_reward", "--code_workers", "0"], "--code_workers must be > 0, got 0"),
    ],
)
def test_bad_code_options_are_refused_by_the_checks(argv, message):
    import tyro

    import rloo

    args = tyro.cli(rloo.Args, args=argv, use_underscores=True)
    with pytest.raises(UsageError, match=re.escape(message)):
        checks.check_args(args)
    good = tyro.cli(rloo.Args, args=["--eval_metric_funcs", "code_reward", "--code_timeout", "3"], use_underscores=True)
    checks.check_args(good)  # an evaluation metric is a user too


def test_check_code_reward_reads_every_row_before_the_models_load():
    from datasets import Dataset

    reward = CodeReward(timeout=2)
    prompt = [{"role": "user", "content": "p"}]
    good = Dataset.from_list([{"prompt": prompt, "test_list": ["assert True"]}, {"prompt": prompt, "test_list": None}])
    check_code_reward([reward], {"training": good})
    assert reward.sandbox.line is not None  # started, its probe run
    check_code_reward([], {"training": Dataset.from_list([{"prompt": prompt}])})  # no code_reward: nothing read
    cases = [
        ([{"prompt": prompt, "answer": 1}], "the training split has neither (its columns: prompt, answer)"),
        ([{"prompt": prompt, "test_list": None}], "no row of the training split has tests for code_reward"),
        (
            [{"prompt": prompt, "verification_info": json.dumps({"language": "python", "test_cases": []})}]
            + [{"prompt": prompt, "verification_info": json.dumps({"language": "rust", "test_cases": []})}],
            "row 1 of the training split cannot be scored by code_reward: its verification_info's language is 'rust'",
        ),
    ]
    for rows, message in cases:
        with pytest.raises(UsageError, match=re.escape(message)):
            check_code_reward([reward], {"training": Dataset.from_list(rows)})


def test_the_toy_problems_reference_solutions_pass_every_test(bwrap_reward):
    """data/code_toy: each row's `solution` scores 1 on its own tests, and 0 on the others'."""
    rows = [
        json.loads(line)
        for split in ("train", "test")
        for line in open(os.path.join(ROOT, "data", "code_toy", f"{split}.jsonl"))
    ]
    assert len(rows) == 12 and sum("test_list" in r for r in rows) == 7
    columns = {name: [r.get(name) for r in rows] for name in ("verification_info", "test_list")}
    assert bwrap_reward([fenced(r["solution"]) for r in rows], **columns) == [1.0] * 12
    shifted = [fenced(r["solution"]) for r in rows[1:] + rows[:1]]
    assert bwrap_reward(shifted, **columns) == [0.0] * 12


# ---- Runs --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_without_tests_in_its_data_is_refused_before_anything_starts(tmp_path):
    proc = run_rloo(
        "--reward_funcs", "code_reward", "--dataset_name", os.path.join(ROOT, "data", "arithmetic"), cwd=tmp_path
    )
    check_one_line_error(proc, "code_reward reads each row's tests from a column verification_info", "has neither")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_run_rewards_its_completions_with_the_sandboxs_results(tmp_path):
    """rloo.py (SmolLM2-135M-Instruct, the embedded default) on the toy problems, one update of 4 prompts x 4: the
    start line says the protections; each logged reward is what the sandbox gives that completion against its row's
    tests run again here, and the update's counts add up to its completions' tests."""
    proc = run_rloo(
        *("--dataset_name", os.path.join(ROOT, "data", "code_toy"), "--reward_funcs", "code_reward"),
        *("--total_episodes", 16, "--per_device_train_batch_size", 16, "--num_generations", 4),
        *("--max_completion_length", 80, "--num_sample_generations", 0, "--eval_steps", 0, "--code_timeout", 5),
        *("--log_completions", "--run_name", "code"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"code_reward: bubblewrap \S+ sandbox \(no network;", proc.stdout), proc.stdout[:3000]
    problems = {
        r["prompt"][0]["content"]: r
        for line in open(os.path.join(ROOT, "data", "code_toy", "train.jsonl"))
        for r in [json.loads(line)]
    }
    with open(tmp_path / "runs" / "code" / "completions.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) == 16
    rows = [problems[row["prompt"]] for row in logged]
    counts = {}
    again = CodeReward(timeout=5)(
        [row["completion"] for row in logged],
        verification_info=[r.get("verification_info") for r in rows],
        test_list=[r.get("test_list") for r in rows],
        log_metric=lambda n, v: counts.__setitem__(n, v),
    )
    assert [row["code_reward"] for row in logged] == again
    (metrics,) = read_metrics(tmp_path)
    assert metrics["rewards/code_reward/mean"] == pytest.approx(sum(again) / 16)
    assert {n: metrics[f"log_metric/{n}"] for n in counts} == counts
    tests_run = sum(v for n, v in counts.items() if n != "code_reward/no_code")
    assert tests_run == 3 * (16 - counts["code_reward/no_code"])  # every toy problem has 3 tests
    assert counts["code_reward/no_code"] < 16  # it writes code blocks,
    assert sum(again) > 0  # and some pass (4 of 16 here, 2026-11-29: is_even and largest, whole)
