"""Completions scored per second by code_reward, its bubblewrap sandbox beside the rlimits-only mode, in one run:
the toy problems of data/code_toy (3 tests each), half of the completions their reference solution, a quarter a wrong
answer, a quarter a program that raises; each test run a process of its own. docs/verifiable.md, "Code: code_reward".

    python benchmark/sandbox_speed.py                                  # 100 completions, 3 rounds, 1 and 2 workers
    python benchmark/sandbox_speed.py --python /usr/bin/python3        # as root: an interpreter nobody can run

Each round scores the same completions in each mode and with each number of workers, in turn; the table has each
one's median over the rounds (completions and test runs per second, and a run's mean milliseconds), and the JSON file
(--out) every round's seconds. As root the rlimits mode runs the code as nobody, who must be able to run the
interpreter (pyenv's under /root is private: --python /usr/bin/python3, for both modes alike).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rloo_utils.code_reward import CodeReward, row_tests  # noqa: E402
from rloo_utils.errors import UsageError  # noqa: E402

MODES = ("bwrap", "rlimits")


def toy_problems() -> list[dict]:
    rows = []
    for split in ("train", "test"):
        with open(os.path.join(ROOT, "data", "code_toy", f"{split}.jsonl")) as f:
            rows += [json.loads(line) for line in f]
    return rows


def workload(num_completions: int) -> tuple[list[str], dict]:
    """The completions (in turn: right, right, wrong, raising) and their rows' test columns, over the toy problems."""
    problems = toy_problems()
    completions, columns = [], {"verification_info": [], "test_list": []}
    for i in range(num_completions):
        row = problems[i % len(problems)]
        program = [row["solution"], row["solution"], "print('wrong')\n", "raise ValueError('no')\n"][i % 4]
        completions.append(f"Here is my solution:\n```python\n{program}```\n")
        for name in columns:
            columns[name].append(row.get(name))
    return completions, columns


def measure(mode: str, workers: int, python, completions: list[str], columns: dict) -> dict:
    """One scoring of the completions: seconds, and the counts the call logged."""
    reward = CodeReward(mode, workers=workers, python=python)
    reward.sandbox.start()  # the probe and the pool, outside the timing
    counts = {}
    start = time.perf_counter()
    rewards = reward(completions, **columns, log_metric=lambda name, value: counts.__setitem__(name, value))
    seconds = time.perf_counter() - start
    reward.sandbox.pool.shutdown()
    return {"seconds": seconds, "mean_reward": sum(rewards) / len(rewards), "counts": counts}


def main(cli) -> dict:
    completions, columns = workload(cli.completions)
    runs = sum(len(row_tests(*row)) for row in zip(columns["verification_info"], columns["test_list"]))
    results = {f"{mode}, {w} worker{'s' * (w > 1)}": [] for mode in MODES for w in cli.workers}
    load_before = os.getloadavg()[0]  # other work on the machine slows every row alike: said beside the table
    for _ in range(cli.rounds):
        for mode in MODES:
            for w in cli.workers:
                results[f"{mode}, {w} worker{'s' * (w > 1)}"].append(measure(mode, w, cli.python, completions, columns))
    print(
        f"code_reward on {cli.completions} completions x 3 tests ({runs} test runs), median of {cli.rounds} rounds, "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), {time.strftime('%Y-%m-%d')}, load "
        f"average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after"
    )
    print(f"| {'sandbox':<22} | completions/s | test runs/s | ms a run | mean reward |")
    print(f"|{'-' * 24}|---------------|-------------|----------|-------------|")
    table = {}
    for name, rounds in results.items():
        seconds = statistics.median(r["seconds"] for r in rounds)
        workers = int(name.split(", ")[1].split()[0])
        table[name] = {
            "seconds": seconds,
            "completions_per_second": cli.completions / seconds,
            "test_runs_per_second": runs / seconds,
            "ms_per_run": 1000 * seconds * workers / runs,
            "mean_reward": rounds[0]["mean_reward"],
        }
        row = table[name]
        print(
            f"| {name:<22} | {row['completions_per_second']:>13.1f} | {row['test_runs_per_second']:>11.1f} | "
            f"{row['ms_per_run']:>8.1f} | {row['mean_reward']:>11.3f} |"
        )
    record = {
        "completions": cli.completions,
        "test_runs": runs,
        "rounds": cli.rounds,
        "cores": os.cpu_count(),
        "python": cli.python,
        "date": time.strftime("%Y-%m-%d"),
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "table": table,
        "every_round": results,
    }
    if cli.out:
        os.makedirs(os.path.dirname(os.path.abspath(cli.out)), exist_ok=True)
        with open(cli.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"written to {cli.out}")
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"sandbox_speed.py: error: {message}")  # one line, no usage block
    parser.add_argument("--completions", type=int, default=100, help="completions scored (3 tests each)")
    parser.add_argument("--rounds", type=int, default=3, help="times each mode scores them; the median is shown")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="test runs at once, each in turn")
    parser.add_argument("--python", default=None, help="the interpreter that runs the code (default: this one's base)")
    parser.add_argument(
        "--out",
        default=os.path.join(ROOT, "benchmark", "results", "sandbox_speed_cpu.json"),
        help="the JSON file written (empty: none)",
    )
    cli = parser.parse_args(argv)
    if cli.completions < 1 or cli.rounds < 1 or min(cli.workers) < 1:
        parser.error("--completions, --rounds and --workers must be 1 or more")
    return cli


if __name__ == "__main__":
    try:
        main(parse_args())
    except UsageError as e:
        sys.exit(f"sandbox_speed.py: error: {e}")
