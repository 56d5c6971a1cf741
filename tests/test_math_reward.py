"""accuracy_reward (math answers judged as math by math-verify, in worker processes: rloo_utils/math_judge.py) and
boxed_format: a table of hard cases, each judged as math-verify judges it called directly with TRL's configs; the
pitfall of threads (math-verify's timeouts are signals); a pathological answer bounded, counted and said; workers
killed, dead, forked, at exit; the columns checked before a run; a short run's rewards."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, WAIT, check_one_line_error, run_env, run_rloo, write_jsonl
from rloo_utils import math_judge
from rloo_utils.errors import RunError
from rloo_utils.math_judge import GRACE, TIMEOUT, MathJudge
from rloo_utils.rewards import BUILTIN_REWARD_FUNCS, load_reward_func
from rloo_utils.verifiable import REWARD_FUNCS, accuracy_reward, boxed_format

PATHOLOGICAL = r"so the count is \boxed{9^{9^{9^{9}}}}"  # sympy raises 9 to a 387,420,489-digit power, in C
DEGENERATE = r"\[ x " * 10_000  # 50 KB of a repeated opening: math-verify's regexes take 10 s (its own bound) on it

# (completion, gold, expected): expected from the mathematics where math-verify agrees with it, else math-verify's
# verdict, the contract, with a comment saying where they differ
TABLE = [
    # fractions and decimals
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"$\frac{1}{2}$", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\tfrac{3}{4}}", r"$\frac34$", 1.0),
    (r"\boxed{1/2}", "0.5", 1.0),  # plain, not LaTeX
    (r"\boxed{2/4}", r"$\frac{1}{2}$", 1.0),
    (r"\boxed{0.333}", r"$\frac{1}{3}$", 0.0),
    (r"\boxed{0.333333}", r"$\frac{1}{3}$", 1.0),  # not equal in mathematics: math-verify rounds to 6 decimals
    (r"\boxed{1.0}", "1", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),  # a thousands comma
    (r"\boxed{3.14}", r"$\pi$", 0.0),
    (r"\boxed{\sqrt{2}/2}", r"$\frac{1}{\sqrt{2}}$", 1.0),  # equal after simplification
    (r"\boxed{2^{10}}", "1024", 1.0),
    # \left( \right), intervals, sets
    (r"\boxed{\left( 1, 2 \right)}", "$(1,2)$", 1.0),
    (r"\boxed{\left[ 0, 1 \right)}", "$[0,1)$", 1.0),
    (r"\boxed{[0,1)}", "$(0,1]$", 0.0),  # the ends differ
    (r"\boxed{\{1,2\}}", r"$\{2,1\}$", 1.0),  # a set in any order
    (r"\boxed{\{1,2\}}", r"$\{1,2,3\}$", 0.0),
    (r"\boxed{1, 2}", r"$\{1,2\}$", 1.0),  # a list in a box is a set
    # units, percentages
    (r"\boxed{5 \text{ cm}}", "5", 1.0),  # units dropped
    (r"\boxed{12\ \mathrm{m}}", "$12$", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),  # 50% is 0.5
    (r"\boxed{50\%}", "50", 0.0),  # ... and so not 50, though a reader asked for a percentage would take it
    (r"\boxed{50}", r"$50\%$", 0.0),
    # equations
    (r"\boxed{x = 2}", "2", 1.0),  # the value assigned
    (r"\boxed{2}", "$x = 2$", 1.0),
    (r"\boxed{y = 2}", "$x = 2$", 0.0),  # another variable
    (r"\boxed{x^2+2x+1}", "$(x+1)^2$", 1.0),
    # several boxes: the last counts, with the boxes listed with it
    (r"I first thought \boxed{3} but after checking everything again the answer is \boxed{4}", "4", 1.0),
    (r"The answer is \boxed{1} and \boxed{2}", "2", 0.0),  # listed together: the set {1, 2}, not 2
    (r"\boxed{1}, \boxed{2}", r"$\{1,2\}$", 1.0),
    # a self-correction within 70 characters holding "and", "or", "," or ";" reads as a list too: {3, 4}, not 4
    (r"\boxed{3}. Wait, no: \boxed{4}", "4", 0.0),
    # no box: LaTeX after "answer", else nothing
    ("The answer is $5$", "5", 1.0),
    ("The final answer is $\\frac{1}{2}$", "0.5", 1.0),
    ("The answer is 5", "5", 0.0),  # plain text after "answer" is not read (TRL's config): answer_accuracy reads it
    ("5", "5", 0.0),
    ("", "5", 0.0),  # an empty completion
    (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # a box cut off
    ("Solution: ... $$\\boxed{12}$$", "12", 1.0),
    (r"\boxed{\text{Alice}}", r"$\text{Alice}$", 1.0),  # text compares as text
    # the gold answer
    (r"\boxed{7}", "#### 7", 1.0),  # GSM8K's solution
    (r"\boxed{12}", r"Adding up: $5 + 7 = 12$, so the answer is $\boxed{12}$.", 1.0),  # a whole solution: its box
    (r"\boxed{7}", 7, 1.0),  # our `answer` column: an integer
    (r"\boxed{0.5}", 0.5, 1.0),
    (r"\boxed{5}", None, None),  # no gold answer
    (r"\boxed{5}", "", None),
    (r"\boxed{5}", "hello", None),  # a gold math-verify reads nothing in
    (r"\boxed{\frac{1}{2}}", r"\frac12", None),  # bare LaTeX that is not a plain \frac{a}{b}: write it in $...$
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
]


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def trl_configs_verdict(completion: str, gold) -> float | None:
    """math-verify called directly in this (main) thread with TRL 1.16's configs and timeouts (its accuracy_reward)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(gold if isinstance(gold, str) else repr(gold), parsing_timeout=10)
    if not gold:
        return None
    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )
    answer = parse(completion, extraction_config=[config], extraction_mode="first_match", parsing_timeout=10)
    return float(verify(gold, answer, timeout_seconds=5))


