"""The built-in reward function code_reward (open-r1's name): the share of its row's tests a completion's program
passes, each test run in the sandbox (sandbox.py); the two schemas it reads the tests from, open-r1's
`verification_info` (stdin/stdout pairs) and MBPP's `test_list` (assert statements); the program found in the
completion and its output compared. The contract, the schemas with examples, what it refuses: docs/verifiable.md,
"Code: code_reward"."""

import json
import re
import secrets
import signal
from dataclasses import dataclass
from typing import Optional

from rloo_utils.data import message_text
from rloo_utils.errors import UsageError
from rloo_utils.sandbox import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT, Run, Sandbox

OUTCOMES = ("passed", "wrong", "errors", "timeouts", "memory", "output_limit", "no_code")  # what a call counts
TEST_COLUMNS = ("verification_info", "test_list", "test_setup_code", "test_imports")


@dataclass
class RowTest:
    """One test of a row: a program's stdin and the stdout expected of it (open-r1's stdin_stdout case), or code run
    after the program in its namespace (MBPP's assert statement, after the row's set-up code)."""

    input: str = ""
    output: Optional[str] = None  # None: an assert test
    check: Optional[str] = None  # the set-up code and the assert


def absent(value) -> bool:
    """A row's column without a value: None, NaN (a table's empty cell), an empty string, list or dict."""
    return value is None or (isinstance(value, float) and value != value) or (hasattr(value, "__len__") and not value)


def row_tests(
    verification_info=None, test_list=None, test_setup_code=None, test_imports=None
) -> Optional[list[RowTest]]:
    """A row's tests: open-r1's verification_info ({"language": "python", "test_cases": [{"type": "stdin_stdout",
    "input": ..., "output": ...}]}, a dict or its JSON text), then MBPP's test_list (assert statements, each run after
    the row's test_imports and test_setup_code); None where the row has none. A value of another shape, or another
    language than Python, is a mistake in the data: ValueError, naming it."""
    tests = []
    if not absent(verification_info):
        info = verification_info
        if isinstance(info, str):
            try:
                info = json.loads(info)
            except json.JSONDecodeError as e:
                raise ValueError(f"its verification_info is not JSON ({e})") from None
        if not isinstance(info, dict) or not isinstance(info.get("test_cases") or [], list):
            raise ValueError('its verification_info is not {"language": ..., "test_cases": [...]}')
        language = info.get("language") or "python"
        if str(language).lower() not in ("python", "python3", "py"):
            raise ValueError(
                f"its verification_info's language is {language!r}, and code_reward runs Python only: keep the "
                "Python rows (dataset.filter on the language)"
            )
        for case in info.get("test_cases") or []:
            kind = case.get("type") if isinstance(case, dict) else None
            if not isinstance(case, dict) or kind not in (None, "stdin_stdout"):
                raise ValueError(f"a test case of its verification_info is {case!r:.80}, not a stdin_stdout case")
            if not isinstance(case.get("input"), str) or not isinstance(case.get("output"), str):
                raise ValueError("a stdin_stdout case of its verification_info lacks its input or output text")
            tests.append(RowTest(input=case["input"], output=case["output"]))
    if not absent(test_list):
        if not is_list_of_code(test_list):
            raise ValueError(f"its test_list is {test_list!r:.80}, not a list of assert statements")
        imports = [] if absent(test_imports) else test_imports
        if not is_list_of_code(imports, empty_allowed=True):
            raise ValueError(f"its test_imports is {test_imports!r:.80}, not a list of import statements")
        setup = "" if absent(test_setup_code) else test_setup_code
        if not isinstance(setup, str):
            raise ValueError(f"its test_setup_code is {test_setup_code!r:.80}, not code")
        tests += [RowTest(check="\n".join([*imports, *([setup] if setup.strip() else []), test])) for test in test_list]
    return tests or None


def is_list_of_code(value, empty_allowed: bool = False) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) and (v.strip() or empty_allowed) for v in value)


# A fenced block: ``` and an optional language, its code up to the next ``` (an unclosed block, cut by the length limit,
# is not one); the whitespace before the newline is allowed, as some models write "```python "
FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n`]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("python", "python3", "py")


def program_of(completion) -> Optional[str]:
    """The program of a completion (text, or chat messages: the last one's): its last ```python block (or ```py,
    ```python3), else its last block without a language; None where it has neither, or only blank code."""
    blocks = FENCE.findall(message_text(completion))
    python = [code for tag, code in blocks if tag.lower() in PYTHON_TAGS] or [code for tag, code in blocks if not tag]
    return python[-1] if python and python[-1].strip() else None


def output_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def same_output(printed: str, expected: str) -> bool:
    """open-r1's comparison of a program's stdout with the expected output: both stripped, then line by line, each
    line stripped; unlike open-r1's (a zip, which ends at the shorter), a missing or an extra line fails."""
    return output_lines(printed) == output_lines(expected)


