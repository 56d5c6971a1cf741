"""The checks every run's options go through before anything expensive starts (check_args): each value finite and in
range, the batch arithmetic (batch_sizes), paths that exist, then each option group's own check(); each bad value
refused in one line that names it and the fix."""

import math
import os
from dataclasses import fields

from rloo_utils.errors import UsageError
from rloo_utils.models import set_model_options
from rloo_utils.options import option_groups
from rloo_utils.paths import looks_local
from rloo_utils.rewards import FLOAT32_MAX, FLOAT32_TINY, clip_bounds


# Float options that may be infinite: --max_grad_norm inf is no clipping, --reward_clip_range -inf 5 clips one side
MAY_BE_INFINITE = {"max_grad_norm", "reward_clip_range"}


def batch_sizes(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_mini_batches: int,
    total_episodes: int,
    world_size: int = 1,
) -> tuple[int, int, int]:
    """(completions per rollout, completions per minibatch, rollouts) over all processes, as in old TRL: the per-device
    sizes times the number of processes."""
    mini_batch_size = per_device_train_batch_size * gradient_accumulation_steps * world_size
    batch_size = mini_batch_size * num_mini_batches
    return batch_size, mini_batch_size, total_episodes // batch_size


def check_args(args, world_size: int = 1) -> None:
    """Every option on its own and with the others, before anything is loaded: what every option must be (finite,
    in range, a path that exists), the algorithm's options, then each group's own check() beside its options (the
    vLLM ones: check_vllm_args)."""
    for option in fields(args):
        value = getattr(args, option.name)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, float) and (math.isnan(v) or math.isinf(v) and option.name not in MAY_BE_INFINITE):
                raise UsageError(f"--{option.name} must be a finite number, got {v}")
            if isinstance(v, float) and math.isfinite(v) and abs(v) > FLOAT32_MAX:  # inf once in a float32 tensor
                raise UsageError(
                    f"--{option.name} {v:g} is past the float32 range (+-{FLOAT32_MAX:.3g}) the run "
                    "computes in: give a smaller number"
                )
            if isinstance(v, float) and 0 < abs(v) < FLOAT32_TINY:  # 0 once in float32: a temperature dividing by it
                raise UsageError(
                    f"--{option.name} {v:g} is below the smallest normal float32 ({FLOAT32_TINY:.3g}), "
                    "which the run computes in: give a larger number (or 0 where 0 is meant)"
                )
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32) (numpy's seed range), got {args.seed}")
    positive = [
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_mini_batches",
        "num_ppo_epochs",
        "total_episodes",
        "learning_rate",
        "temperature",
        "max_completion_length",
        "max_prompt_length",
        "local_rollout_forward_batch_size",
        "max_grad_norm",
        "max_skipped_steps",
        "max_sampling_rounds",
    ]  # (--ddp_timeout: init_processes)
    for name in positive:
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0, got {getattr(args, name)}")
    for name in [
        "beta",
        "warmup_steps",
        "top_k",
        "weight_decay",
        "num_sample_generations",
        "num_sample_prompts",
        "save_steps",
    ]:
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0, got {getattr(args, name)}")
    longest_row = args.max_prompt_length + args.max_completion_length
    if args.max_tokens_per_micro_batch is not None and args.max_tokens_per_micro_batch < longest_row:
        raise UsageError(
            f"--max_tokens_per_micro_batch {args.max_tokens_per_micro_batch} cannot hold the longest row "
            f"(--max_prompt_length {args.max_prompt_length} + --max_completion_length {args.max_completion_length} = "
            f"{longest_row} tokens): give at least {longest_row}, or lower those"
        )
    rounds_default = type(args).__dataclass_fields__["max_sampling_rounds"].default
    if args.max_sampling_rounds != rounds_default and not args.dynamic_sampling:
        raise UsageError(
            f"--max_sampling_rounds {args.max_sampling_rounds} bounds --dynamic_sampling's rounds, and the run does "
            "not sample dynamically: add --dynamic_sampling, or leave the option out"
        )
    if args.num_generations < 2:
        raise UsageError(f"--num_generations must be >= 2 for a leave-one-out baseline, got {args.num_generations}")
    batch_size, _, num_updates = batch_sizes(
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_mini_batches=args.num_mini_batches,
        total_episodes=args.total_episodes,
        world_size=world_size,
    )
    if batch_size // world_size % args.num_generations:  # the completions of a prompt stay on one process
        raise UsageError(
            f"the rollout batch{' of each process' if world_size > 1 else ''} (per_device_train_batch_size "
            f"x gradient_accumulation_steps x num_mini_batches = {batch_size // world_size}) must be "
            f"divisible by --num_generations {args.num_generations}"
        )
    if num_updates < 1:
        raise UsageError(f"--total_episodes {args.total_episodes} is smaller than one rollout batch ({batch_size})")
    num_optimizer_steps = num_updates * args.num_ppo_epochs * args.num_mini_batches
    if args.warmup_steps >= 1 and args.warmup_steps >= num_optimizer_steps:
        raise UsageError(
            f"--warmup_steps {args.warmup_steps:g} is not shorter than the run ({num_optimizer_steps} "
            "optimizer steps): the rate would never reach --learning_rate; give fewer steps, or a "
            "fraction below 1"
        )
    if args.reward_clip_range is not None:
        if len(args.reward_clip_range) not in (1, 2):
            raise UsageError("--reward_clip_range takes one number c (meaning [-c, c]) or two numbers lo hi")
        lo, hi = clip_bounds(args.reward_clip_range)
        if not lo < hi:
            raise UsageError(f"--reward_clip_range needs lo < hi, got {args.reward_clip_range}")
    for name in ["model_name_or_path", "sft_model_path", "reward_model_path", "dataset_name"]:
        path = getattr(args, name)
        if path is not None and looks_local(path) and not os.path.exists(path):
            raise UsageError(f"--{name} {path} does not exist")
    for group in option_groups(type(args)):  # each feature's own checks, beside its options
        if "check" in vars(group):
            group.check(args)
    set_model_options(
        model_name_or_path=args.model_name_or_path,
        sft_model_path=args.sft_model_path,
        reward_model_path=args.reward_model_path,
        trust_remote_code=args.trust_remote_code,
        model_revision=args.model_revision,
    )