def test_the_table_has_the_cases_the_issue_names():
    assert len(TABLE) >= 30
    assert any(r"\dfrac" in c for c, _, _ in TABLE) and any(r"\left(" in c for c, _, _ in TABLE)
    assert any(c.count(r"\boxed") > 1 for c, _, _ in TABLE) and any(r"\%" in c for c, _, _ in TABLE)


@pytest.mark.parametrize("completion, gold, expected", TABLE)
def test_accuracy_reward_judges_as_math_verify_does(completion, gold, expected):
    assert accuracy_reward([completion], [gold]) == [expected]
    assert accuracy_reward([chat(completion)], solution=[gold]) == [expected]  # conversational, TRL's column
    if gold is not None and gold != "":
        assert trl_configs_verdict(completion, gold) == expected  # math-verify standalone, the main thread


def test_a_batch_is_judged_row_by_row_and_logged():
    logged, metrics = {}, []
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{3}", r"\boxed{1}", "no answer", r"\boxed{2}"]
    golds = ["0.5", "0.5", None, "$1$", "hello"]
    rewards = accuracy_reward(
        completions,
        solution=golds,
        answer=[1, 2, 3, 4, 5],  # `solution` first: TRL's column
        log_extra=lambda name, values: logged.__setitem__(name, values),
        log_metric=lambda name, value: metrics.append((name, value)),
    )
    assert rewards == [1.0, 0.0, None, 0.0, None]
    assert logged["answer_parsed"] == ["[1/2, '\\\\frac{1}{2}']", "[3, '3']", "[skipped]", "[unparseable]", "[skipped]"]
    assert logged["gold_parsed"][:3] == ["[0.500000000000000, '0.5']"] * 2 + ["[no gold]"]
    assert logged["gold_parsed"][4] == "[unparseable]"
    assert metrics == [("accuracy_reward/unjudged", 0), ("accuracy_reward/unparsed_golds", 1)]
    assert accuracy_reward([], solution=[]) == []
    assert accuracy_reward([r"\boxed{4}", r"\boxed{5}"], answer=[4, 4]) == [1.0, 0.0]  # our column, without TRL's


