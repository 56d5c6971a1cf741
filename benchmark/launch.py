"""Run commands over several seeds with a pool of workers, each run tagged for W&B; or write one Slurm job per run.

    python benchmark/launch.py --command "python rloo.py --track" --num_seeds 3 --workers 1
    python benchmark/launch.py --command "python rloo.py --track" --command "python rloo_vllm.py --track" --pr 42
    python benchmark/launch.py --command "torchrun --nproc_per_node 8 rloo_multigpu.py --track" \
        --slurm_template benchmark/slurm_template.sh          # writes the job files; --slurm_submit also runs sbatch

Each run is a command with `--seed S` appended, S = --start_seed, --start_seed + 1, ... (the command itself names no
seed), started from the folder the launcher runs in, so that its run folder is runs/<exp_name>__<seed>__<time> there.
Every run gets WANDB_TAGS: the checkout's `git describe --tags --always --dirty`, `pr-N` with --pr N, and whatever
WANDB_TAGS already held; the scripts pass them to W&B (with --track), where openrlbenchmark's `?tag=` filter finds
them. Locally, --workers runs start at once; each run's output goes to its own file under --log_dir, and the launcher
prints a line as each run starts and ends. It exits 1 if any run failed, naming them and their logs.
"""

import argparse
import concurrent.futures
import itertools
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDERS = {
    "job_name",
    "command",
    "seed",
    "gpus",
    "wandb_tags",
    "workdir",
}  # what a Slurm template may hold: {{name}}


