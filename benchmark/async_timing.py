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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"async_timing.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--updates", type=int, default=10, help="updates per run; the first two are dropped")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="the --max_staleness of each run")
    parser.add_argument("--completions", type=int, default=8, help="completions per update (prompts x 2)")
    parser.add_argument("--max_completion_length", type=int, default=64)
    cli = parser.parse_args()
    server_core, trainer_core = server_and_trainer_cores(parser, cli.updates)

    with tempfile.TemporaryDirectory() as workdir:
        model = hf_folder(cli.preset, workdir)
        args = [
            *SAME_AS_TRL_BASELINE,
            "--per_device_train_batch_size",
            str(cli.completions),
            "--max_completion_length",
            str(cli.max_completion_length),
            "--total_episodes",
            str(cli.completions * cli.updates),
            "--model_name_or_path",
            model,
        ]
        os.environ.update(ONE_CORE)  # the server's too
        server, url, server_start = start_server(model, workdir, lambda command: pinned(server_core, command))
        results = []
        try:
            for staleness in cli.staleness:
                command = [sys.executable, os.path.join(ROOT, "rloo_vllm.py"), *args]
                command += ["--vllm_mode", "server", "--vllm_server_base_url", url, "--max_staleness", str(staleness)]
                name, env = f"max_staleness {staleness}", {**ONE_CORE, "TOKENIZERS_PARALLELISM": "false"}
                results.append(run(name, pinned(trainer_core, command), workdir, drop=2, env=env))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait()

    print(
        f"preset {cli.preset}: seconds per update, mean of {cli.updates - 2} updates after the first two "
        f"({cli.completions} completions of up to {cli.max_completion_length} tokens); the server on core "
        f"{server_core}, the trainer on core {trainer_core}; server start-up {server_start:.1f} s, outside the runs"
    )
    print(f"{'stage':<28}" + "".join(f"{r['name']:>20}" for r in results))
    mean = lambda r, key: statistics.mean(row.get(key, 0.0) for row in r["rows"])  # noqa: E731
    for stage in [*STAGES, "background_generation"]:
        print(f"{'time/' + stage:<28}" + "".join(f"{mean(r, 'time/' + stage):>20.3f}" for r in results))
    print(f"{'update (time/update)':<28}" + "".join(f"{mean(r, 'time/update'):>20.3f}" for r in results))
    print(f"{'update, end to end':<28}" + "".join(f"{r['period']:>20.3f}" for r in results))
    print(f"{'tokens per completion':<28}" + "".join(f"{mean(r, 'completions/mean_length'):>20.1f}" for r in results))
    print(f"{'whole run, wall (s)':<28}" + "".join(f"{r['wall']:>20.1f}" for r in results))
    base = results[0]["period"]
    print(f"{'speed-up, end to end':<28}" + "".join(f"{base / r['period']:>20.2f}" for r in results))


if __name__ == "__main__":
    main()