def test_an_unparsed_gold_is_said_in_one_line_once(capsys):
    golds = ["no answer here", "$1$", "no answer here", "nor here"]
    assert accuracy_reward([r"\boxed{1}"] * 4, golds) == [None, 1.0, None, None]
    assert capsys.readouterr().err.strip().splitlines() == [
        "accuracy_reward: math-verify reads no answer in the gold answer 'no answer here' and 1 more, whose rows "
        "are not scored (None): write a gold as LaTeX in $...$ or \\boxed{}, or as a plain number"
    ]
    assert accuracy_reward([r"\boxed{1}"] * 2, golds[:2]) == [None, 1.0]
    assert capsys.readouterr().err == ""  # said once


@pytest.mark.parametrize("gold, kind", [([1, 2], "list"), (True, "bool"), ({"a": 1}, "dict")])
def test_a_gold_answer_that_is_neither_text_nor_a_number_is_a_mistake_named(gold, kind):
    with pytest.raises(ValueError, match=f"is a {kind}, not text or a number: fix the dataset's solution"):
        accuracy_reward([r"\boxed{1}"], [gold])


def test_without_either_column_it_says_which_it_reads():
    with pytest.raises(ValueError, match="a column `solution` \\(TRL's\\) or `answer`: give one"):
        accuracy_reward([r"\boxed{1}"])


@pytest.mark.slow
def test_pathological_answers_are_bounded_scored_0_counted_and_said_and_the_next_call_works(capsys):
    metrics = []
    start = time.monotonic()
    rewards = accuracy_reward(
        [PATHOLOGICAL, r"\boxed{1}", DEGENERATE, r"\boxed{2}"], ["1"] * 4, log_metric=lambda *m: metrics.append(m)
    )
    took = time.monotonic() - start
    assert rewards == [0.0, 1.0, 0.0, 0.0]
    assert TIMEOUT <= took < TIMEOUT * (1 if math_judge.WORKERS > 1 else 2) + GRACE + 5  # side by side, 2 workers
    assert ("accuracy_reward/unjudged", 2) in metrics
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "accuracy_reward: math-verify did not judge 2 of 4 completions (scored 0.0) and 0 of 1 gold answers (their "
        f"rows None) within {TIMEOUT:g} s, e.g. ...'so the count is \\\\boxed{{9^{{9^{{9^{{9}}}}}}}}' (timed out)"
    )
    start = time.monotonic()
    assert accuracy_reward([r"\boxed{1}", r"\boxed{2}"], ["1", "1"]) == [1.0, 0.0]  # the next call, at once
    assert time.monotonic() - start < 2
    assert trl_configs_verdict(PATHOLOGICAL, "1") == 0.0  # math-verify's own alarms in the main thread: 0 too
    assert trl_configs_verdict(DEGENERATE, "1") == 0.0