def git_tag(folder: str = ROOT):
    """The checkout's `git describe --tags --always --dirty` (a commit id when no tag is reachable); None outside git
    (a copied script)."""
    try:
        described = subprocess.run(
            ["git", "describe", "--tags", "--always", "--dirty"], cwd=folder, text=True, capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (described.stdout.strip() or None) if described.returncode == 0 else None


def wandb_tags(pr, existing: str, tag) -> str:
    """WANDB_TAGS for every run: what the environment held, the checkout's tag, pr-N; comma-separated, each once."""
    tags = [t for t in existing.split(",") if t] + [t for t in (tag, f"pr-{pr}" if pr is not None else None) if t]
    return ",".join(dict.fromkeys(tags))


def run_label(command: str) -> str:
    """What names a command's logs and jobs: its --exp_name, else the stem of the first .py file it names (rloo...)."""
    words = shlex.split(command)
    named = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--exp_name"]
    return named[-1] if named else next((os.path.basename(w)[:-3] for w in words if w.endswith(".py")), "run")


def gpus_of(command: str) -> int:
    """The GPUs one run of the command takes: torchrun's --nproc_per_node N, else 1."""
    words = shlex.split(command)
    for i, w in enumerate(words):
        if w.startswith("--nproc_per_node=") or w.startswith("--nproc-per-node="):
            return int(w.split("=", 1)[1])
        if w in ("--nproc_per_node", "--nproc-per-node") and i + 1 < len(words) and words[i + 1].isdigit():
            return int(words[i + 1])
    return 1


def plan_runs(commands: list[str], seeds: list[int]) -> list[dict]:
    """Every command with every seed: [{"name", "command", "seed"}], command by command."""
    runs = []
    for command in commands:
        try:
            words = shlex.split(command)
        except ValueError as e:  # a quote left open
            raise ValueError(f"--command {command!r}: {e}") from None
        if not words:
            raise ValueError('--command is empty: give the command to run, e.g. --command "python rloo.py"')
        if any(w == "--seed" or w.startswith("--seed=") for w in words):
            raise ValueError(
                f"--command {command!r} names a --seed: leave it out, the launcher adds --seed for each "
                "run (--start_seed, --num_seeds)"
            )
        for seed in seeds:
            runs.append(
                {
                    "name": f"{len(runs):02d}_{run_label(command)}_seed{seed}",
                    "seed": seed,
                    "command": f"{command} --seed {seed}",
                }
            )
    return runs


def render_slurm(template: str, values: dict) -> str:
    """The template with each {{name}} replaced by its value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(values[m.group(1)]), template)


def check_slurm_template(template: str, path: str) -> None:
    names = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", template))
    if unknown := names - PLACEHOLDERS:
        raise ValueError(
            f"the Slurm template {path} holds {', '.join('{{%s}}' % n for n in sorted(unknown))}, which "
            f"the launcher does not fill: use only {', '.join('{{%s}}' % n for n in sorted(PLACEHOLDERS))}"
        )
    if "command" not in names:
        raise ValueError(f"the Slurm template {path} has no {{{{command}}}}: put it where the job runs the command")


def write_slurm_jobs(runs: list[dict], template_path: str, slurm_dir: str, tags: str) -> list[str]:
    """One job file per run in slurm_dir (which must not hold them already: nothing is overwritten)."""
    try:
        with open(template_path, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"cannot read the Slurm template {template_path}: {e.strerror if isinstance(e, OSError) else e}"
        )
    check_slurm_template(template, template_path)
    paths = [os.path.join(slurm_dir, f"{run['name']}.sh") for run in runs]
    if taken := [p for p in paths if os.path.exists(p)]:
        raise ValueError(f"{taken[0]} exists already: give another --slurm_dir (nothing was written)")
    os.makedirs(slurm_dir, exist_ok=True)
    for run, path in zip(runs, paths):
        with open(path, "x", encoding="utf-8") as f:
            f.write(
                render_slurm(
                    template,
                    {
                        "job_name": run["name"],
                        "command": run["command"],
                        "seed": run["seed"],
                        "gpus": gpus_of(run["command"]),
                        "wandb_tags": shlex.quote(tags),
                        "workdir": shlex.quote(os.getcwd()),
                    },
                )
            )
    return paths


PRINT_LOCK = threading.Lock()  # the workers' lines are printed whole, never interleaved


def say(line: str) -> None:
    with PRINT_LOCK:
        print(line, flush=True)


def new_path(path: str, make) -> str:
    """path, or path with _2, _3, ... before its extension: the first that make(path) creates anew (make must fail
    with FileExistsError on an existing one), so nothing is overwritten and two launchers never share one."""
    stem, ext = os.path.splitext(path)
    for attempt in itertools.count(1):
        candidate = path if attempt == 1 else f"{stem}_{attempt}{ext}"
        try:
            make(candidate)
            return candidate
        except FileExistsError:
            continue


STARTING = threading.Lock()  # held while a run starts; Ctrl-C takes it to stop any further start
STOPPED = threading.Event()


# One thread a run: torch's, and those of the libraries under it, which read these before they start
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
# The shell of a pinned run, started on its core (argv: core, command), so that all it starts inherits the core; a
# preexec_fn would do it in the child before exec, which Python says may deadlock when threads run, as the workers do
PINNED_SHELL = (
    "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv('/bin/sh', ['sh', '-c', sys.argv[2]])"
)


def run_one(run: dict, log_dir: str, tags: str, free_cores: queue.Queue | None = None, ended=None) -> tuple[int, float]:
    """Run one command to its end, its output into a new log_dir/<name>.log (<name>_2.log, ... beside an earlier one;
    run["log"] then names it): (exit code, seconds). With free_cores, the run takes one of them (run["core"]) for its
    whole process tree, one thread, and gives it back at its end; ended(run, exit code) is called as it ends. After
    Ctrl-C a queued run does not start (exit code 130)."""
    start = time.time()
    core = free_cores.get() if free_cores is not None else None  # one per worker: one is free
    try:
        with STARTING:
            if STOPPED.is_set():
                return 130, 0.0
            run["log"] = new_path(os.path.join(log_dir, f"{run['name']}.log"), lambda p: open(p, "x").close())
            run["core"] = core
            say(f"started  {run['name']}" + (f" on core {core}" if core is not None else "") + f": {run['command']}")
            log = open(run["log"], "w")
            shell = ["/bin/sh", "-c", run["command"]]
            if core is not None:
                shell = [sys.executable, "-c", PINNED_SHELL, str(core), run["command"]]
            process = subprocess.Popen(
                shell,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "WANDB_TAGS": tags, **(ONE_THREAD if core is not None else {})},
            )
        with log:
            code = process.wait()
    finally:
        if core is not None:
            free_cores.put(core)
    if code in (130, -signal.SIGINT):  # Ctrl-C reached this run: stop here, before the main thread hears of it
        STOPPED.set()
    seconds = time.time() - start
    say(f"finished {run['name']} in {seconds / 60:.1f} min" + (f", exit code {code}" if code else ""))
    if ended is not None:
        ended(run, code)
    return code, seconds


def check_cores(cores: list[int] | None, workers: int) -> None:
    """--cores: each one a core this process may run on, each once, one per worker (ValueError, saying so)."""
    if cores is None:
        return
    if len(set(cores)) != len(cores) or len(cores) != workers:
        raise ValueError(f"--cores {' '.join(map(str, cores))}: give {workers} different cores, one per worker")
    if missing := sorted(set(cores) - os.sched_getaffinity(0)):
        raise ValueError(
            f"--cores: core {missing[0]} is not one this process may run on "
            f"({' '.join(map(str, sorted(os.sched_getaffinity(0))))}): name those"
        )


def run_all(
    runs: list[dict], workers: int, log_dir: str, tags: str, cores: list[int] | None = None, ended=None
) -> list[int]:
    """Every run, `workers` at a time: their exit codes, in order. cores (check_cores): each worker's run pinned to
    one of them, one thread: two small runs at once on a core each finish sooner than one after the other on both
    (docs/algorithm.md, Comparison), and a run's wall clock does not depend on what the other does. ended(run, exit
    code): called as each run ends, from its worker."""
    check_cores(cores, workers)
    os.makedirs(log_dir, exist_ok=True)
    free_cores = None
    if cores is not None:
        free_cores = queue.Queue()
        for core in cores:
            free_cores.put(core)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(run_one, run, log_dir, tags, free_cores, ended) for run in runs]
        try:
            codes = [f.result()[0] for f in futures]
            if STOPPED.is_set():  # a run took Ctrl-C (the queue stopped) though the launcher did not
                raise KeyboardInterrupt
            return codes
        except KeyboardInterrupt:  # the runs got Ctrl-C too: they checkpoint and stop; the queued ones never start
            with STARTING:
                STOPPED.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"launch.py: error: {message}")  # one line, no usage block
    parser.add_argument(
        "--command",
        action="append",
        required=True,
        help="a command to run over the seeds, as a shell would (may be given several times)",
    )
    parser.add_argument("--num_seeds", type=int, default=3)
    parser.add_argument("--start_seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="runs at once (locally)")
    parser.add_argument(
        "--cores",
        type=int,
        nargs="+",
        default=None,
        help="pin each worker's run to one of these cores, one thread (one core per worker; locally)",
    )
    parser.add_argument("--pr", type=int, default=None, help="add the W&B tag pr-N")
    parser.add_argument("--log_dir", default=None, help="each run's output; default runs/launch/<unix time>")
    parser.add_argument(
        "--slurm_template",
        default=None,
        help="write one Slurm job per run from this template "
        "({{command}}, {{job_name}}, {{seed}}, {{gpus}}: torchrun's --nproc_per_node or 1, "
        "{{wandb_tags}}, {{workdir}}) instead of running them",
    )
    parser.add_argument("--slurm_dir", default=None, help="where the job files go; default slurm/<unix time>")
    parser.add_argument("--slurm_submit", action="store_true", help="also submit each job with sbatch")
    parser.add_argument("--dry_run", action="store_true", help="print the runs and their tags, run nothing")
    cli = parser.parse_args(argv)
    if cli.num_seeds < 1 or cli.workers < 1:
        parser.error(f"--num_seeds and --workers must be at least 1, got {cli.num_seeds} and {cli.workers}")
    if cli.start_seed < 0:  # the scripts' seeds seed numpy's SeedSequence, which takes no negative number
        parser.error(f"--start_seed must be 0 or more, got {cli.start_seed}")
    try:
        check_cores(cli.cores, cli.workers)
    except ValueError as e:
        parser.error(str(e))
    if (cli.slurm_dir or cli.slurm_submit) and not cli.slurm_template:
        parser.error("--slurm_dir and --slurm_submit go with --slurm_template, the job file to fill in")
    if cli.slurm_submit and shutil.which("sbatch") is None:
        parser.error("--slurm_submit needs sbatch, which is not on PATH: submit the written jobs where Slurm runs")
    try:
        runs = plan_runs(cli.command, list(range(cli.start_seed, cli.start_seed + cli.num_seeds)))
        tags = wandb_tags(cli.pr, os.environ.get("WANDB_TAGS", ""), git_tag())
        if cli.dry_run:
            print(f"WANDB_TAGS={tags}")
            for run in runs:
                print(run["command"])
            return 0
        if cli.slurm_template:
            slurm_dir = cli.slurm_dir or os.path.join("slurm", str(int(time.time())))
            paths = write_slurm_jobs(runs, cli.slurm_template, slurm_dir, tags)
            print(f"{len(paths)} Slurm jobs in {slurm_dir} (WANDB_TAGS={tags})")
            for path in paths:
                if not cli.slurm_submit:
                    print(f"sbatch {path}")
                elif code := subprocess.run(["sbatch", path]).returncode:
                    raise ValueError(f"sbatch {path} failed (exit code {code}); every job file is in {slurm_dir}")
            return 0
        if cli.log_dir:
            os.makedirs(cli.log_dir, exist_ok=True)  # an existing one is fine: each log is a new file in it
            log_dir = cli.log_dir
        else:  # a folder of this launch's own, even beside a launch started in the same second
            os.makedirs(os.path.join("runs", "launch"), exist_ok=True)
            log_dir = new_path(os.path.join("runs", "launch", str(int(time.time()))), os.mkdir)
    except OSError as e:  # a --log_dir or --slurm_dir that is a file, or cannot be written
        parser.error(f"cannot write {e.filename} ({e.strerror}): give another --log_dir or --slurm_dir")
    except ValueError as e:
        parser.error(str(e))
    print(f"{len(runs)} runs, {cli.workers} at a time, WANDB_TAGS={tags}, logs in {log_dir}", flush=True)
    try:
        codes = run_all(runs, cli.workers, log_dir, tags, cli.cores)
    except KeyboardInterrupt:  # the runs got Ctrl-C too: the trainers wrote a checkpoint each
        print(
            "launch.py: error: interrupted; the runs that had started stopped (a trainer writes a checkpoint and "
            f"prints the command that continues it: see their logs in {log_dir})",
            file=sys.stderr,
        )
        return 130
    failed = [(run, code) for run, code in zip(runs, codes) if code]
    for run, code in failed:
        print(f"failed (exit code {code}): {run['command']}; its log: {run['log']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
