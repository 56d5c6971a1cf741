"""A run's set-up, the same in every script: what it is given before any model loads (its plan: the batch sizes, the
checkpoint it resumes, its data, its reward sources and held-out prompts, each checked), and the models of a script
that holds them whole (rloo_multigpu.py shards its own)."""

import copy
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from rloo_utils.code_reward import check_code_reward
from rloo_utils.checkpoints import (
    check_resumable,
    find_checkpoint,
    load_checkpoint_weights,
    load_training_state,
    run_dir_of,
)
from rloo_utils.data import image_column, load_datasets
from rloo_utils.evaluation import evaluation_prompts, evaluation_updates, metric_funcs
from rloo_utils.lora import add_adapter
from rloo_utils.models import (
    disable_dropout,
    from_pretrained,
    frozen_linear_weights_to,
    load_reward_model,
    load_tokenizers,
    model_dtype,
    policy_class,
)
from rloo_utils.options import resumable_options
from rloo_utils.checks import batch_sizes
from rloo_utils.rewards import builtin_reward_funcs, check_reward_columns, reward_sources
from rloo_utils.tools import ToolUse, check_tool_template, load_tool_use


@dataclass
class RunPlan:
    """What a run is given before any model loads, every part of it checked."""

    batch_size: int  # completions per update, over all processes (B)
    mini_batch_size: int  # completions per optimizer step, over all processes
    num_updates: int
    num_train_epochs: int  # passes over the training prompts, the last one begun (TRL's trainer_state)
    checkpoint: Optional[str]  # the checkpoint a resumed run continues from; None: a new run
    training_state: Optional[dict]  # its counters and random generators
    tool_use: Optional[ToolUse]  # --tools and --environment; None: single-turn rollouts
    reward_funcs: list  # the reward functions, after the reward model if there is one
    reward_names: list[str]  # (F,) every reward source, the reward model first
    reward_weights: torch.Tensor  # (F,)
    metric_funcs: list  # --eval_metric_funcs: metrics of the evaluation only
    metric_names: list[str]
    train_dataset: Any
    eval_dataset: Any  # the held-out split, or None
    eval_prompts: Any  # the prompts evaluated; None: no evaluation
    evaluate_after: set[int]  # the updates after which the policy is evaluated (0: before training)
    extra_columns: list[str]  # the dataset's columns besides the prompt: what reward functions get
    image_column: Optional[str]  # vision-language prompts' images; None: text
    options: dict  # every option by name (asdict of the Args): what the logs and each checkpoint's args.json record


def first_line(
    plan: RunPlan, run_dir: str, device, num_generations: int, num_optimizer_steps: int, bf16: bool, world_size: int = 1
) -> str:
    """The run's first line: its size (plan's updates and batch of num_generations completions per prompt, over
    world_size processes, in num_optimizer_steps optimizer steps in all), where it computes and in what precision
    (bf16: --bf16's autocast), where it logs (run_dir) and the checkpoint it resumes."""
    G, processes = num_generations, ""
    if world_size > 1:
        processes = f" on {world_size} processes ({plan.batch_size // world_size} each)"
    return (
        f"run {os.path.basename(run_dir)}: {plan.num_updates} updates of {plan.batch_size} completions "
        f"({plan.batch_size // G} prompts x {G}){processes}, {num_optimizer_steps} optimizer steps, device "
        f"{device.type} ({'bf16' if bf16 else 'fp32'} compute; --no_bf16 / --bf16 to change), logs in {run_dir}"
        + (f"; resumed from {plan.checkpoint}" if plan.checkpoint else "")
    )


