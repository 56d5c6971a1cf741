"""TRL 1.16's RLOOTrainer on the arithmetic task of compare_algorithms.py --preset arithmetic, its held-out accuracy
measured by rloo.py's own evaluation: a run folder per seed that compare_algorithms.py, accuracy_table.py and plot.py
read as they read rloo.py's.

    python benchmark/trl_arithmetic.py --seeds 1 2 3 --results benchmark/results/compare_arithmetic --core 1

Per seed, benchmark/trl_baseline.py trains in TRL's environment (--trl_python; its setup is in trl_baseline.py) with
the preset's settings where TRL has them: SmolLM2-135M-Instruct (the GGUF file rloo.py reads, de-quantised to float32),
data/arithmetic's train prompts, rloo_utils/verifiable.py's answer_accuracy, 8 completions of each of 4 prompts an
update, up to 16 tokens stopping at EOS, temperature 1, one pass in two optimizer steps of 16 (TRL's
steps_per_generation 2, rloo.py's --num_mini_batches 2), learning rate 3e-5 decaying linearly to 0, beta 0.02, clip 0.2,
gradient norm clipped at 1, the --seed; the model saved every 10 updates. What differs is TRL's own: the order in which
it draws prompts, its random streams, and its trainer around the same loss (docs/algorithm.md, Comparison).
Then the initial model and each saved one are evaluated here by rloo_utils/evaluation.py's Evaluator with the preset's
options and the random streams rloo.py's evaluation uses after that update: a greedy sample table of the 60 test
problems and 8 samples of each (pass@1, pass@8). <out>/runs/trl__<seed> holds metrics.jsonl: each update's row, from
TRL's logs of its two steps (the generation's reward and lengths; the two steps' mean of kl, clip_ratio/region_mean,
entropy, loss and grad_norm), and the evaluations as eval/; samples.jsonl; args.json; wall_clock.json: the seconds of
training and of evaluation. A finished run (kept in --results, or its folder's wall_clock.json) is not run again (with
every seed kept in --results, neither TRL's environment nor the model is needed); an unfinished one is run again from
its start. --core pins this script, TRL's training under it, to one core, one thread.
"""

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
sys.path.insert(0, ROOT)
import compare_algorithms  # noqa: E402
import launch  # noqa: E402

PRESET = [*compare_algorithms.COMMON, *compare_algorithms.PRESETS["arithmetic"]]
EVALUATE_EVERY = 10  # updates, the preset's --eval_steps
# TRL logs these on each optimizer step: an update's value is the mean of its two
STEP_MEANS = ["kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy", "loss"]


def preset_value(name: str) -> str:
    return PRESET[PRESET.index(name) + 1]


def trl_command(trl_python: str, model: str, seed: int, folder: str) -> list[str]:
    """trl_baseline.py with the preset's settings (updates of per_device x num_mini_batches completions, each in
    num_mini_batches optimizer steps), saving the model every EVALUATE_EVERY updates."""
    steps = int(preset_value("--num_mini_batches"))
    batch = int(preset_value("--per_device_train_batch_size")) * steps
    updates = int(preset_value("--total_episodes")) // batch
    return [
        *(trl_python, os.path.join(ROOT, "benchmark", "trl_baseline.py"), "--model_dir", model),
        *("--dataset", os.path.join(preset_value("--dataset_name"), "train.jsonl"), "--reward", "answer_accuracy"),
        *("--num_generations", preset_value("--num_generations"), "--steps_per_generation", str(steps)),
        *("--per_device_train_batch_size", preset_value("--per_device_train_batch_size")),
        *("--max_completion_length", preset_value("--max_completion_length")),
        *("--learning_rate", preset_value("--learning_rate"), "--beta", preset_value("--beta")),
        *("--max_steps", str(updates * steps), "--save_steps", str(EVALUATE_EVERY * steps)),
        *("--gradient_checkpointing", "false", "--seed", str(seed)),
        *("--output_dir", os.path.join(folder, "trl"), "--log_file", os.path.join(folder, "trl_steps.jsonl")),
    ]


def update_rows(steps: list[dict], steps_per_update: int) -> list[dict]:
    """One row per update from trl_baseline.py's --log_file rows (one per optimizer step): the first step's generation
    (episode, reward, lengths: TRL logs them where it generates), the mean of STEP_MEANS over the update's steps."""
    rows = []
    for first in range(0, len(steps), steps_per_update):
        update = steps[first : first + steps_per_update]
        generated = update[0]["trl"]
        row = {"episode": update[-1]["episode"], "global_step": first + steps_per_update}
        row.update({k: v for k, v in generated.items() if k.startswith(("reward", "completions/", "frac_"))})
        row["num_tokens"] = generated["num_tokens"]
        for name in STEP_MEANS:
            values = [s["trl"][name] for s in update if s["trl"].get(name) is not None]
            if values:
                row[name] = sum(values) / len(values)
        row["time/update"] = sum(s["seconds"] for s in update)
        rows.append(row)
    return rows