def outcome(run: Run, test: RowTest, mark: str) -> str:
    """What a test run counts as: passed; wrong (it ran to its end: a wrong output, or its assert failed); timeouts
    (the wall clock, or the CPU seconds' SIGXCPU); memory (a MemoryError: the address space); output_limit; errors
    (any other failure: an exception, a syntax error, a signal)."""
    if run.status != "exited":
        return {"timeout": "timeouts"}.get(run.status, run.status)
    if run.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # (bwrap exits 128 + the signal of its command)
        return "timeouts"
    last = (run.stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
    if run.returncode == 0:
        if test.output is None:
            passed = run.stdout.endswith(b"\n" + mark.encode() + b"\n")
        else:
            passed = same_output(run.stdout.decode("utf-8", "replace"), test.output)
        return "passed" if passed else "wrong"
    if last.startswith("MemoryError"):
        return "memory"
    return "wrong" if last.startswith("AssertionError") else "errors"


class CodeReward:
    """The reward function code_reward, in TRL's signature: each completion's program (its last ```python block) run
    against its row's tests in the sandbox, one run per test; the share it passed. 0.0 for a completion without code,
    None for a row without tests. Each call logs its counts (log_metric): the test runs passed, wrong, errors,
    timeouts, memory, output_limit, and the completions without code (no_code)."""

    def __init__(
        self,
        sandbox: str = "bwrap",
        timeout: float = DEFAULT_TIMEOUT,
        memory_mb: int = DEFAULT_MEMORY_MB,
        workers: Optional[int] = None,
        python: Optional[str] = None,
    ):
        """Sandbox's options (--code_sandbox, --code_timeout, --code_memory_mb, --code_workers; python: the
        interpreter, None: this one's base); nothing runs before the first call or start()."""
        self.sandbox = Sandbox(sandbox, timeout, memory_mb, workers, python)

    def __call__(
        self,
        completions,
        verification_info=None,
        test_list=None,
        test_setup_code=None,
        test_imports=None,
        log_metric=None,
        **kwargs,
    ) -> list[Optional[float]]:
        n = len(completions)
        columns = [
            [None] * n if c is None else c for c in (verification_info, test_list, test_setup_code, test_imports)
        ]
        rows = [row_tests(*values) for values in zip(*columns)]
        programs = [program_of(c) for c in completions]
        runs = [
            (i, test, secrets.token_hex(16))
            for i, (tests, program) in enumerate(zip(rows, programs))
            if tests and program is not None
            for test in tests
        ]
        jobs = [({"program": programs[i], "check": test.check, "mark": mark}, test.input) for i, test, mark in runs]
        counts = dict.fromkeys(OUTCOMES, 0)
        counts["no_code"] = sum(tests is not None and program is None for tests, program in zip(rows, programs))
        passed = [0] * n
        for (i, test, mark), run in zip(runs, self.sandbox.run_all(jobs)):
            ended = outcome(run, test, mark)
            counts[ended] += 1
            passed[i] += ended == "passed"
        if log_metric is not None:
            for name, count in counts.items():
                log_metric(f"code_reward/{name}", count)
        return [None if tests is None else passed[i] / len(tests) for i, tests in enumerate(rows)]


code_reward = CodeReward()  # with the default options; `rloo_utils/code_reward.py:code_reward` as a file-given reward


def check_code_reward(funcs: list, splits: dict) -> None:
    """Before the models load, where a code_reward is among funcs (the reward functions and evaluation metric
    functions): the tests of every row of each split it scores (splits: {"training": dataset, ...}) read, a row that
    has a mistake refused in one line, and its sandbox started (a tiny program run: refused in one line where the
    machine cannot)."""
    rewards = list(dict.fromkeys(f for f in funcs if isinstance(f, CodeReward)))
    if not rewards:
        return
    for split, dataset in splits.items():
        columns = [c for c in TEST_COLUMNS if c in dataset.column_names]
        if not {"verification_info", "test_list"} & set(columns):
            raise UsageError(
                f"code_reward reads each row's tests from a column verification_info (open-r1's schema) or test_list "
                f"(MBPP's), and the {split} split has neither (its columns: {', '.join(dataset.column_names)}): add "
                "one (docs/verifiable.md)"
            )
        values = [dataset[c] for c in columns]
        scored = 0
        for i, row in enumerate(zip(*values)):
            try:
                scored += row_tests(**dict(zip(columns, row))) is not None
            except ValueError as e:
                raise UsageError(f"row {i} of the {split} split cannot be scored by code_reward: {e}") from None
        if not scored:
            raise UsageError(
                f"no row of the {split} split has tests for code_reward: every {' and '.join(columns)} is empty"
            )
    for reward in rewards:
        reward.sandbox.start()
