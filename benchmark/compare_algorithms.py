"""Compare the advantage estimators and policy losses of rloo.py on one task, over a few seeds.

Every configuration runs the same task with the same seeds and the same settings; only the estimator or the loss
changes. The runs are rloo.py commands handed to benchmark/launch.py's worker pool (--workers at a time, each run's
output in <out>/logs/), with --exp_name the configuration's name and W&B project rloo-compare-<preset>, so that
benchmark/plot.py and openrlbenchmark group them by configuration. They live in <out>/runs/<exp_name>__<seed>; a
finished run (its model saved) is not run again and an interrupted one continues from its newest checkpoint (Ctrl-C
writes one), so an interrupted comparison resumes where it stopped. A run stopped before any checkpoint is run anew as
<exp_name>__<seed>__2 (3, ...). Nothing is ever removed, and other folders in <out>/runs are left alone. With
--results DIR, each finished run's logs (metrics.jsonl, samples.jsonl, args.json, and wall_clock.json: the seconds from
its start to its saved model, as its output says them, and how it ran) are copied to DIR/<run>, a folder small enough to
commit; a run found there counts as finished, so that a fresh clone rebuilds the table from DIR without running again.
--cores pins each worker's runs to one core, one thread (benchmark/launch.py).

The summary is a markdown table: the mean sampled reward of the first and the last --last updates
of each configuration (mean and std over seeds), the held-out evaluation's metric at the end (--eval_metric, where the
runs evaluate: the tiny preset's data has a test split, as the embedded default's), the KL to the reference at the end,
the clip fraction and the minutes of training per run.

    python benchmark/compare_algorithms.py --preset tiny --seeds 1 2 3 4 5  # the test model, "say good" (~10 min)
    python benchmark/compare_algorithms.py --preset smollm2 --seeds 1 2 3   # SmolLM2 and VADER (~2 min per run, 2 CPUs)
    python benchmark/compare_algorithms.py --preset arithmetic --seeds 1 2 3 --eval_metric eval/pass@1  # ~14 min a run

Extra arguments after `--` go to every rloo.py run (`-- --track` logs them to W&B, tagged as launch.py tags).
"""

import argparse
import fcntl
import functools
import glob
import json
import math
import os
import re
import shlex
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
import accuracy_table  # noqa: E402
import launch  # noqa: E402
import plot  # noqa: E402

CONFIGS = {
    "rloo": [],
    "grpo": ["--advantage_estimator", "grpo"],
    "dr_grpo": ["--advantage_estimator", "dr_grpo"],
    "reinforce_pp": ["--advantage_estimator", "reinforce_pp"],
    "token + ppo_clip": ["--loss_type", "token", "--ppo_clip"],
    "cispo": ["--loss_type", "cispo"],
    "gspo": ["--loss_type", "gspo"],
    "sapo": ["--loss_type", "sapo"],
}
# One epoch of two minibatches: the second optimizer step of every update is off-policy, where the losses differ.
COMMON = ["--num_mini_batches", "2"]
PRESETS = {
    # SmolLM2-135M-Instruct answers one-digit arithmetic (data/arithmetic), rewarded by answer_accuracy: the settings of
    # benchmark/experiments/arithmetic_cpu.sh (docs/verifiable.md), its 32 completions an update (4 prompts x 8) in the
    # two minibatches of 16; 40 updates; the held-out evaluation of the 60 test problems (8 samples each: pass@1 and
    # pass@8) before training and every 10 updates; greedy completions of all 60 in the sample tables (greedy pass@1)
    "arithmetic": [
        *("--dataset_name", os.path.join(ROOT, "data", "arithmetic"), "--reward_funcs", "answer_accuracy"),
        *("--max_completion_length", "16", "--num_generations", "8", "--per_device_train_batch_size", "16"),
        *("--total_episodes", "1280", "--learning_rate", "3e-5", "--beta", "0.02"),
        *("--eval_steps", "10", "--num_generations_eval", "8", "--eval_success_threshold", "1"),
        *("--num_sample_prompts", "60"),
    ],
    # SmolLM2-135M-Instruct writes movie-review continuations, VADER sentiment reward (the embedded default, shorter).
    "smollm2": [
        "--num_sample_generations",
        "0",
        "--total_episodes",
        "192",
        "--per_device_train_batch_size",
        "8",
        "--max_completion_length",
        "16",
        "--learning_rate",
        "3e-5",
    ],
    # The ~0.4M-parameter test model learns to say "good" (the reward of tests/test_end_to_end.py's learning test).
    "tiny": [
        "--num_sample_generations",
        "0",
        "--total_episodes",
        "1280",
        "--per_device_train_batch_size",
        "16",
        "--max_completion_length",
        "8",
        "--learning_rate",
        "3e-3",
        "--beta",
        "0",
        "--reward_funcs",
        os.path.join(ROOT, "tests", "reward_fixtures.py:count_good"),
    ],
}