def evaluate(model: str, seed: int, update: int, folder: str, logger):
    """rloo.py's greedy sample table and held-out evaluation of one saved model after `update`, into logger (opened
    once per run: logs.open_logger) or, with logger None, a new one on folder: (the logger, seconds)."""
    import torch
    import tyro

    from rich.console import Console

    import rloo
    from rloo_utils import evaluation, logs, rollouts, set_up
    from rloo_utils.scoring import Scorer, TrainerState

    start = time.perf_counter()
    argv = [*PRESET, "--model_name_or_path", model, "--seed", str(seed), "--beta", "0", "--exp_name", "trl"]
    args = rloo.resolve_defaults(tyro.cli(rloo.Args, args=argv, use_underscores=True))  # beta 0: no reference
    plan = set_up.plan_run(args)
    device = torch.device("cpu")
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731 (rloo.py's, without --bf16)
    console = Console()
    models = set_up.load_models(args, plan, device)
    sampler = rollouts.HFSampler.for_run(args, models, plan, device, autocast, console, rloo.completion_logprobs)
    scorer = Scorer.for_run(args, models, plan, TrainerState(), device, autocast, console)
    if logger is None:
        logger = logs.open_logger(plan, folder, console, plan.num_updates, **args.tracking())
    evaluator = evaluation.Evaluator(args, plan, sampler, scorer, console, logger)
    step = update * plan.batch_size  # the episode, as rloo.py logs it
    evaluator.sample_table(step)
    evaluator.evaluate(update, step)
    return logger, time.perf_counter() - start


def run_seed(cli, seed: int, model: str, folder: str) -> None:
    """Train with TRL (unless its last model is saved), then evaluate its saved models; the rows in update order, as
    rloo.py writes them."""
    for name in ["metrics.jsonl", "samples.jsonl", "args.json"]:  # an unfinished evaluation's, done again
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    command = trl_command(cli.trl_python, model, seed, folder)
    trained = os.path.join(folder, "trained.json")  # TRL's training ended: its seconds
    if not os.path.isfile(trained):
        shutil.rmtree(os.path.join(folder, "trl"), ignore_errors=True)  # an unfinished training's
        os.makedirs(folder, exist_ok=True)
        print(f"trl__{seed}: training with TRL ({os.path.join(folder, 'trl.log')})", flush=True)
        start = time.perf_counter()
        with open(os.path.join(folder, "trl.log"), "w") as log:
            if code := subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"trl_arithmetic.py: error: TRL's training failed (exit code {code}): see {log.name}")
        with open(trained, "w") as f:
            json.dump({"seconds": time.perf_counter() - start}, f)
    training = json.load(open(trained))["seconds"]
    steps_per_update = int(preset_value("--num_mini_batches"))
    with open(os.path.join(folder, "trl_steps.jsonl")) as f:
        rows = update_rows([json.loads(line) for line in f], steps_per_update)
    logger, evaluating = None, 0.0
    for update in range(len(rows) + 1):
        if update % EVALUATE_EVERY == 0 or update == len(rows):
            saved = os.path.join(folder, "trl", f"checkpoint-{update * steps_per_update}") if update else model
            print(f"trl__{seed}: evaluating the model after update {update}", flush=True)
            logger, seconds = evaluate(saved, seed, update, folder, logger)
            evaluating += seconds
        if update < len(rows):
            logger.log(rows[update], rows[update]["episode"])
    logger.close()
    with open(os.path.join(folder, "args.json"), "w") as f:  # what trained, and how it was evaluated
        json.dump({"exp_name": "trl", "seed": seed, "trainer": "TRL RLOOTrainer", "command": command[1:]}, f, indent=2)
    with open(os.path.join(folder, "wall_clock.json"), "w") as f:
        json.dump({"seconds": round(training + evaluating), "training": training, "evaluation": evaluating}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"trl_arithmetic.py: error: {message}")  # one line, no usage block
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default=os.path.join("runs", "compare_arithmetic"), help="the runs go in <out>/runs")
    parser.add_argument("--results", default=None, help="keep each finished run's logs here (compare_algorithms.py's)")
    parser.add_argument("--core", type=int, default=None, help="run on this core alone, one thread")
    parser.add_argument("--trl_python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    cli = parser.parse_args()
    if len(set(cli.seeds)) < len(cli.seeds) or min(cli.seeds) < 0:
        parser.error(f"--seeds {' '.join(map(str, cli.seeds))}: give each seed once, 0 or more")
    results = os.path.abspath(cli.results) if cli.results else None
    to_train = [seed for seed in cli.seeds if not compare_algorithms.recorded(results, f"trl__{seed}")]
    if to_train and not os.path.isfile(cli.trl_python):  # runs kept in --results need neither TRL nor the model
        parser.error(f"--trl_python {cli.trl_python} is not there: make TRL's environment as trl_baseline.py says")
    if cli.core is not None:
        try:
            launch.check_cores([cli.core], 1)
        except ValueError as e:
            parser.error(str(e).replace("--cores", "--core"))
        os.sched_setaffinity(0, {cli.core})  # TRL's training, started from here, inherits it
        os.environ.update(launch.ONE_THREAD)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    from vllm_timing import hf_folder

    out = os.path.abspath(cli.out)
    model = os.path.join(out, "smollm2")
    if to_train and not os.path.isfile(os.path.join(model, "model.safetensors")):
        hf_folder("smollm2", out)  # rloo.py's default model, the GGUF file de-quantised, as a folder TRL loads
    for seed in cli.seeds:
        run, folder = f"trl__{seed}", os.path.join(out, "runs", f"trl__{seed}")
        if seed not in to_train:
            print(f"{run}: kept in {results}", flush=True)
            continue
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, ".lock"), "w") as lock:  # held while this seed runs: one process a seed
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                parser.error(f"{folder} is still running (another trl_arithmetic.py in this --out?): wait for it")
            if not os.path.isfile(os.path.join(folder, "wall_clock.json")):
                run_seed(cli, seed, model, folder)
        if results:
            os.makedirs(os.path.join(results, run), exist_ok=True)
            for name in [*compare_algorithms.LOGS, "wall_clock.json"]:
                shutil.copy2(os.path.join(folder, name), os.path.join(results, run, name))
        print(f"{run}: finished ({folder})", flush=True)


if __name__ == "__main__":
    main()
