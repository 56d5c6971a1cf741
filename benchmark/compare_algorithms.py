"""Compare the advantage estimators and policy losses of rloo.py on one task, over a few seeds.

Every configuration runs the same task with the same seeds and the same settings; only the estimator or the loss
changes. Each run is rloo.py as a subprocess; its metrics.jsonl is kept under --out, and a finished run is not run
again, so an interrupted comparison resumes where it stopped. The summary is a markdown table: the mean sampled
reward of the first and the last --last updates of each run (mean and std over seeds), the KL to the reference at the
end, the clip fraction and the minutes per run.

    python benchmark/compare_algorithms.py --preset tiny --seeds 1 2 3 4 5  # the test model, a "say good" reward (~10 min)
    python benchmark/compare_algorithms.py --preset smollm2 --seeds 1 2 3   # SmolLM2 and VADER (~2 min per run, 2 CPUs)

Extra arguments after `--` go to every rloo.py run.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
COMMON = ["--num_mini_batches", "2", "--num_sample_generations", "0"]
PRESETS = {
    # SmolLM2-135M-Instruct writes movie-review continuations, VADER sentiment reward (the embedded default, shorter).
    "smollm2": ["--total_episodes", "192", "--per_device_train_batch_size", "8", "--max_completion_length", "16",
                "--learning_rate", "3e-5"],
    # The ~0.4M-parameter test model learns to say "good" (the reward of tests/test_end_to_end.py's learning test).
    "tiny": ["--total_episodes", "1280", "--per_device_train_batch_size", "16", "--max_completion_length", "8",
             "--learning_rate", "3e-3", "--beta", "0",
             "--reward_funcs", os.path.join(ROOT, "tests", "reward_fixtures.py:count_good")],
}


def tiny_setup(out: str) -> list[str]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import WORDS, build_tiny_models, write_jsonl

    import random

    if not os.path.exists(os.path.join(out, "tiny", "policy")):
        build_tiny_models(os.path.join(out, "tiny"))
    rng = random.Random(1)
    data = write_jsonl(os.path.join(out, "tiny", "prompts.jsonl"),
                       [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))} for _ in range(64)])
    return ["--model_name_or_path", os.path.join(out, "tiny", "policy"), "--dataset_name", data]


def run(name: str, seed: int, argv: list[str], out: str) -> tuple[list[dict], float]:
    """Run one configuration and seed (unless already done): its rows of metrics.jsonl and its seconds."""
    run_dir = os.path.join(out, name.replace(" + ", "_"), f"seed{seed}")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(os.path.join(run_dir, "done")):
        shutil.rmtree(run_dir, ignore_errors=True)  # what an interrupted attempt left: rloo.py would not overwrite it
        os.makedirs(run_dir)
        start = time.time()
        with open(os.path.join(run_dir, "log.txt"), "w") as log:
            subprocess.run([sys.executable, os.path.join(ROOT, "rloo.py"), *argv, "--seed", str(seed), "--exp_name", "run",
                            "--output_dir", os.path.join(run_dir, "model")], cwd=run_dir, check=True, stdout=log,
                           stderr=subprocess.STDOUT)
        (run_name,) = os.listdir(os.path.join(run_dir, "runs"))
        os.replace(os.path.join(run_dir, "runs", run_name, "metrics.jsonl"), metrics)
        with open(os.path.join(run_dir, "done"), "w") as f:
            f.write(f"{time.time() - start:.1f}\n")
    with open(metrics) as f, open(os.path.join(run_dir, "done")) as done:
        return [json.loads(line) for line in f], float(done.read())


def mean_std(values: list[float]) -> str:
    if any(math.isnan(v) for v in values):
        return "n/a"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--last", type=int, default=3, help="updates averaged at the start and at the end of a run")
    parser.add_argument("--out", default=None, help="folder of the runs; default runs/compare_<preset>")
    parser.add_argument("rloo_args", nargs="*", help="more arguments for every rloo.py run (after --)")
    cli = parser.parse_args()
    out = os.path.abspath(cli.out or os.path.join("runs", f"compare_{cli.preset}"))
    base = [*COMMON, *PRESETS[cli.preset], *(tiny_setup(out) if cli.preset == "tiny" else []), *cli.rloo_args]

    print(f"| configuration | flags | reward, first {cli.last} updates | reward, last {cli.last} updates | "
          f"kl at the end | clip fraction | minutes per run |")
    print("|---|---|---|---|---|---|---|")
    for name in cli.configs:
        first, last, kl, clipped, minutes = [], [], [], [], []
        for seed in cli.seeds:
            rows, seconds = run(name, seed, base + CONFIGS[name], out)
            first.append(statistics.mean(r["reward"] for r in rows[:cli.last]))
            last.append(statistics.mean(r["reward"] for r in rows[-cli.last:]))
            kl.append(rows[-1].get("kl", math.nan))  # absent with --beta 0
            clipped.append(statistics.mean(r["clip_ratio/region_mean"] for r in rows))
            minutes.append(seconds / 60)
        print(f"| {name} | `{' '.join(CONFIGS[name]) or '(defaults)'}` | {mean_std(first)} | {mean_std(last)} | "
              f"{mean_std(kl)} | {statistics.mean(clipped):.3f} | {statistics.mean(minutes):.1f} |", flush=True)


if __name__ == "__main__":
    main()
