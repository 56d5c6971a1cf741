"""Seconds per update of rloo_vllm.py against a vLLM server, synchronous (--max_staleness 0) and asynchronous
(--max_staleness 1 and more), side by side in one invocation, the server pinned to one core and the trainer to another
(taskset), so that generation and update run on hardware of their own, as on GPUs apart.

One server (started here as docs/vllm.md starts it, and stopped at the end) serves the runs one after the other, with
nothing else running. Each run's first two updates are dropped (warm-up, and the asynchronous runs' first rollouts,
which all come from the initial weights). What the table shows per run: its stages as the run logs
them (time/generation is the wait for the rollout; time/background_generation the server's own time for it, while the
trainer worked), the update as the trainer times it (time/update: its stages and the waits for the server), the update
end to end (from one update's logged end to the next: the logging and the sample tables included, which a background
rollout overlaps too), and the whole run.

    python benchmark/async_timing.py --preset tiny       # the test model
    python benchmark/async_timing.py --preset smollm2    # SmolLM2-135M-Instruct, step_timing.py's workload

The workload is step_timing.py's (8 completions of up to 64 tokens, beta 0.05, fp32, one epoch, one minibatch);
--completions and --max_completion_length change its size.

--task tool_vault times the multi-turn task of benchmark/tool_vault.py instead (its policy and data built first, with
`python benchmark/tool_vault.py --out DIR`), with benchmark/experiments/tool_vault.sh's settings (32 completions a
update, one environment each, one round of tool calls), over --seeds; it also prints what each run learnt: the
held-out reward before training and at its end (32 test prompts x 4), and the training reward and tool calls of its
first and last 5 updates.

    python benchmark/async_timing.py --task tool_vault --tool_vault DIR --updates 60 --seeds 1 2 3
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
from step_timing import SAME_AS_TRL_BASELINE  # noqa: E402
from vllm_timing import hf_folder, run, start_server  # noqa: E402

STAGES = [
    "generation",
    "engine_check",
    "old_logprobs",
    "reference_forward",
    "reward",
    "policy_forward_backward",
    "optimizer",
    "generation_wait",
    "weight_sync",
]
ONE_CORE = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pinned(core: int, command: list[str]) -> list[str]:
    return ["taskset", "--cpu-list", str(core), *command]


def server_and_trainer_cores(parser, updates: int) -> tuple[int, int]:
    """Two of this process's cores, the server's and the trainer's; one line for fewer, or for fewer than 3 updates a
    run (the first two are dropped)."""
    if updates < 3:
        parser.error(f"--updates must be >= 3 (the first two are dropped), got {updates}")
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("the server and the trainer each need a core of their own: this process may use fewer than 2")
    server_core, trainer_core = sorted(os.sched_getaffinity(0))[:2]
    return server_core, trainer_core


def tool_vault_args(folder: str, updates: int) -> list[str]:
    """benchmark/experiments/tool_vault.sh's run of the vault task, `updates` updates of 32 completions."""
    task = os.path.join(ROOT, "benchmark", "tool_vault.py")
    return [
        *("--model_name_or_path", os.path.join(folder, "policy"), "--dataset_name", os.path.join(folder, "data")),
        *("--environment", f"{task}:Vault", "--reward_funcs", f"{task}:said_the_word"),
        *("--max_tool_calling_iterations", "1", "--total_episodes", str(32 * updates), "--num_generations", "8"),
        *("--per_device_train_batch_size", "32", "--max_completion_length", "96", "--learning_rate", "2e-4"),
        *("--beta", "0", "--num_sample_generations", "0", "--num_generations_eval", "4"),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"async_timing.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--task", choices=["default", "tool_vault"], default="default")
    parser.add_argument("--tool_vault", help="--task tool_vault: the folder benchmark/tool_vault.py --out made")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="each staleness is run with each seed")
    parser.add_argument("--updates", type=int, default=10, help="updates per run; the first two are dropped")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="the --max_staleness of each run")
    parser.add_argument("--completions", type=int, default=8, help="completions per update (prompts x 2)")
    parser.add_argument("--max_completion_length", type=int, default=64)
    cli = parser.parse_args()
    server_core, trainer_core = server_and_trainer_cores(parser, cli.updates)
    if cli.task == "tool_vault" and not (cli.tool_vault and os.path.isdir(os.path.join(cli.tool_vault, "policy"))):
        parser.error(
            f"--task tool_vault needs the task's policy and data: build them with `python benchmark/tool_vault.py "
            f"--out DIR` and give --tool_vault DIR (got {cli.tool_vault})"
        )

    with tempfile.TemporaryDirectory() as workdir:
        if cli.task == "tool_vault":
            model = os.path.join(cli.tool_vault, "policy")
            args = tool_vault_args(cli.tool_vault, cli.updates)
            workload = f"the tool vault, 32 completions of up to 96 tokens, {cli.updates} updates a run"
        else:
            model = hf_folder(cli.preset, workdir)
            args = [
                *SAME_AS_TRL_BASELINE,
                *("--per_device_train_batch_size", str(cli.completions)),
                *("--max_completion_length", str(cli.max_completion_length)),
                *("--total_episodes", str(cli.completions * cli.updates), "--model_name_or_path", model),
            ]
            workload = f"preset {cli.preset}, {cli.completions} completions of up to {cli.max_completion_length} tokens"
        os.environ.update(ONE_CORE)  # the server's too
        server, url, server_start = start_server(model, workdir, lambda command: pinned(server_core, command))
        results = []
        try:
            for seed in cli.seeds:
                for staleness in cli.staleness:
                    command = [sys.executable, os.path.join(ROOT, "rloo_vllm.py"), *args, "--seed", str(seed)]
                    command += ["--vllm_mode", "server", "--vllm_server_base_url", url]
                    command += ["--max_staleness", str(staleness)]
                    name, env = f"max_staleness {staleness}", {**ONE_CORE, "TOKENIZERS_PARALLELISM": "false"}
                    result = run(f"{name} seed {seed}", pinned(trainer_core, command), workdir, drop=2, env=env)
                    results.append({**result, "name": name, "seed": seed})
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait()

    print(
        f"{workload}: seconds per update, mean of {cli.updates - 2} updates after the first two (and over seeds "
        f"{' '.join(map(str, cli.seeds))}); the server on core {server_core}, the trainer on core {trainer_core}; "
        f"server start-up {server_start:.1f} s, outside the runs"
    )
    names = list(dict.fromkeys(r["name"] for r in results))
    per_name = {name: [r for r in results if r["name"] == name] for name in names}
    mean = lambda name, key: statistics.mean(row.get(key, 0.0) for r in per_name[name] for row in r["rows"])  # noqa: E731
    over_seeds = lambda name, key: statistics.mean(r[key] for r in per_name[name])  # noqa: E731
    print(f"{'stage':<28}" + "".join(f"{name:>20}" for name in names))
    for stage in [*STAGES, "background_generation"]:
        print(f"{'time/' + stage:<28}" + "".join(f"{mean(n, 'time/' + stage):>20.3f}" for n in names))
    print(f"{'update (time/update)':<28}" + "".join(f"{mean(n, 'time/update'):>20.3f}" for n in names))
    print(f"{'update, end to end':<28}" + "".join(f"{over_seeds(n, 'period'):>20.3f}" for n in names))
    print(f"{'tokens per completion':<28}" + "".join(f"{mean(n, 'completions/mean_length'):>20.1f}" for n in names))
    print(f"{'whole run, wall (s)':<28}" + "".join(f"{over_seeds(n, 'wall'):>20.1f}" for n in names))
    base = over_seeds(names[0], "period")
    print(f"{'speed-up, end to end':<28}" + "".join(f"{base / over_seeds(n, 'period'):>20.2f}" for n in names))
    if cli.task == "tool_vault":
        print("\nwhat each run learnt (eval/reward: held-out, before training and at the end; first / last 5 updates)")
        print(f"{'run':<28}{'seed':>6}{'eval before':>13}{'eval after':>12}{'reward':>16}{'tool calls':>16}")
        for r in results:
            first, last = r["all_rows"][:5], r["all_rows"][-5:]
            span = lambda rows, key: statistics.mean(row[key] for row in rows)  # noqa: E731
            reward = f"{span(first, 'reward'):.3f} / {span(last, 'reward'):.3f}"
            calls = f"{span(first, 'tools/call_frequency'):.3f} / {span(last, 'tools/call_frequency'):.3f}"
            before, after = r["evaluations"][0]["eval/reward"], r["evaluations"][-1]["eval/reward"]
            print(f"{r['name']:<28}{r['seed']:>6}{before:>13.3f}{after:>12.3f}{reward:>16}{calls:>16}")


if __name__ == "__main__":
    main()
