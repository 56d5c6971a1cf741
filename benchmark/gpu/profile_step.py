"""Where an update's time goes on the device: torch.profiler over one HF generate call and one training forward-backward
of rloo.py, as a user runs it, in a markdown table.

    python benchmark/gpu/profile_step.py --out profile                    # CUDA: the kit's 0.5B timing model
    python benchmark/gpu/profile_step.py --out profile --size smoke       # a CPU: the tiny one, CPU activities only
    python benchmark/gpu/profile_step.py --out profile --model DIR --prompts FILE -- --sampler_weights policy

It runs rloo.py itself, in this process, on the GPU kit's timing workload (benchmark/gpu/check.py: 32 completions, 8
prompts x 4, of up to 256 tokens; 32 at --size tiny or smoke; reward completion_length, beta 0.05) with rloo.py's
defaults (on CUDA: --bf16, a bfloat16 copy of the float32 weights samples with a static KV cache and a compiled decoding
step; on a CPU: fp32, the policy samples, a dynamic cache) and any rloo.py options given after `--`, for
--warmup_updates (1: the static cache's step compiles in it) and one more update, its run folder in --out. In that
update it profiles two of rloo.py's own timed stages (rloo_utils/logs.py StageTimer, the "time/" metrics):
`generation`, the rollout (its one HF generate call of the 32 rows, with the tokenising around it), and the first
`policy_forward_backward`, the training forward of the log-probs and its backward (one micro-batch: all 32 rows). For
each, in profile.md and profile.json in --out (and on stdout):

- the wall time of the stage, CUDA synchronised at both ends;
- host time: the self CPU time of every operator and CUDA runtime call the profiler saw, summed (Python between them
  is not in it), against device time: the kernels' and copies' self CUDA time, summed, and the share of the wall the
  device was busy; the kernel launches (cudaLaunchKernel), CUDA graph launches and synchronisations the host made;
- the top --top (15) kernels by CUDA time: calls, milliseconds, share of the device time, mean microseconds. On a CPU
  (no CUDA activity to record) the top operators by self CPU time instead.

Seconds under the profiler are longer than without it (each event is recorded): the timing parts' numbers are the
timings, this says where they go. The timing model is built here from its config (check.build_timing_model, random
weights) unless --model gives one.
"""

import argparse
import contextlib
import json
import os
import runpy
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]  # check.py beside it; rloo_utils
import check

STAGES = {  # rloo.py's stage: what it is, in the table's heading
    "generation": "one HF generate call (the rollout stage: the update's prompts, tokenised, completed)",
    "policy_forward_backward": "one training forward-backward (the log-probs of the update's micro-batch and its loss)",
}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


