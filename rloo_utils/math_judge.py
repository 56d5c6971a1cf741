"""Math answers judged as math by math-verify, in worker processes of their own, bounded in time: accuracy_reward's
judge (rloo_utils/verifiable.py). Why processes: math-verify bounds its work with signal.alarm, which works only in a
process's main thread, and reward functions here run in the training thread, the rollout queue's or the reward event
loop's; called from a thread without its timeouts (as TRL 1.16 calls it there), a pathological answer such as
\\boxed{9^{9^{9^{9}}}} makes sympy raise an integer to a 387,420,489-digit power in C, holding the GIL: every thread of
the trainer stops, for good. In a worker's main thread the alarm interrupts it; what an alarm cannot interrupt (code in
C that never checks for signals) the worker is killed for, and replaced. Workers are fresh interpreters (subprocess,
not multiprocessing, whose spawn and forkserver import the script's __main__, torch and all, into every worker, and
whose fork copies a trainer's threads): they import math-verify only, once, and live as long as the trainer.

    parent: MathJudge (the workers; judge: tasks -> replies), math_judge() (the process's one), judge_answers
    worker: serve() (python -m rloo_utils.math_judge SECONDS), judge_task (one gold, or one answer against its gold)

This module imports nothing but the standard library at the top: math-verify and sympy are the workers' alone."""

import atexit
import functools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from rloo_utils.errors import RunError

# Seconds one gold answer or one completion may take: past it the worker's alarm stops math-verify (a completion then
# scores 0.0, a gold answer None); GRACE seconds later the worker is killed and replaced, where the alarm could not
# stop it. Large against what a normal answer takes (about 1 ms, benchmark/math_reward_speed.py).
TIMEOUT = 5.0
GRACE = 2.0
STARTUP_SECONDS = 120.0  # for a worker to import math-verify, on a loaded machine
MEMORY_BYTES = 2 << 30  # a worker's address space: a runaway power fails with MemoryError there, never OOMs the trainer
# One worker per core, at most 2: they score while the trainer waits, or while it trains (--max_staleness)
WORKERS = min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
READY = "ready"
SHOWN_CHARS = 200  # of a parsed answer, in the completions table


class Overtime(BaseException):
    """The worker's alarm: a BaseException, so that math-verify's `except Exception` does not take it for a score."""


def overtime(signum, frame):
    raise Overtime()


# ---------------------------------------------------------------------------------------------------------------------
# The worker: one task at a time, in its main thread
# ---------------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def parsed_gold(gold: str) -> list:
    """A gold answer as TRL's accuracy_reward parses it: math-verify's default extraction (LaTeX in $...$ or \\boxed{},
    or a plain expression such as 0.5 or 1/2); [] where it finds none. Cached: a prompt's G completions share it."""
    from math_verify import parse

    return parse(gold, parsing_timeout=None)  # (the worker's own alarm bounds it)