def tiny_setup(out: str) -> list[str]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import WORDS, build_tiny_models, write_jsonl

    import random

    if not os.path.exists(os.path.join(out, "tiny", "policy")):
        build_tiny_models(os.path.join(out, "tiny"))
    rng = random.Random(1)
    for split, size in [("train", 64), ("test", 16)]:  # the test split: the held-out evaluation's prompts
        write_jsonl(
            os.path.join(out, "tiny", "data", f"{split}.jsonl"),
            [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))} for _ in range(size)],
        )
    return [
        "--model_name_or_path",
        os.path.join(out, "tiny", "policy"),
        "--dataset_name",
        os.path.join(out, "tiny", "data"),
    ]


def label(name: str) -> str:
    """The configuration's --exp_name: "token + ppo_clip" -> "token_ppo_clip"."""
    return name.replace(" + ", "_")


def is_saved_model(folder: str) -> bool:
    """is_saved_model: a full model, its shards with their index, or a LoRA adapter."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from rloo_utils.checkpoints import is_saved_model

    return is_saved_model(folder)


LOGS = ("metrics.jsonl", "samples.jsonl", "args.json")  # what --results keeps of a run: its numbers, not its model
SAVED = re.compile(r"saved the trained model to .* \((\d+) s\)")  # the last line of a run's output (rloo.py)


def recorded(results: str | None, name: str) -> str | None:
    """The run of one configuration and seed kept in --results (name or an attempt name__N), else None."""
    if results is None or not os.path.isdir(results):
        return None
    kept = [r for r in os.listdir(results) if re.fullmatch(re.escape(name) + r"(__\d+)?", r)]
    return next((r for r in sorted(kept) if os.path.isfile(os.path.join(results, r, "metrics.jsonl"))), None)


def keep_logs(out: str, run: str, results: str, how: dict) -> None:
    """Copy a finished run's logs from out/runs/run to results/run, with wall_clock.json: the seconds its output says
    it took from its start to its saved model (a resumed run's count as if it had never stopped) and how it ran."""
    outputs = sorted(glob.glob(os.path.join(out, "logs", f"{glob.escape(run)}*.log")), key=os.path.getmtime)
    said = [m for log in outputs for m in SAVED.finditer(open(log, errors="replace").read())]
    keep = os.path.join(results, run)
    os.makedirs(keep, exist_ok=True)
    for name in LOGS:
        if os.path.isfile(os.path.join(out, "runs", run, name)):
            shutil.copy2(os.path.join(out, "runs", run, name), os.path.join(keep, name))
    with open(os.path.join(keep, "wall_clock.json"), "w") as f:
        json.dump({"seconds": int(said[-1].group(1)) if said else None, **how}, f)


def keep_finished(out: str, runs: dict, results: str | None, how: dict, ran_now: set) -> None:
    """keep_logs of every run in runs ({(configuration, seed): run name}) that has finished and is not kept yet: how
    they ran for those this comparison ran (ran_now), else nothing said (an earlier comparison ran them)."""
    for run in runs.values():
        if results and not recorded(results, run) and run_state(out, run)[1] == "finished":
            keep_logs(out, run, results, how if run in ran_now else {})


def keep_ended(out: str, results: str | None, how: dict, run: dict, code: int) -> None:
    """launch.run_all's ended: a run that finished has its logs kept at once (keep_finished)."""
    keep_finished(out, {(run["name"],): run["name"]}, results, how, {run["name"]})


def run_state(out: str, name: str) -> tuple[str, str]:
    """(run name, state) of the newest attempt at one configuration and seed, in out/runs: state "new" (no attempt yet,
    or the newest stopped before its first checkpoint: the name is a new attempt's), "finished" (its model saved) or
    "interrupted" (a checkpoint to continue from: a tmp-checkpoint-<update> is a save that never ended). A run still
    running is an error: two comparisons in one --out."""
    attempt, run = 1, name
    while os.path.exists(os.path.join(out, "runs", f"{name}__{attempt + 1}")):
        attempt, run = attempt + 1, f"{name}__{attempt + 1}"
    folder = os.path.join(out, "runs", run)
    if not os.path.exists(folder):
        return run, "new"
    if os.path.exists(lock := os.path.join(folder, ".lock")):
        with open(lock) as f:
            try:  # the run's process holds this lock while it runs
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                sys.exit(
                    f"compare_algorithms.py: error: {folder} is still running (another comparison in this --out?): "
                    "wait for it, or give another --out"
                )
    model = os.path.join(folder, "model")  # made when the run starts (its claim); the model is in it at the end
    # the tokenizer is saved after the weights: with it, the save has ended
    if is_saved_model(model) and os.path.isfile(os.path.join(model, "tokenizer_config.json")):
        return run, "finished"
    checkpoints = os.path.join(folder, "checkpoints")
    if any(re.fullmatch(r"checkpoint-\d+", c) for c in (os.listdir(checkpoints) if os.path.isdir(checkpoints) else [])):
        return run, "interrupted"
    return f"{name}__{attempt + 1}", "new"


def mean_std(values: list[float]) -> str:
    if any(math.isnan(v) for v in values):
        return "n/a"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"compare_algorithms.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--workers", type=int, default=1, help="runs at once")
    parser.add_argument(
        "--cores", type=int, nargs="+", default=None, help="pin each worker to one of these cores, one thread"
    )
    parser.add_argument(
        "--results", default=None, help="keep each finished run's logs here (a run kept here counts as finished)"
    )
    parser.add_argument("--last", type=int, default=3, help="updates averaged at the start and at the end of a run")
    parser.add_argument(
        "--eval_metric", default="eval/reward", help="the held-out metric reported, at the last evaluation"
    )
    parser.add_argument("--out", default=None, help="folder of the runs; default runs/compare_<preset>")
    parser.add_argument("rloo_args", nargs="*", help="more arguments for every rloo.py run (after --)")
    cli = parser.parse_args()
    if cli.workers < 1 or cli.last < 1:
        parser.error(f"--workers and --last must be at least 1, got {cli.workers} and {cli.last}")
    if min(cli.seeds) < 0:  # the trainers' seeds seed numpy's SeedSequence, which takes no negative number
        parser.error(f"--seeds must be 0 or more, got {min(cli.seeds)}")
    if len(set(cli.seeds)) < len(cli.seeds):
        parser.error(f"--seeds {' '.join(map(str, cli.seeds))} names a seed twice: give each seed once")
    if given := [
        w
        for w in cli.rloo_args
        if w.split("=")[0] in ("--seed", "--exp_name", "--run_name", "--resume_from_checkpoint")
    ]:
        parser.error(f"{given[0].split('=')[0]} after -- is the comparison's to set: use --seeds, or leave it out")
    try:
        launch.check_cores(cli.cores, cli.workers)
    except ValueError as e:
        parser.error(str(e))
    if cli.results and os.path.exists(cli.results) and not os.path.isdir(cli.results):  # found now, not at a run's end
        parser.error(f"--results {cli.results} is a file, not a folder: give another --results")
    out = os.path.abspath(cli.out or os.path.join("runs", f"compare_{cli.preset}"))
    try:
        os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    except OSError as e:  # --out a file, or a folder that cannot be written
        parser.error(f"cannot make {e.filename} ({e.strerror}): give another --out")
    base = [
        *COMMON,
        *PRESETS[cli.preset],
        *(tiny_setup(out) if cli.preset == "tiny" else []),
        *cli.rloo_args,
        "--wandb_project_name",
        f"rloo-compare-{cli.preset}",
    ]
    runs, pending = {}, []  # runs: {(configuration, seed): run name}
    results = os.path.abspath(cli.results) if cli.results else None
    how = {"workers": cli.workers, "pinned": cli.cores is not None, "cpus": os.cpu_count()}
    for name in cli.configs:
        command = shlex.join(
            [sys.executable, os.path.join(ROOT, "rloo.py"), *base, *CONFIGS[name], "--exp_name", label(name)]
        )
        for seed in cli.seeds:
            if kept := recorded(results, f"{label(name)}__{seed}"):
                runs[name, seed] = kept
                continue
            run, state = run_state(out, f"{label(name)}__{seed}")
            runs[name, seed] = run
            if state != "finished":  # a new run, or the interrupted one continued from its newest checkpoint
                more = " --resume_from_checkpoint latest" if state == "interrupted" else ""
                pending.append(
                    {"name": run, "seed": seed, "command": f"{command} --run_name {run}{more} --seed {seed}"}
                )
    keep_finished(
        out, runs, results, how, set()
    )  # finished before and not kept yet (a comparison stopped, no --results)
    if pending:
        os.chdir(out)  # the runs write out/runs/<run name>
        tags = launch.wandb_tags(None, os.environ.get("WANDB_TAGS", ""), launch.git_tag())
        try:
            ended = functools.partial(keep_ended, out, results, how)  # each run's logs kept as it finishes
            codes = launch.run_all(pending, cli.workers, os.path.join(out, "logs"), tags, cli.cores, ended)
        except KeyboardInterrupt:  # the runs got Ctrl-C too, and wrote a checkpoint each
            keep_finished(out, runs, results, how, {run["name"] for run in pending})
            print(
                "compare_algorithms.py: error: interrupted; the runs stopped with a checkpoint: the same command "
                "continues them",
                file=sys.stderr,
            )
            sys.exit(130)
        keep_finished(out, runs, results, how, {run["name"] for run in pending})
        if failed := [run for run, code in zip(pending, codes) if code]:
            sys.exit(f"compare_algorithms.py: error: {len(failed)} runs failed: see {failed[0]['log']}")
    folder = {
        key: os.path.join(results if recorded(results, run) else os.path.join(out, "runs"), run)
        for key, run in runs.items()
    }
    finished = {key: plot.load_run(path) for key, path in folder.items()}
    evaluated = any(cli.eval_metric in row for run in finished.values() for row in run["rows"])

    print(
        f"| configuration | flags | reward, first {cli.last} updates | reward, last {cli.last} updates | "
        + (f"{cli.eval_metric}, last evaluation | " if evaluated else "")
        + "kl at the end | clip fraction | minutes per run |"
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if evaluated else ""))
    for name in cli.configs:
        first, last, held_out, kl, clipped, minutes = [], [], [], [], [], []
        for seed in cli.seeds:
            rows = [r for r in finished[name, seed]["rows"] if "episode" in r]  # the updates' rows
            first.append(statistics.mean(r["reward"] for r in rows[: cli.last]))
            last.append(statistics.mean(r["reward"] for r in rows[-cli.last :]))
            evaluations = [r[cli.eval_metric] for r in finished[name, seed]["rows"] if cli.eval_metric in r]
            held_out.append(evaluations[-1] if evaluations else math.nan)
            numbers = accuracy_table.training_numbers(folder[name, seed])
            kl.append(numbers["kl"])  # nan with --beta 0
            clipped.append(numbers["clip"])
            minutes.append(numbers["minutes"])
        print(
            f"| {name} | `{' '.join(CONFIGS[name]) or '(defaults)'}` | {mean_std(first)} | {mean_std(last)} | "
            + (f"{mean_std(held_out)} | " if evaluated else "")
            + f"{mean_std(kl)} | {statistics.mean(clipped):.3f} | {statistics.mean(minutes):.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