class Tee:
    """sys.stdout, and a copy of what is written (rich writes through it): rloo.py's lines, read afterwards."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, text):
        self.text.append(text)
        return self.stream.write(text)

    def __getattr__(self, name):  # isatty, fileno, flush, encoding: the stream's
        return getattr(self.stream, name)


def device_time(event) -> float:
    """An event's self CUDA time in microseconds (the name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def summarise(prof, wall_s: float, top: int) -> dict:
    """One profiled stage: wall, host and device milliseconds, the host's launches and synchronisations, and the top
    kernels by CUDA time (the top operators by self CPU time where no CUDA activity was recorded)."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    device = [e for e in events if e.device_type != DeviceType.CPU and device_time(e) > 0]
    host_us = sum(e.self_cpu_time_total for e in host)
    device_us = sum(device_time(e) for e in device)
    calls = {e.key: e.count for e in host}
    if device:
        rows = sorted(device, key=device_time, reverse=True)[:top]
        ranked = [(e.key, e.count, device_time(e)) for e in rows]
    else:
        rows = sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        ranked = [(e.key, e.count, float(e.self_cpu_time_total)) for e in rows]
    total = device_us if device else host_us
    return {
        "wall_ms": round(1000 * wall_s, 3),
        "host_ms": round(host_us / 1000, 3),
        "device_ms": round(device_us / 1000, 3) if device else None,
        "device_busy": round(device_us / 1000 / (1000 * wall_s), 4) if device and wall_s else None,
        "kernels": sum(e.count for e in device) if device else None,
        "kernel_launches": sum(calls.get(k, 0) for k in LAUNCHES),
        "graph_launches": calls.get("cudaGraphLaunch", 0),
        "synchronisations": sum(n for k, n in calls.items() if k.startswith("cuda") and "Synchronize" in k),
        "ranked_by": "CUDA time (kernels and copies)" if device else "self CPU time (operators)",
        "top": [
            {"name": name, "calls": count, "ms": round(us / 1000, 3), "share": round(us / total, 4) if total else None}
            for name, count, us in ranked
        ],
    }


def markdown(found: dict) -> list[str]:
    """profile.md's lines: the run, then each stage's totals and its top table."""
    w = found["workload"]
    lines = [
        (
            f"Profiled: rloo.py's update {found['profiled_update']} of the timing workload ({w['completions']} "
            f"completions, {w['completions'] // w['generations']} prompts x {w['generations']}, of up to "
            f"{w['max_tokens']} tokens), options: {found['options']}; device {found['device']}; sampler: "
            f"{found['sampler_weights']}; cache: {found['cache']}. Under the profiler (slower than the timings): host "
            "= self CPU time of operators and CUDA runtime calls, summed; device = self CUDA time of kernels and "
            "copies, summed."
        ),
    ]
    for stage, s in found["stages"].items():
        lines += ["", f"### {STAGES[stage]}: `{stage}`", ""]
        totals = f"wall {s['wall_ms']:,.1f} ms; host (CPU) {s['host_ms']:,.1f} ms; "
        if s["device_ms"] is None:
            totals += "device: none recorded (CPU activities only)"
        else:
            totals += (
                f"device {s['device_ms']:,.1f} ms, busy {s['device_busy']:.0%} of the wall; {s['kernels']:,} kernels; "
                f"{s['kernel_launches']:,} kernel launches, {s['graph_launches']:,} CUDA graph launches, "
                f"{s['synchronisations']:,} synchronisations by the host"
            )
        unit = "CUDA ms" if s["device_ms"] is not None else "self CPU ms"
        lines += [
            totals,
            "",
            f"| {'kernel' if s['device_ms'] is not None else 'operator'} | calls | {unit} | share | mean us |",
            "|---|---|---|---|---|",
        ]
        for row in s["top"]:
            name = row["name"].replace("|", "/")
            name = name if len(name) <= 100 else name[:97] + "..."
            share = "" if row["share"] is None else f"{row['share']:.1%}"
            mean_us = 1000 * row["ms"] / row["calls"] if row["calls"] else 0
            lines.append(f"| `{name}` | {row['calls']:,} | {row['ms']:,.3f} | {share} | {mean_us:,.1f} |")
    return lines


def profiled_stages(stages: dict, profiled: int, top: int):
    """rloo_utils.logs.StageTimer's __call__ with torch.profiler around the `profiled`-th update's generation stage
    and its first policy_forward_backward (an update starts with its generation stage); the profiles in stages."""
    import torch

    from rloo_utils import logs

    timed = logs.StageTimer.__call__  # a context manager: CUDA synchronised at both ends, the seconds added
    update = {"n": 0}
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    @contextlib.contextmanager
    def profiling(self, stage: str):
        if stage == "generation":
            update["n"] += 1
        if stage not in STAGES or stage in stages or update["n"] != profiled:
            with timed(self, stage):
                yield
            return
        with timed(self, stage), torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            yield
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        stages[stage] = (prof, wall)  # summed up after the run: the key averages take a while

    logs.StageTimer.__call__ = profiling
    return lambda: {name: summarise(prof, wall, top) for name, (prof, wall) in stages.items()}


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"profile_step.py: error: {message}")  # one line, no usage block
    parser.add_argument("--out", required=True, help="folder for profile.md and profile.json")
    parser.add_argument(
        "--size",
        choices=["full", "tiny", "smoke"],
        default=None,
        help="the timing model when --model is not given: full (Qwen2.5-0.5B's shape, default on CUDA) or tiny (hidden "
        "128, 2 layers); and the completions' length, 256 or 32 tokens. smoke is tiny",
    )
    parser.add_argument("--model", default=None, help="the policy (default: the timing model, built in --work)")
    parser.add_argument("--prompts", default=None, help="a prompt file (default: the timing model's)")
    parser.add_argument("--work", default=None, help="where the timing model is built (default: a temporary folder)")
    parser.add_argument("--rows", type=int, default=32, help="completions per update (prompts x 4)")
    parser.add_argument("--max_tokens", type=int, default=None, help="completion length (default: 256; 32 if tiny)")
    parser.add_argument("--warmup_updates", type=int, default=1, help="updates before the profiled one")
    parser.add_argument("--top", type=int, default=15, help="rows of each table")
    cli = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    size = cli.size or ("full" if cuda else "tiny")
    if (cli.model is None) != (cli.prompts is None):
        parser.error("give --model and --prompts together, or neither (the timing model is built)")
    if cli.rows < 4 or cli.rows % 4 or cli.warmup_updates < 0 or cli.top < 1:
        parser.error("--rows is a multiple of 4 (prompts x 4), --warmup_updates at least 0, --top at least 1")
    os.makedirs(cli.out, exist_ok=True)
    if cli.model is None:
        work = cli.work or tempfile.mkdtemp(prefix="rloo_profile_")
        cli.model, cli.prompts = check.build_timing_model(os.path.join(work, "timing"), size, "cuda" if cuda else "cpu")
    w = {
        "completions": cli.rows,
        "generations": 4,
        "max_tokens": cli.max_tokens or (256 if size == "full" else 32),
        "updates": cli.warmup_updates + 1,
        "bf16": cuda,
    }
    model, prompts = (os.path.abspath(p) if os.path.exists(p) else p for p in (cli.model, cli.prompts))
    args = [*map(str, check.as_args(check.timing_options(model, prompts, w))), *extra]
    out = os.path.abspath(cli.out)
    os.chdir(out)  # the run's folder: runs/run in --out
    stages: dict = {}
    summed_up = profiled_stages(stages, cli.warmup_updates + 1, cli.top)
    tee = Tee(sys.stdout)
    sys.stdout, sys.argv = tee, [os.path.join(ROOT, "rloo.py"), *args]
    try:
        runpy.run_path(os.path.join(ROOT, "rloo.py"), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        sys.stdout = tee.stream
    missing = [stage for stage in STAGES if stage not in stages]
    if missing:
        sys.exit(f"profile_step.py: error: rloo.py's update {cli.warmup_updates + 1} ran no {' or '.join(missing)}")
    output = "".join(tee.text)
    sampler = check.sampler_said(output)
    found = {
        "command": " ".join(["python", "rloo.py", *args]),
        "workload": w,
        "options": " ".join(extra) or "rloo.py's defaults",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "profiled_update": cli.warmup_updates + 1,
        "sampler": sampler,
        "sampler_weights": sampler["said"] if sampler else "not said (rloo.py printed no sampler line)",
        "cache": check.cache_used(
            extra[extra.index("--cache_implementation") + 1] if "--cache_implementation" in extra[:-1] else None,
            "cuda" if cuda else "cpu",
            output,
        ),
        "stages": summed_up(),
    }
    lines = markdown(found)
    with open(os.path.join(out, "profile.json"), "w") as f:
        json.dump(found, f, indent=1)
    with open(os.path.join(out, "profile.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(["", *lines]))


if __name__ == "__main__":
    main()
