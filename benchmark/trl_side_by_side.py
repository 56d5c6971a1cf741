"""rloo.py and Hugging Face TRL's RLOOTrainer on the same work, one after the other in one invocation: seconds per
update, peak memory and the reward curve of each, their ratio, and a PNG of the two curves.

    python benchmark/trl_side_by_side.py --preset tiny --quick --output trl_tiny.png   # the test model, 6 updates
    python benchmark/trl_side_by_side.py --preset smollm2 --output trl_smollm2.png     # SmolLM2, VADER, 40 updates

TRL runs in a virtual environment of its own (--trl_python, default .venv-trl/bin/python; the setup is in
benchmark/trl_baseline.py's docstring and in the README's test command): TRL 1.16 needs a newer transformers than
requirements.txt pins. Both get the same model (fp32), prompts, reward, 8 completions per update (4 prompts x 2), up
to 64 tokens stopping at EOS, temperature 1, beta 0.05, one optimizer step per update, no gradient checkpointing and
the same --seed (their random streams differ all the same, so their samples do too): the smollm2 preset is
SmolLM2-135M-Instruct on data/movie_reviews with the VADER reward (lr 3e-5, the embedded default's); the
tiny preset is the tests' ~0.4M-parameter model learning to say "good" (lr 3e-3).
Seconds per update are the mean after the first (warm-up); peak memory is the highest resident set of the training
process, read from /proc while it runs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
from multigpu_timing import peak_rss_gib  # noqa: E402
from vllm_timing import hf_folder  # noqa: E402

PRESETS = {  # (prompts, reward of rloo.py, the same reward in trl_baseline.py, learning rate)
    "smollm2": (os.path.join(ROOT, "data", "movie_reviews", "train.jsonl"), "vader_sentiment", "vader", "3e-5"),
    "tiny": (None, os.path.join(ROOT, "tests", "reward_fixtures.py") + ":count_good", "count_good", "3e-3"),
}


def watch(command: list[str], cwd: str, log: str) -> tuple[float, float]:
    """Run a command to its end, its output into log: (wall seconds, peak resident GiB of its process)."""
    start, peak = time.perf_counter(), 0.0
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"},
        )
        while proc.poll() is None:
            peak = max(peak, peak_rss_gib(proc.pid))
            time.sleep(0.1)
    if proc.returncode:
        with open(log) as f:
            sys.exit(
                f"trl_side_by_side.py: error: {' '.join(command[:2])} failed (exit {proc.returncode}); "
                f"the end of its output: {f.read()[-500:]!r}"
            )
    return time.perf_counter() - start, peak


def tiny_data(workdir: str) -> tuple[str, str]:
    """The test model and 64 prompts of its words."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import random

    from conftest import WORDS, write_jsonl

    rng = random.Random(1)
    data = write_jsonl(
        os.path.join(workdir, "prompts.jsonl"),
        [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))} for _ in range(64)],
    )
    return hf_folder("tiny", workdir), data