def parsed_answer(text: str) -> list:
    """A completion's answer as TRL's accuracy_reward extracts it: a \\boxed{} first (the last one; boxes listed
    together, as "\\boxed{1}, \\boxed{2}", are one answer), else LaTeX after "final answer is" or "answer:"; units
    dropped; no answer without such an anchor ([] for a bare "5")."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse

    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )
    return parse(text, extraction_config=[config], extraction_mode="first_match", parsing_timeout=None)


def shown(parsed: list) -> str:
    return str(parsed)[:SHOWN_CHARS] if parsed else "[unparseable]"


def judge_task(task: dict) -> dict:
    """{"gold"}: {"parsed": what math-verify read in it, None where nothing}; {"gold", "answer"}: {"correct": whether
    the answer equals the gold (None: the gold does not parse), "parsed": what was read in the answer}."""
    from math_verify import verify

    gold = parsed_gold(task["gold"])
    if "answer" not in task:
        return {"parsed": shown(gold) if gold else None}
    if not gold:
        return {"correct": None, "parsed": "[skipped]"}
    answer = parsed_answer(task["answer"])
    return {"correct": bool(verify(gold, answer, timeout_seconds=None)), "parsed": shown(answer)}


def serve(timeout: float) -> None:
    """A worker: judge_task on each JSON line of stdin, its reply a JSON line, each task stopped by an alarm after
    `timeout` seconds ({"unjudged": "timed out"}); ends when stdin closes (its trainer ended)."""
    import logging
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it ends the workers
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library's print goes to stderr, not into the replies
    try:
        import math_verify  # noqa: F401
    except ImportError as e:
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    # with their timeouts off (the alarm is ours) math-verify's modules warn once; a failed parse is a score of 0 here
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    limit(resource.RLIMIT_AS, MEMORY_BYTES)
    limit(resource.RLIMIT_CORE, 0)  # (no core file from a worker the CPU limit ends)
    signal.signal(signal.SIGALRM, overtime)
    judge_task({"gold": "$1$", "answer": "\\boxed{1}"})  # compiles the regexes and the LaTeX parser: warm for task 1
    replies.write(READY + "\n")
    replies.flush()
    for line in sys.stdin:
        # a worker whose trainer died while sympy spun in C ends by itself: the kernel stops it past this CPU time
        used = resource.getrusage(resource.RUSAGE_SELF)
        limit(resource.RLIMIT_CPU, int(used.ru_utime + used.ru_stime + timeout + GRACE) + 2)
        try:  # (the alarm may ring anywhere in here, the handler of an error included)
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                reply = judge_task(json.loads(line))
            except Exception as e:  # (math-verify takes its own errors for "not equal"; this is anything else)
                reply = {"unjudged": f"{type(e).__name__}: {str(e)[:100]}"}
            signal.setitimer(signal.ITIMER_REAL, 0)
        except Overtime:
            reply = {"unjudged": "timed out"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def limit(kind: int, soft: int) -> None:
    """A worker's own soft limit of a resource, within the hard one."""
    import resource

    hard = resource.getrlimit(kind)[1]
    resource.setrlimit(kind, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


# ---------------------------------------------------------------------------------------------------------------------
# The trainer's side: the workers, each task's deadline
# ---------------------------------------------------------------------------------------------------------------------
class MathJudge:
    """`workers` worker processes (serve), started at the first call and replaced when killed; one call at a time
    (the training thread and the rollout queue's take turns). Each task has `timeout` seconds (the worker's alarm),
    and GRACE more before its worker is killed. Stopped at exit; a forked child starts workers of its own."""

    def __init__(self, workers: int = WORKERS, timeout: float = TIMEOUT):
        self.size, self.timeout = workers, timeout
        self.workers: list[subprocess.Popen] = []
        self.owner = os.getpid()  # after a fork, the workers are the parent's, not this process's
        self.lock = threading.Lock()
        atexit.register(self.close)

    def launch(self) -> subprocess.Popen:
        """A worker process, starting (ready() waits for it)."""
        return subprocess.Popen(
            [sys.executable, "-m", "rloo_utils.math_judge", repr(self.timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # -m imports this rloo_utils, from any cwd
        )

    @staticmethod
    def ready(worker: subprocess.Popen) -> subprocess.Popen:
        """The worker, once it has said it is ready (math-verify imported and warm); else one line why not."""
        line = read_line(worker, time.monotonic() + STARTUP_SECONDS)
        if line != READY:
            stop(worker)
            why = json.loads(line)["error"] if line.startswith("{") else "it ended, or said nothing"
            raise RunError(
                f"accuracy_reward's math-verify worker did not start ({why}): install requirements.txt "
                "(math-verify==0.8.0)"
            )
        return worker

    def judge(self, tasks: list[dict]) -> list[dict]:
        """Each task's reply (judge_task's), or {"unjudged": why} where its worker timed out, was killed at the
        deadline, died, or failed; the tasks spread over the workers, each worker one at a time."""
        if self.owner != os.getpid():  # a forked child: the workers (and a lock held at the fork) are the parent's
            self.workers, self.owner, self.lock = [], os.getpid(), threading.Lock()
        with self.lock:
            if not self.workers:  # started together: each imports math-verify, in parallel
                launched = [self.launch() for _ in range(self.size)]
                try:
                    self.workers = [self.ready(w) for w in launched]
                except BaseException:
                    for worker in launched:
                        stop(worker)
                    raise
            try:
                return self.dispatch(tasks)
            except BaseException:  # (Ctrl-C, a timeout's signal) a busy worker's late reply would answer the next task
                self.close()
                raise

    def dispatch(self, tasks: list[dict]) -> list[dict]:
        """judge's work: each idle worker given the next task, each reply read as it comes, a worker past its task's
        deadline killed and replaced."""
        replies: list[Optional[dict]] = [None] * len(tasks)
        todo = list(range(len(tasks)))[::-1]  # popped from the end: in order
        busy = {}  # worker index -> (task index, deadline)
        while todo or busy:
            for w in range(len(self.workers)):
                if w not in busy and todo:
                    i = todo.pop()
                    if self.send(w, tasks[i]):
                        busy[w] = (i, time.monotonic() + self.timeout + GRACE)
                    else:  # it had died: a new one takes the task
                        todo.append(i)
            if not busy:
                continue
            deadline = min(d for _, d in busy.values())
            by_fd = {self.workers[w].stdout.fileno(): w for w in busy}
            readable, _, _ = select.select(list(by_fd), [], [], max(0.0, deadline - time.monotonic()))
            for fd in readable:
                w = by_fd[fd]
                i, _ = busy.pop(w)
                line = self.workers[w].stdout.readline()
                if line.endswith("\n"):
                    replies[i] = json.loads(line)
                else:  # it ended (a crash; the kernel's CPU limit)
                    replies[i] = {"unjudged": "its worker died"}
                    self.replace(w)
            now = time.monotonic()
            for w, (i, task_deadline) in list(busy.items()):
                if now >= task_deadline:
                    del busy[w]
                    replies[i] = {"unjudged": f"killed after {self.timeout + GRACE:g} s"}
                    self.replace(w)
        return replies

    def send(self, w: int, task: dict) -> bool:
        """The task written to worker w; False (and w replaced) where it had died."""
        try:
            self.workers[w].stdin.write(json.dumps(task) + "\n")
            self.workers[w].stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            self.replace(w)
            return False

    def replace(self, w: int) -> None:
        stop(self.workers[w])
        self.workers[w] = self.ready(self.launch())

    def close(self) -> None:
        """Stops the workers (at exit): they keep no state; a busy one would otherwise spin on."""
        if self.owner == os.getpid():
            for worker in self.workers:
                stop(worker)
            self.workers = []


def read_line(worker: subprocess.Popen, deadline: float) -> str:
    """The worker's next line without its newline; "" where it ended or said nothing by the deadline."""
    readable, _, _ = select.select([worker.stdout], [], [], max(0.0, deadline - time.monotonic()))
    return worker.stdout.readline().rstrip("\n") if readable else ""


def stop(worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait()
    for pipe in (worker.stdin, worker.stdout):
        try:
            pipe.close()
        except OSError:  # (a write buffered for a dead worker)
            pass


@functools.cache
def math_judge() -> MathJudge:
    """The process's judge: its workers start at accuracy_reward's first call, never for a run without it."""
    return MathJudge()


def judge_answers(golds: list[Optional[str]], answers: list[str], judge: MathJudge) -> dict:
    """Each answer judged against its gold answer (None: the row has none). Returns rewards (1.0 / 0.0; None where the
    gold is None, does not parse, or was not judged; 0.0 where the answer was not judged), gold_parsed and
    answer_parsed (what math-verify read, for the completions table), golds (how many distinct ones), unparsed_golds
    (those that hold no answer math-verify reads), unjudged_golds and unjudged_answers ((text, why) of each one past its
    bound, or whose worker died or failed). The
    distinct golds are judged first, so that a gold that hangs costs its bound once and its rows are None."""
    distinct = list(dict.fromkeys(g for g in golds if g is not None))
    gold_replies = dict(zip(distinct, judge.judge([{"gold": g} for g in distinct])))
    scored = [i for i, g in enumerate(golds) if g is not None and gold_replies[g].get("parsed") is not None]
    answer_replies = dict(zip(scored, judge.judge([{"gold": golds[i], "answer": answers[i]} for i in scored])))
    rewards, gold_parsed, answer_parsed = [], [], []
    for i, gold in enumerate(golds):
        reply = answer_replies.get(i)
        if reply is None:  # no gold, or none math-verify reads, or one not judged
            rewards.append(None)
            gold_parsed.append(
                "[no gold]" if gold is None else "[not judged]" if "unjudged" in gold_replies[gold] else "[unparseable]"
            )
            answer_parsed.append("[skipped]")
            continue
        rewards.append(None if "correct" in reply and reply["correct"] is None else float(reply.get("correct", 0.0)))
        gold_parsed.append(gold_replies[gold]["parsed"])
        answer_parsed.append(reply.get("parsed", "[not judged]"))
    return dict(
        rewards=rewards,
        gold_parsed=gold_parsed,
        answer_parsed=answer_parsed,
        golds=len(distinct),
        unparsed_golds=[g for g, r in gold_replies.items() if "parsed" in r and r["parsed"] is None],
        unjudged_golds=[(g, r["unjudged"]) for g, r in gold_replies.items() if "unjudged" in r],
        unjudged_answers=[(answers[i], r["unjudged"]) for i, r in answer_replies.items() if "unjudged" in r],
    )


if __name__ == "__main__":
    serve(float(sys.argv[1]))