def plan_run(args, world_size=1, sharded=False) -> RunPlan:
    """The checks that need no model, in the order a user meets them: the batch arithmetic, the checkpoint a resumed
    run continues (--resume_from_checkpoint, found and checked, and what it may change: resumable_options; sharded:
    rloo_multigpu.py's, whose weights are torch.distributed.checkpoint shards), the tools, the reward sources and
    evaluation metrics, the data and the columns the functions read (code_reward: its rows' tests, and its sandbox
    started), the held-out prompts."""
    batch_size, mini_batch_size, num_updates = batch_sizes(
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_mini_batches=args.num_mini_batches,
        total_episodes=args.total_episodes,
        world_size=world_size,
    )
    options = asdict(args)  # every option by name: what the logs and each checkpoint's args.json record
    checkpoint = training_state = None  # a new run
    if args.resume_from_checkpoint is not None:
        checkpoint = find_checkpoint(args.resume_from_checkpoint, args.run_name)
        check_resumable(options, checkpoint, resumable_options(type(args)))
        training_state = load_training_state(checkpoint, run_dir_of(checkpoint), sharded)
    tool_use = load_tool_use(
        tools=args.tools,
        environment=args.environment,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        tool_timeout=args.tool_timeout,
        reward_timeout=args.reward_timeout,
    )
    builtin = builtin_reward_funcs(
        max_completion_length=args.max_completion_length,
        overlong_buffer_length=args.overlong_buffer_length,
        overlong_penalty_factor=args.overlong_penalty_factor,
        code_sandbox=args.code_sandbox,
        code_timeout=args.code_timeout,
        code_memory_mb=args.code_memory_mb,
        code_workers=args.code_workers,
    )
    reward_funcs, reward_names, reward_weights = reward_sources(
        builtin,
        tool_use.reward_funcs() if tool_use else [],
        reward_model_path=args.reward_model_path,
        reward_funcs=args.reward_funcs,
        reward_weights=args.reward_weights,
    )
    eval_metric_funcs, eval_metric_names = metric_funcs(args.eval_metric_funcs, builtin)
    train_dataset, eval_dataset = load_datasets(
        dataset_name=args.dataset_name,
        dataset_train_split=args.dataset_train_split,
        dataset_test_split=args.dataset_test_split,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    check_reward_columns(
        reward_funcs,
        reward_names,
        eval_metric_funcs,
        eval_metric_names,
        train_dataset,
        eval_dataset,
        num_sample_generations=args.num_sample_generations,
        eval_steps=args.eval_steps,
        multi_turn=tool_use is not None,
    )
    # code_reward: the tests of the rows it scores read, its sandbox started (as check_reward_columns splits them)
    held_out = {} if eval_dataset is None else {"held-out": eval_dataset}
    check_code_reward(
        reward_funcs,
        {"training": train_dataset, **(held_out if args.num_sample_generations or args.eval_steps else {})},
    )
    check_code_reward(eval_metric_funcs, held_out if args.eval_steps else {})
    eval_prompts = evaluation_prompts(
        eval_dataset,
        eval_metric_names,
        dataset_name=args.dataset_name,
        dataset_test_split=args.dataset_test_split,
        eval_steps=args.eval_steps,
        max_eval_prompts=args.max_eval_prompts,
        eval_success_threshold=args.eval_success_threshold,
        eval_metric_funcs=args.eval_metric_funcs,
    )
    return RunPlan(
        batch_size=batch_size,
        mini_batch_size=mini_batch_size,
        num_updates=num_updates,
        num_train_epochs=math.ceil(args.total_episodes / args.num_generations / len(train_dataset)),
        checkpoint=checkpoint,
        training_state=training_state,
        tool_use=tool_use,
        reward_funcs=reward_funcs,
        reward_names=reward_names,
        reward_weights=reward_weights,
        metric_funcs=eval_metric_funcs,
        metric_names=eval_metric_names,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        eval_prompts=eval_prompts,
        evaluate_after=evaluation_updates(args.eval_steps, args.eval_on_start, num_updates) if eval_prompts else set(),
        extra_columns=[c for c in train_dataset.column_names if c != "prompt"],
        image_column=image_column(train_dataset.column_names, args.dataset_name),
        options=options,
    )


@dataclass
class Models:
    """The models of a run and their tokenizers."""

    tokenizer: Any  # the policy's
    reward_tokenizer: Any  # a reward model's own, or None: it reads the policy's token ids
    processor: Any  # a vision-language policy's processor, or None
    policy: torch.nn.Module  # with --use_peft, the frozen model with its trained adapters
    ref_policy: Optional[torch.nn.Module]  # the KL's reference; None when --beta is 0
    reward_model: Optional[torch.nn.Module]


def load_checked_tokenizers(
    plan: RunPlan,
    *,
    model_name_or_path: str,
    sft_model_path: Optional[str],
    reward_model_path: Optional[str],
    stop_token_id: Optional[int],
    chat_template_kwargs: Optional[dict],
) -> tuple:
    """load_tokenizers (the policy's tokenizer, checked on the plan's first prompt; the reward model's where it reads
    text otherwise; a VLM's processor), and with the plan's tools, the chat template checked: it shows them, writes
    calls and results, and its calls can be read back. The options of the other names say where the models are and
    what the tokenizer must know (load_tokenizers)."""
    first_prompt = plan.train_dataset[0]["prompt"]
    tokenizer, reward_tokenizer, processor = load_tokenizers(
        first_prompt,
        plan.image_column,
        model_name_or_path=model_name_or_path,
        sft_model_path=sft_model_path,
        reward_model_path=reward_model_path,
        stop_token_id=stop_token_id,
        chat_template_kwargs=chat_template_kwargs,
    )
    if plan.tool_use:
        check_tool_template(
            tokenizer,
            first_prompt,
            plan.image_column,
            stop_token_id=stop_token_id,
            chat_template_kwargs=chat_template_kwargs,
            model_name_or_path=model_name_or_path,
        )
    return tokenizer, reward_tokenizer, processor


def load_models(
    args,
    plan: RunPlan,
    device,
) -> Models:
    """The tokenizers (load_checked_tokenizers), the policy (from sft_model_path, else model_name_or_path, in dtype,
    with attn_implementation) and the reward model (reward_model_path; None: none), on `device`. The reference is the
    initial policy, frozen, needed only for the KL penalty (beta > 0): a copy that runs under the policy's autocast, so
    that the KL is exactly 0 before training; with use_peft it is the policy itself with its adapter (add_adapter: the
    lora_* options, use_dora, seed) disabled: the frozen weights, which need no copy. Frozen linear layers (the
    reference's, the reward model's, a LoRA policy's base) are held in bf16 under bf16 (--bf16), as autocast would cast
    them at every forward: half the memory. A resumed run's policy is its checkpoint's (the plan's). Dropout is off: it
    would make the update's log-probs differ from the sampler's; gradient_checkpointing: activations recomputed in the
    backward."""
    tokenizer, reward_tokenizer, processor = load_checked_tokenizers(
        plan,
        model_name_or_path=args.model_name_or_path,
        sft_model_path=args.sft_model_path,
        reward_model_path=args.reward_model_path,
        stop_token_id=args.stop_token_id,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    policy_path = args.sft_model_path or args.model_name_or_path
    policy = from_pretrained(
        policy_class(policy_path),
        policy_path,
        dtype=model_dtype(args.dtype, policy_path),
        attn_implementation=args.attn_implementation,
    ).to(device)
    reward_model = None
    if args.reward_model_path:
        reward_model = load_reward_model(args.reward_model_path).to(device, torch.float32)
    disable_dropout(policy)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    ref_policy = copy.deepcopy(policy).eval().requires_grad_(False) if args.beta > 0 and not args.use_peft else None
    if args.use_peft:
        policy = add_adapter(policy, **args.lora_options(), seed=args.seed, model_path=policy_path)
        ref_policy = policy if args.beta > 0 else None
    for model in (policy, ref_policy, reward_model):
        frozen_linear_weights_to(model, torch.bfloat16 if args.bf16 else None)
    if plan.checkpoint is not None:
        load_checkpoint_weights(policy, os.path.join(plan.checkpoint, "policy"))
    return Models(tokenizer, reward_tokenizer, processor, policy, ref_policy, reward_model)