def draw(curves: dict[str, list[tuple[int, float]]], title: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
    ax.set_xlabel("episode")
    ax.set_ylabel("mean reward of the sampled completions")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"trl_side_by_side.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="6 updates")
    parser.add_argument("--seed", type=int, default=1, help="both trainers' seed")
    parser.add_argument("--trl_python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    parser.add_argument("--output", required=True, help="the PNG of the two reward curves")
    cli = parser.parse_args(argv)
    updates = 6 if cli.quick else cli.updates
    if updates < 2:
        parser.error("--updates must be at least 2 (the first is dropped from the timing)")
    if not os.access(cli.trl_python, os.X_OK):
        parser.error(
            f"--trl_python {cli.trl_python} is not there: make TRL's environment as benchmark/trl_baseline.py "
            "says, or give its python"
        )
    probe = subprocess.run([cli.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode:
        parser.error(f"--trl_python {cli.trl_python} cannot import trl: pip install trl==1.16.0 there")
    if os.path.exists(cli.output) or not cli.output.lower().endswith(".png"):
        parser.error(f"--output {cli.output} must be a new .png file")
    try:  # its folder now, not after both runs
        os.makedirs(os.path.dirname(os.path.abspath(cli.output)), exist_ok=True)
    except OSError as e:
        parser.error(f"--output {cli.output}: its folder cannot be made ({e.strerror}); give a writable path")

    data, rloo_reward, trl_reward, lr = PRESETS[cli.preset]
    with tempfile.TemporaryDirectory() as workdir:
        model, data = tiny_data(workdir) if cli.preset == "tiny" else (hf_folder("smollm2", workdir), data)
        rloo_command = [
            sys.executable,
            os.path.join(ROOT, "rloo.py"),
            "--model_name_or_path",
            model,
            "--dataset_name",
            data,
            "--reward_funcs",
            rloo_reward,
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "8",
            "--max_completion_length",
            "64",
            "--beta",
            "0.05",
            "--learning_rate",
            lr,
            "--temperature",
            "1.0",
            "--num_sample_generations",
            "0",
            "--total_episodes",
            str(8 * updates),
            "--seed",
            str(cli.seed),
            "--run_name",
            "rloo",
        ]
        trl_command = [
            cli.trl_python,
            os.path.join(ROOT, "benchmark", "trl_baseline.py"),
            "--model_dir",
            model,
            "--dataset",
            data,
            "--reward",
            trl_reward,
            "--learning_rate",
            lr,
            "--max_steps",
            str(updates),
            "--gradient_checkpointing",
            "false",
            "--seed",
            str(cli.seed),
            "--output_dir",
            os.path.join(workdir, "trl"),
            "--log_file",
            os.path.join(workdir, "trl.jsonl"),
        ]
        results = {}
        for name, command in (("rloo.py", rloo_command), (f"TRL {probe.stdout.strip()} RLOOTrainer", trl_command)):
            print(f"running {name} ...", flush=True)
            wall, peak = watch(command, workdir, os.path.join(workdir, f"{len(results)}.log"))
            metrics = (
                os.path.join(workdir, "runs", "rloo", "metrics.jsonl")
                if not results
                else os.path.join(workdir, "trl.jsonl")
            )
            with open(metrics) as f:
                rows = [row for row in map(json.loads, f) if "eval/reward" not in row]  # (not our evaluations)
            seconds = [r["time/update"] if "time/update" in r else r["seconds"] for r in rows]
            results[name] = {"rows": rows, "seconds": statistics.mean(seconds[1:]), "peak": peak, "wall": wall}

    (ours, theirs) = results
    last = max(1, updates // 4)
    print(
        f"\npreset {cli.preset}, seed {cli.seed}: {updates} updates of 8 completions; "
        f"seconds per update = mean of updates 2-{updates}"
    )
    print(f"{'':<34}{ours:>14}{theirs:>28}{'TRL / rloo.py':>16}")
    lines = [
        ("seconds per update", lambda r: r["seconds"], ".2f"),
        ("peak memory (GiB)", lambda r: r["peak"], ".2f"),
        (f"reward, first {last} updates", lambda r: statistics.mean(x["reward"] for x in r["rows"][:last]), ".3f"),
        (f"reward, last {last} updates", lambda r: statistics.mean(x["reward"] for x in r["rows"][-last:]), ".3f"),
        (
            f"tokens per completion, first {last}",
            lambda r: statistics.mean(x["completions/mean_length"] for x in r["rows"][:last]),
            ".1f",
        ),
        (
            f"tokens per completion, last {last}",
            lambda r: statistics.mean(x["completions/mean_length"] for x in r["rows"][-last:]),
            ".1f",
        ),
        ("whole run, wall (s)", lambda r: r["wall"], ".1f"),
    ]
    for label, value, fmt in lines:
        a, b = value(results[ours]), value(results[theirs])
        ratio = f"{b / a:.2f}" if label.startswith(("seconds", "peak", "whole")) and a else "-"  # the rest as curves
        print(f"{label:<34}{a:>14{fmt}}{b:>28{fmt}}{ratio:>16}")
    draw(
        {name: [(r["episode"], r["reward"]) for r in result["rows"]] for name, result in results.items()},
        f"{cli.preset}: reward per update, seed {cli.seed}",
        cli.output,
    )
    print(f"wrote {cli.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
