"""Seconds per update and peak memory per process of rloo_multigpu.py on 1 and 2 processes, next to rloo.py.

One invocation runs the same global batch four times, one after the other with nothing else running: rloo.py,
rloo_multigpu.py as one process (`python`), and rloo_multigpu.py on 2 processes (`torchrun --nproc_per_node 2`,
--per_device_train_batch_size halved), generating from the gathered policy (the default) and from the sharded one
(--no_gather_for_generation). Each run's first update is dropped (warm-up). Times are rank 0's; the peak
resident memory (VmHWM) of every training process is read from /proc while it runs.

    python benchmark/multigpu_timing.py --preset tiny       # the test model
    python benchmark/multigpu_timing.py --preset smollm2    # SmolLM2-135M-Instruct, the workload of step_timing.py

The workload is step_timing.py's: 8 completions per update (4 prompts x 2), up to 64 tokens, beta 0.05, lr 1e-6,
fp32, one epoch, one minibatch. On a CPU, torchrun gives each process one thread (OMP_NUM_THREADS=1), the single
process uses all cores.
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
from step_timing import SAME_AS_TRL_BASELINE, STAGES  # noqa: E402
from vllm_timing import hf_folder  # noqa: E402


def descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children] + [d for c in children for d in descendants(int(c))]


def peak_rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20
    except (OSError, StopIteration):
        return 0.0


def run(name: str, command: list[str], workdir: str, workers_are_children: bool) -> dict:
    """Run a command to the end, watching the peak memory of its training processes."""
    cwd = os.path.join(workdir, name.replace(" ", "_"))
    os.makedirs(cwd)
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    peaks = {}
    while proc.poll() is None:
        for pid in descendants(proc.pid) if workers_are_children else [proc.pid]:
            peaks[pid] = max(peaks.get(pid, 0.0), peak_rss_gib(pid))
        time.sleep(0.2)
    if proc.returncode:
        sys.exit(f"{name} failed (exit {proc.returncode}); run it by hand in {cwd} to see why")
    (run_dir,) = os.listdir(os.path.join(cwd, "runs"))
    with open(os.path.join(cwd, "runs", run_dir, "metrics.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if "episode" in row]  # the updates' (not the evaluations')
    workers = sorted(peaks.values(), reverse=True)[: 2 if workers_are_children else 1]
    return {"name": name, "rows": rows[1:], "wall": time.perf_counter() - start, "peak": workers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"multigpu_timing.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--updates", type=int, default=6, help="updates per run; the first is dropped as warm-up")
    cli = parser.parse_args()

    with tempfile.TemporaryDirectory() as workdir:
        model = hf_folder(cli.preset, workdir)
        args = [*SAME_AS_TRL_BASELINE, "--total_episodes", str(8 * cli.updates), "--model_name_or_path", model]
        halved = [*args, "--per_device_train_batch_size", "4"]  # 2 processes x 4 = the same 8 completions
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        results = [
            run("rloo.py", [sys.executable, os.path.join(ROOT, "rloo.py"), *args], workdir, False),
            run("multigpu 1 process", [sys.executable, os.path.join(ROOT, "rloo_multigpu.py"), *args], workdir, False),
            run("multigpu 2 processes", [*torchrun, os.path.join(ROOT, "rloo_multigpu.py"), *halved], workdir, True),
            run(
                "2 processes, sharded",
                [*torchrun, os.path.join(ROOT, "rloo_multigpu.py"), *halved, "--no_gather_for_generation"],
                workdir,
                True,
            ),
        ]

    print(
        f"preset {cli.preset}: seconds per update, mean of {cli.updates - 1} updates after the first "
        f"(8 completions of up to 64 tokens); times of rank 0"
    )
    print(f"{'stage':<26}" + "".join(f"{r['name']:>22}" for r in results))
    mean = lambda r, key: statistics.mean(row.get(key, 0.0) for row in r["rows"])  # noqa: E731
    for stage in STAGES:
        print(f"{stage:<26}" + "".join(f"{mean(r, 'time/' + stage):>22.3f}" for r in results))
    print(
        f"{'other':<26}"
        + "".join(f"{mean(r, 'time/update') - sum(mean(r, 'time/' + s) for s in STAGES):>22.3f}" for r in results)
    )
    print(f"{'update':<26}" + "".join(f"{mean(r, 'time/update'):>22.3f}" for r in results))
    print(f"{'tokens per completion':<26}" + "".join(f"{mean(r, 'completions/mean_length'):>22.1f}" for r in results))
    print(f"{'whole run, wall (s)':<26}" + "".join(f"{r['wall']:>22.1f}" for r in results))
    print(
        f"{'peak memory/process (GiB)':<26}"
        + "".join(f"{' + '.join(f'{p:.2f}' for p in r['peak']):>22}" for r in results)
    )


if __name__ == "__main__":
    main()