def score_in_a_thread(*args) -> list:
    out = []
    thread = threading.Thread(target=lambda: out.append(accuracy_reward(*args)), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "accuracy_reward did not return within 60 s in a thread"
    return out[0]


THREAD_CASES = [r"\boxed{\frac{1}{2}}", r"\boxed{0.3}", r"\boxed{x = 2}", r"\boxed{[0,1)}"]
THREAD_GOLDS = ["0.5", "0.5", "2", "$[0,1)$"]


def test_in_a_thread_the_scores_are_the_main_thread_s():
    """The pitfall: math-verify's timeouts are signals, which only the main thread can set; TRL turns them off there."""
    assert score_in_a_thread(THREAD_CASES, THREAD_GOLDS) == accuracy_reward(THREAD_CASES, THREAD_GOLDS)
    assert accuracy_reward(THREAD_CASES, THREAD_GOLDS) == [1.0, 0.0, 1.0, 1.0]


def test_in_the_rollout_queue_s_thread_the_scores_are_the_main_thread_s():
    from rloo_utils.rollout_queue import Worker

    class Job:
        def __init__(self):
            self.done, self.rewards = threading.Event(), None

        def run(self):
            self.rewards = accuracy_reward(THREAD_CASES, THREAD_GOLDS)
            self.done.set()

    job = Job()
    Worker().jobs.put(job)
    assert job.done.wait(60)
    assert job.rewards == [1.0, 0.0, 1.0, 1.0]


@pytest.mark.slow
def test_a_pathological_answer_in_a_thread_is_bounded_too():
    """Called from a thread without its timeouts (TRL), math-verify would raise 9 to that power holding the GIL: every
    thread of the process stopped for good. Here the worker's alarm stops it."""
    start = time.monotonic()
    assert score_in_a_thread([PATHOLOGICAL, r"\boxed{1}"], ["1", "1"]) == [0.0, 1.0]
    assert time.monotonic() - start < TIMEOUT + GRACE + 15  # bounded, with a loaded machine's slack


def worker_pids(judge: MathJudge) -> list[int]:
    return [w.pid for w in judge.workers]


def gone(pid: int, seconds: float = 10) -> bool:
    """Whether the process has ended (or is a zombie: ended, not yet reaped) within the seconds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_worker_stuck_where_no_signal_reaches_is_killed_at_its_deadline_and_replaced():
    """A worker that does not answer (sympy spinning in C; here stopped with SIGSTOP, which no alarm interrupts) is
    killed GRACE seconds after its own timeout; a new one takes its place, and the next tasks are judged."""
    judge = MathJudge(workers=1, timeout=0.5)
    try:
        assert judge.judge([{"gold": "$1$", "answer": r"\boxed{1}"}])[0]["correct"] is True
        (stuck,) = worker_pids(judge)
        os.kill(stuck, signal.SIGSTOP)
        start = time.monotonic()
        replies = judge.judge([{"gold": "$1$", "answer": r"\boxed{1}"}, {"gold": "$1$", "answer": r"\boxed{2}"}])
        assert 0.5 + GRACE <= time.monotonic() - start < 0.5 + GRACE + 15  # (the slack: a loaded machine)
        assert replies[0] == {"unjudged": f"killed after {0.5 + GRACE:g} s"}
        assert replies[1]["correct"] is False  # judged by the new worker
        assert gone(stuck) and worker_pids(judge) != [stuck]
    finally:
        judge.close()


def test_a_worker_s_address_space_is_capped():
    judge = MathJudge(workers=1)
    try:
        judge.judge([{"gold": "$1$"}])
        with open(f"/proc/{worker_pids(judge)[0]}/limits") as f:
            (line,) = [line for line in f if line.startswith("Max address space")]
        assert line.split()[3] == "2147483648"  # the soft limit, 2 GiB: a MemoryError there, not the OOM killer here
    finally:
        judge.close()


class Interrupted(Exception):
    pass


def interrupt(signum, frame):
    raise Interrupted()


def test_a_call_interrupted_mid_task_leaves_no_reply_behind_for_the_next():
    """An exception in the waiting thread (Ctrl-C; here SIGUSR1's handler) while a worker is busy: the next call must
    not read that worker's late reply as its own."""
    judge = MathJudge(workers=1, timeout=3)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        judge.judge([{"gold": "$1$"}])  # started
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(Interrupted):
            judge.judge([{"gold": "$1$", "answer": PATHOLOGICAL}])  # busy for 3 s
        timer.join(WAIT)
        assert judge.judge([{"gold": "$1$", "answer": r"\boxed{2}"}]) == [{"correct": False, "parsed": "[2, '2']"}]
    finally:
        signal.signal(signal.SIGUSR1, previous)
        judge.close()


def test_a_worker_that_died_between_calls_is_replaced():
    judge = MathJudge(workers=2, timeout=5)
    try:
        tasks = [{"gold": "$1$", "answer": rf"\boxed{{{n}}}"} for n in range(4)]
        assert [r["correct"] for r in judge.judge(tasks)] == [False, True, False, False]
        dead = worker_pids(judge)
        for pid in dead:
            os.kill(pid, signal.SIGKILL)
            assert gone(pid)
        assert [r["correct"] for r in judge.judge(tasks)] == [False, True, False, False]
        assert not set(worker_pids(judge)) & set(dead)
    finally:
        judge.close()


def test_a_worker_that_dies_mid_task_is_counted_and_replaced():
    judge = MathJudge(workers=1, timeout=30)
    try:
        judge.judge([{"gold": "$1$", "answer": r"\boxed{1}"}])
        (pid,) = worker_pids(judge)
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        killer.start()
        replies = judge.judge([{"gold": "$1$", "answer": PATHOLOGICAL}, {"gold": "$1$", "answer": r"\boxed{1}"}])
        assert replies == [{"unjudged": "its worker died"}, {"correct": True, "parsed": "[1, '1']"}]
    finally:
        judge.close()


def test_a_forked_child_starts_workers_of_its_own_and_leaves_the_parent_s_alone():
    judge = MathJudge(workers=1, timeout=5)
    try:
        judge.judge([{"gold": "$1$", "answer": r"\boxed{1}"}])
        parents = worker_pids(judge)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: judge, say what it got and its workers, and end without the parent's atexit
            try:
                reply = judge.judge([{"gold": "$2$", "answer": r"\boxed{2}"}])[0]
                os.write(write, json.dumps([reply["correct"], worker_pids(judge)]).encode())
                judge.close()
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            correct, childs = json.loads(f.read())
        os.waitpid(child, 0)
        assert correct is True and not set(childs) & set(parents)
        assert worker_pids(judge) == parents  # the parent's workers, untouched and working
        assert judge.judge([{"gold": "$3$", "answer": r"\boxed{3}"}])[0]["correct"] is True
    finally:
        judge.close()


EXITING = """
import os, signal, sys
sys.path.insert(0, {root!r})
from rloo_utils.math_judge import math_judge
from rloo_utils.verifiable import accuracy_reward
assert accuracy_reward([r"\\boxed{{1}}"] * 4, ["1"] * 4) == [1.0] * 4
print(*[w.pid for w in math_judge().workers], flush=True)
{end}
"""


@pytest.mark.parametrize(
    "end",
    [
        "",  # a normal exit: atexit stops them
        "raise SystemExit(3)",
        "os.kill(os.getpid(), signal.SIGKILL)",  # no atexit: the idle workers read the end of their input
    ],
)
def test_the_workers_end_with_their_process(end):
    proc = subprocess.run(
        [sys.executable, "-c", EXITING.format(root=ROOT, end=end)],
        capture_output=True,
        text=True,
        timeout=120,
        env=run_env(),
    )
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == math_judge.WORKERS, proc.stderr
    assert all(gone(pid) for pid in pids)


def test_without_math_verify_the_worker_says_so_in_one_line(tmp_path, monkeypatch):
    shim = tmp_path / "shim" / "math_verify"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'math_verify'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(shim.parent))  # before the site-packages: what the workers import
    judge = MathJudge(workers=2)
    message = (
        "accuracy_reward's math-verify worker did not start (ModuleNotFoundError: No module named 'math_verify'): "
        "install requirements.txt (math-verify==0.8.0)"
    )
    with pytest.raises(RunError) as error:
        judge.judge([{"gold": "$1$"}])
    assert str(error.value) == message and judge.workers == []


def test_importing_the_rewards_imports_neither_math_verify_nor_sympy():
    code = "import sys, rloo_utils.rewards; print(sorted({'math_verify', 'sympy'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stderr


@pytest.mark.parametrize(
    "completion, expected",
    [
        (r"so \boxed{\frac{1}{2}}", 1.0),
        (r"\boxed {5}", 1.0),  # a space before the brace
        (r"\boxed{\{1,2\}}", 1.0),  # escaped braces count as math-verify counts them
        (r"\boxed{1} and then \boxed{", 0.0),  # the last box is cut off
        (r"\boxed{}", 0.0),
        (r"\boxed{ }", 0.0),
        (r"\boxed 5", 0.0),
        ("The answer is 5", 0.0),
        ("", 0.0),
        (r"\boxed{wrong}", 1.0),  # right or wrong
    ],
)
def test_boxed_format(completion, expected):
    assert boxed_format([completion], solution=["1"]) == [expected]
    assert boxed_format([chat(completion)], answer=[1]) == [expected]
    assert boxed_format([completion]) == [expected]  # without a gold column: the format alone
    assert boxed_format([completion], solution=[None]) == [None]  # a row of another task


def test_every_script_offers_them_by_name_and_as_a_file():
    for name in ("accuracy_reward", "boxed_format"):
        assert load_reward_func(name, BUILTIN_REWARD_FUNCS) is REWARD_FUNCS[name]
    from_file = load_reward_func(os.path.join(ROOT, "rloo_utils", "verifiable.py") + ":accuracy_reward", {})
    assert from_file([r"\boxed{\dfrac{1}{2}}"], ["0.5"]) == [1.0]


def test_a_dataset_without_solution_or_answer_is_refused_with_both_names():
    from datasets import Dataset

    from rloo_utils.errors import UsageError
    from rloo_utils.rewards import check_reward_columns

    run = dict(num_sample_generations=0, eval_steps=0, multi_turn=False)
    for column in ("solution", "answer"):
        train = Dataset.from_list([{"prompt": "p", column: "1"}])
        check_reward_columns(
            [accuracy_reward, boxed_format], ["accuracy_reward", "boxed_format"], [], [], train, None, **run
        )
    train = Dataset.from_list([{"prompt": "p", "topic": "a"}])
    check_reward_columns([boxed_format], ["boxed_format"], [], [], train, None, **run)  # the format alone
    message = "reward function accuracy_reward reads a column 'solution' or 'answer', which the training split"
    with pytest.raises(UsageError, match=message):
        check_reward_columns([accuracy_reward], ["accuracy_reward"], [], [], train, None, **run)


@pytest.mark.slow
def test_a_run_on_a_dataset_without_solution_or_answer_is_refused_before_the_models_load(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    write_jsonl(str(data), [{"prompt": "1 + 1 =", "topic": "a"}] * 4)
    proc = run_rloo(
        *("--model_name_or_path", tiny["policy"], "--dataset_name", data, "--reward_funcs", "accuracy_reward"),
        cwd=tmp_path,
    )
    check_one_line_error(proc, "reward function accuracy_reward reads a column 'solution' or 'answer'")
    assert not (tmp_path / "runs").exists()


TRL_SIDE = """
import json, sys
sys.path.append({site!r})  # TRL's environment after ours: its accuracy_reward on our math-verify
from trl.rewards.accuracy_rewards import accuracy_reward
cases = json.load(sys.stdin)
print(json.dumps(accuracy_reward([[{{"content": c}}] for c, _ in cases], [g for _, g in cases])))
"""


@pytest.mark.slow
def test_trl_s_own_accuracy_reward_gives_the_table_s_scores():
    """The name is TRL's: so are the scores (TRL 1.16's function, from .venv-trl, called in its main thread)."""
    import glob

    (site,) = glob.glob(os.path.join(ROOT, ".venv-trl", "lib", "python3*", "site-packages"))
    cases = [(c, g if isinstance(g, str) else repr(g)) for c, g, _ in TABLE if g is not None and g != ""]
    proc = subprocess.run(
        [sys.executable, "-c", TRL_SIDE.format(site=site)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [e for _, g, e in TABLE if g is not None and g != ""]


@pytest.mark.slow
def test_a_run_s_logged_rewards_are_accuracy_reward_s_on_its_logged_completions(tiny, tmp_path):
    """rloo.py with --reward_funcs accuracy_reward on prompts with hand-written solutions (one missing, one math-verify
    reads nothing in): each logged completion's reward is accuracy_reward's on it, re-scored here; its columns and
    metrics are logged."""
    solutions = {"say a": "$5$", "say b": r"\boxed{\frac{1}{2}}", "say c": None, "say d": "not math"}
    data = tmp_path / "data.jsonl"
    write_jsonl(str(data), [{"prompt": p, "solution": s} for p, s in solutions.items()])
    proc = run_rloo(
        *("--model_name_or_path", tiny["policy"], "--dataset_name", data, "--total_episodes", 16),
        *("--reward_funcs", "accuracy_reward", "boxed_format", "--max_completion_length", 8),
        *("--log_completions", "--run_name", "run"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "runs" / "run" / "completions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 16
    again = accuracy_reward([r["completion"] for r in rows], [solutions[r["prompt"]] for r in rows])
    logged = [None if r["accuracy_reward"] != r["accuracy_reward"] else r["accuracy_reward"] for r in rows]
    assert logged == again
    assert {r["prompt"] for r, a in zip(rows, again) if a is None} == {"say c", "say d"}
    assert all(r["gold_parsed"] == "[no gold]" for r in rows if r["prompt"] == "say c")
    with open(tmp_path / "runs" / "run" / "metrics.jsonl") as f:
        (metrics,) = [row for row in map(json.loads, f) if "episode" in row]
    assert metrics["log_metric/accuracy_reward/unjudged"] == 0
    assert metrics["log_metric/accuracy_reward/unparsed_golds"] == 1
