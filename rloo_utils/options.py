"""The options, parsed and checked before anything expensive starts: each bad value is refused in one line that names
it and the fix (check_args), TRL's option names and JSON options included; the batch arithmetic; the learning-rate
schedule an option names."""

import contextlib
import functools
import io
import itertools
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass, replace
from typing import Annotated, Literal, Optional

import torch
import tyro

from rloo_utils.checkpoints import CheckpointOptions
from rloo_utils.data import DataOptions
from rloo_utils.errors import UsageError, describe
from rloo_utils.evaluation import EvaluationOptions
from rloo_utils.logs import LoggingOptions
from rloo_utils.lora import LoraOptions
from rloo_utils.models import ModelOptions, SpeedOptions, set_model_options
from rloo_utils.off_policy import ImportanceSamplingOptions
from rloo_utils.rewards import FLOAT32_MAX, FLOAT32_TINY, RewardSourceOptions
from rloo_utils.tools import ToolUseOptions


def finite_json_number(text: str) -> float:
    """A JSON number as a float, refused past float64 (1e400 would parse as inf); NaN and Infinity, which Python's json
    accepts but JSON does not, are refused by json_object."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past the range of a float: give a finite number")
    return value


def finite_json_int(text: str) -> int:
    """A JSON integer, refused past the range of a float (every option takes it as one)."""
    if abs(value := int(text)) > sys.float_info.max:
        raise ValueError(f"{text[:20]}... ({len(text)} digits) is past the range of a float: give a finite number")
    return value


def not_a_json_number(word: str):
    raise ValueError(f"{word} is not a JSON number: give a finite number")


def json_object(text: str) -> dict:
    try:
        value = json.loads(
            text, parse_float=finite_json_number, parse_int=finite_json_int, parse_constant=not_a_json_number
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"{text!r} is not JSON ({e.msg}); give an object such as '{{\"key\": 1}}'") from None
    except ValueError as e:
        raise ValueError(f"{text if len(text) <= 80 else text[:60] + '...'!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{text!r} is not a JSON object; give one such as '{{\"key\": 1}}'")
    return value


# An option that takes keyword arguments as a JSON object (TRL's dict options, e.g. --chat_template_kwargs)
JsonObject = Annotated[
    Optional[dict],
    tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="JSON",
        instance_from_str=lambda words: json_object(words[0]),
        is_instance=lambda value: value is None or isinstance(value, dict),
        str_from_instance=lambda value: [json.dumps(value)],
    ),
]


@dataclass
class GenerationOptions:
    """Prompts in, completions out: the prompts' length and chat template; besides the temperature, how completions are
    sampled and where they stop (HF's GenerationConfig; rloo_vllm.py: vLLM's SamplingParams)"""

    max_prompt_length: int = 256
    """longer prompts keep their last tokens (and their BOS), counted in `prompts/truncated`"""
    chat_template_kwargs: JsonObject = None
    """arguments of the chat template of conversational prompts, as JSON: '{"enable_thinking": false}' for Qwen3"""
    top_p: float = 1.0
    """nucleus sampling"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    min_p: Optional[float] = None
    """min-p sampling: only tokens at least min_p times as likely as the likeliest one (None: off)"""
    repetition_penalty: float = 1.0
    """> 1 makes tokens already in the prompt or completion less likely (Keskar et al. 2019; 1: off)"""
    generation_kwargs: JsonObject = None
    """more sampling options as JSON, for HF's GenerationConfig (rloo_vllm.py: vLLM's SamplingParams), as in TRL"""
    stop_token_id: Optional[int] = None
    """a further token id that ends a completion (kept, like EOS; everything after it is padding)"""
    ignore_eos: bool = False
    """sample max_completion_length tokens whatever comes (old TRL without --stop_token eos)"""


@dataclass
class OldTrlOptions:
    """Old TRL's names, accepted so that its commands run unchanged (docs/options.md)"""

    sft_model_path: Optional[str] = None
    """old-TRL name: if set, the policy weights come from here and the tokenizer from --model_name_or_path"""
    stop_token: Optional[Literal["eos"]] = None
    """old-TRL flag: end completions at EOS (done anyway unless --ignore_eos; accepted for the seed commands)"""
    normalize_advantages: Annotated[bool, tyro.conf.arg(aliases=("--normalize_advantage",))] = False
    """TRL's name for --advantage_normalization batch"""


@dataclass
class FeatureOptions(
    ModelOptions,
    DataOptions,
    RewardSourceOptions,
    GenerationOptions,
    LoraOptions,
    ToolUseOptions,
    EvaluationOptions,
    LoggingOptions,
    CheckpointOptions,
    SpeedOptions,
    ImportanceSamplingOptions,
    OldTrlOptions,
):
    """The options of the features, a group from each one's module: a script's Args adds the algorithm's own."""


def option_groups(args_class) -> list[type]:
    """The groups of options a script's Args is made of, beside its own: the dataclasses of rloo_utils' modules it
    derives from that declare options (a fork's Args, derived from a script's, has the script's as its own)."""
    return [
        c
        for c in args_class.__mro__
        if is_dataclass(c) and c.__module__.startswith("rloo_utils.") and vars(c).get("__annotations__")
    ]


def derived_defaults(args):
    """args with each group's defaults that follow from other options (its derived_defaults) filled in."""
    derived = {}
    for group in option_groups(type(args)):
        if "derived_defaults" in vars(group):
            derived.update(group.derived_defaults(args))
    return replace(args, **derived)


def resumable_options(args_class) -> set[str]:
    """The options a resumed run may change, none of which alters what it computes: the RESUMABLE of the script's Args
    and of each of its groups (and of a fork's Args)."""
    return set().union(*(vars(c).get("RESUMABLE", ()) for c in args_class.__mro__))


def in_sections(args_class):
    """args_class as the command line shows it: its own options, then each group's in a section of `--help` of its own,
    titled by the group's name and described by its docstring; every flag keeps its name (no prefix), and its default
    is the script's."""
    defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(args_class)}
    spec = []
    for group in option_groups(args_class):
        names = [f.name for f in fields(group)]
        spec += [(name, Annotated[Optional[object], tyro.conf.Suppress], None) for name in names]  # not flat as well
        title = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", group.__name__.removesuffix("Options")).lower()
        group_defaults = functools.partial(group, **{name: defaults[name] for name in names})
        spec.append(
            (group.__name__, Annotated[group, tyro.conf.arg(name=title)], field(default_factory=group_defaults))
        )
    return make_dataclass(args_class.__name__, spec, bases=(args_class,))


def flattened(parsed, args_class):
    """The Args of what in_sections(args_class) parsed: its own options and those of each group side by side."""
    values = {f.name: getattr(parsed, f.name) for f in fields(args_class)}
    for group in option_groups(args_class):
        values.update({f.name: getattr(getattr(parsed, group.__name__), f.name) for f in fields(group)})
    return args_class(**values)


def parse_args(args_class):
    """tyro's parser of a script's Args dataclass, its option groups in sections (in_sections), with its boxed parse
    error folded into one line (help and success are tyro's own); paths given with ~ expanded."""
    captured, view = io.StringIO(), in_sections(args_class)
    try:
        with contextlib.redirect_stderr(captured):
            args = flattened(tyro.cli(view, use_underscores=True, config=(tyro.conf.OmitArgPrefixes,)), args_class)
    except SystemExit as e:
        if not e.code:
            raise  # --help
        # Parse again, as wide as the message, so that no word of it is wrapped inside the box.
        wide, columns = io.StringIO(), os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100000"
        try:
            with contextlib.redirect_stderr(wide):
                tyro.cli(view, use_underscores=True, config=(tyro.conf.OmitArgPrefixes,))
        except SystemExit:
            pass
        finally:
            if columns is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = columns
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip(" │") for line in wide.getvalue().splitlines()[1:]]
        box = itertools.takewhile(lambda line: not line or line.strip("─╰╯"), lines)  # up to the box's rule
        message = " ".join(line for line in box if line)
        rank = os.environ.get("RANK", "0")  # torchrun's; parsing comes before the process group
        if not (rank.isdigit() and int(rank) > 0):  # every process fails alike: rank 0 says it once for all
            print(
                f"{os.path.basename(sys.argv[0])}: error: {message or 'could not parse the options'} "
                f"(`python {sys.argv[0]} --help` lists them)",
                file=sys.stderr,
            )
        else:  # torchrun stops the other processes when one exits: rank 0 must have said it first (it exits at once)
            for stop in (signal.SIGTERM, signal.SIGINT):  # stopped meanwhile (torchrun, Ctrl-C): silently
                signal.signal(stop, signal.SIG_DFL)
            time.sleep(PARSE_ERROR_WAIT)
        sys.exit(2)  # argparse's status for a usage error
    sys.stderr.write(captured.getvalue())  # tyro's warnings, if any
    return expand_user_paths(args)


PARSE_ERROR_WAIT = 10  # seconds another process waits, after a parse error, for rank 0 to say it and exit


def batch_sizes(args, world_size: int = 1) -> tuple[int, int, int]:
    """(completions per rollout, completions per minibatch, rollouts) over all processes, as in old TRL: the per-device
    sizes times the number of processes."""
    mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    batch_size = mini_batch_size * args.num_mini_batches
    return batch_size, mini_batch_size, args.total_episodes // batch_size


# Paths a user may write with ~ (expanded before anything else sees them)
PATH_OPTIONS = [
    "model_name_or_path",
    "sft_model_path",
    "dataset_name",
    "reward_model_path",
    "output_dir",
    "resume_from_checkpoint",
]


# Float options that may be infinite: --max_grad_norm inf is no clipping, --reward_clip_range -inf 5 clips one side
MAY_BE_INFINITE = {"max_grad_norm", "reward_clip_range"}


def expand_user_paths(args):
    expanded = {name: os.path.expanduser(getattr(args, name)) for name in PATH_OPTIONS if getattr(args, name)}
    if args.reward_funcs is not None:
        expanded["reward_funcs"] = [os.path.expanduser(spec) for spec in args.reward_funcs]
    return replace(args, **expanded)


def check_args(args, world_size: int = 1) -> None:
    """Every option on its own and with the others (the vLLM ones: check_vllm_args), before anything is loaded."""
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
    for name in ["run_name", "exp_name"]:
        value = getattr(args, name)
        if value is not None and (value in ("", ".", "..") or "/" in value):
            raise UsageError(f"--{name} names a folder in runs/ and must be a plain name (no '/'), got {value!r}")
    if args.output_dir == "":
        raise UsageError("--output_dir is empty: give a folder, or leave it out for runs/<run_name>/model")
    if args.stop_token_id is not None and args.stop_token_id < 0:
        raise UsageError(f"--stop_token_id must be a token id (>= 0), got {args.stop_token_id}")
    if args.ignore_eos and args.stop_token == "eos":
        raise UsageError("--ignore_eos samples past EOS and --stop_token eos stops at it: give one of them")
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
    if args.num_sample_generations and not args.num_sample_prompts:
        raise UsageError(
            "--num_sample_prompts 0 leaves the sample tables (--num_sample_generations "
            f"{args.num_sample_generations}) empty: give at least 1, or --num_sample_generations 0 for none"
        )
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise UsageError(
            f"--save_total_limit must be >= 1 (or left out to keep every checkpoint), got {args.save_total_limit}"
        )
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")
    for name in ["cache_implementation", "sampler_weights", "decoding_loop"]:  # HF generate's
        if getattr(args, name) != "auto" and (
            getattr(args, "vllm_mode", None) or getattr(args, "vllm_server_host", None)
        ):
            raise UsageError(
                f"--{name} {getattr(args, name)} is HF generate's, and this run generates with vLLM: leave it out"
            )
    if args.fused_output_layer == "on" and not args.padding_free:
        raise UsageError(
            "--fused_output_layer on makes the gradient of the padding-free log-probs' output layer, and "
            "--no_padding_free computes padded log-probs through the whole model: leave one of them out"
        )
    if args.sampler_weights != "auto" and hasattr(args, "gather_for_generation"):
        raise UsageError(
            f"--sampler_weights {args.sampler_weights}: rloo_multigpu.py samples from the weights FSDP gathers "
            "(bfloat16 under --bf16, its mixed precision), never a copy: leave it out"
        )
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
    check_adapter_args(args)
    check_trl_options(args)
    if args.num_generations < 2:
        raise UsageError(f"--num_generations must be >= 2 for a leave-one-out baseline, got {args.num_generations}")
    if args.dtype == "float16":
        raise UsageError(
            "--dtype float16: AdamW's eps and (1 - beta2) g^2 underflow in float16 and the first step writes "
            "inf/NaN into the weights; train float32 weights (--bf16 computes in bf16 on them)"
        )
    batch_size, _, num_updates = batch_sizes(args, world_size)
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
    set_model_options(args)


# Sampling options the scripts set themselves, which --generation_kwargs must not override: the flag to use instead
OWN_SAMPLING_OPTIONS = {
    "temperature": "--temperature",
    "top_p": "--top_p",
    "top_k": "--top_k",
    "min_p": "--min_p",
    "repetition_penalty": "--repetition_penalty",
    "max_new_tokens": "--max_completion_length",
    "max_tokens": "--max_completion_length",
    "max_length": "--max_completion_length",
    "eos_token_id": "--stop_token_id",
    "stop_token_ids": "--stop_token_id",
    "ignore_eos": "--ignore_eos",
    "seed": "--seed",
    "n": "--num_generations",
    "num_return_sequences": "--num_generations",
    "cache_implementation": "--cache_implementation",
    "compile_config": "--cache_implementation",
    "max_cache_len": "--cache_implementation",
}


# ...and those that would break the rollout: one sampled completion per row with its log-probs, as token ids
# (min_length keeps EOS from being sampled; max_time cuts completions by the clock, as the machine's load decides)
RESERVED_SAMPLING_OPTIONS = {
    "do_sample",
    "num_beams",
    "num_beam_groups",
    "pad_token_id",
    "suppress_tokens",
    "logprobs",
    "logprob_token_ids",
    "detokenize",
    "min_tokens",
    "min_new_tokens",
    "min_length",
    "max_time",
    "output_kind",
    "logit_bias",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
}


# ...and those that read text, which the rollout does not make (prompts and completions are token ids)
TEXT_SAMPLING_OPTIONS = {"stop", "stop_strings", "bad_words", "structured_outputs", "guided_decoding"}


# apply_chat_template's own arguments (transformers' tokenizers and processors), which a prompt's tokenization sets:
# --chat_template_kwargs passes only what reaches the template (its variables, tools, documents, chat_template)
CHAT_TEMPLATE_CALL_ARGUMENTS = {
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "processor_kwargs",
    "load_audio_from_video",
}


def check_trl_options(args) -> None:
    """The options TRL users bring (model loading, sampling, the schedule, completion tables)."""
    if args.model_revision is not None and os.path.exists(args.sft_model_path or args.model_name_or_path):
        raise UsageError(
            f"--model_revision {args.model_revision} picks a version of a hub model, but "
            f"{args.sft_model_path or args.model_name_or_path} is a local path: leave it out"
        )
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise UsageError(f"--min_p must be in [0, 1], got {args.min_p}")
    if not args.repetition_penalty > 0:
        raise UsageError(f"--repetition_penalty must be > 0 (1: none), got {args.repetition_penalty}")
    vllm = (
        hasattr(args, "vllm_mode")
        or getattr(args, "vllm_server_host", None)
        or getattr(args, "vllm_server_base_url", None)
    )
    for key in args.generation_kwargs or {}:
        if key in OWN_SAMPLING_OPTIONS:
            raise UsageError(f"--generation_kwargs sets {key}, which {OWN_SAMPLING_OPTIONS[key]} sets: use that option")
        if key in RESERVED_SAMPLING_OPTIONS:
            raise UsageError(
                f"--generation_kwargs sets {key}, which the rollout sets itself (one sampled completion per "
                "row, as token ids with their log-probs): leave it out"
            )
        if key in TEXT_SAMPLING_OPTIONS:
            raise UsageError(
                f"--generation_kwargs sets {key}, which works on text, but the rollout samples token ids "
                "without decoding them: end completions with --stop_token_id, or score them in a reward function"
            )
    if args.generation_kwargs and not vllm:
        from transformers import GenerationConfig

        known = GenerationConfig().to_dict()
        unknown = sorted(set(args.generation_kwargs) - set(known))
        if unknown:
            raise UsageError(
                f"--generation_kwargs: {', '.join(unknown)} is not an option of transformers' GenerationConfig "
                "(rloo.py and rloo_multigpu.py generate with HF generate; vLLM's SamplingParams options go to "
                "rloo_vllm.py)"
            )
        try_generation_kwargs(args.generation_kwargs)
    reserved = sorted(set(args.chat_template_kwargs or {}) & CHAT_TEMPLATE_CALL_ARGUMENTS)
    if reserved:
        raise UsageError(
            f"--chat_template_kwargs sets {', '.join(reserved)}, an argument of apply_chat_template that "
            "the prompt's tokenization sets itself: give only the template's own variables (e.g. "
            "enable_thinking), tools, documents or chat_template"
        )
    if args.warmup_steps >= 1 and args.warmup_steps != int(args.warmup_steps):
        raise UsageError(
            f"--warmup_steps {args.warmup_steps}: give a number of steps (a whole number), or a fraction of "
            "all optimizer steps below 1"
        )
    kwargs = args.lr_scheduler_kwargs or {}
    for key, value in kwargs.items():  # (checked here, without importing transformers before the run's claim)
        if key not in SCHEDULE_ARGUMENTS[args.lr_scheduler_type]:
            takes = ", ".join(sorted(SCHEDULE_ARGUMENTS[args.lr_scheduler_type])) or "nothing"
            raise UsageError(
                f"--lr_scheduler_type {args.lr_scheduler_type} with --lr_scheduler_kwargs {json.dumps(kwargs)}: "
                f"{key} is not an argument of that schedule (it takes {takes})"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise UsageError(f"--lr_scheduler_kwargs: {key} must be a number >= 0, got {value!r}")
    # What the schedule would take and misuse: a floor above the rate climbs to it, no cycles never decays
    if not 0 <= kwargs.get("min_lr_rate", 0) <= 1:
        raise UsageError(
            "--lr_scheduler_kwargs: min_lr_rate is the floor as a fraction of --learning_rate, in [0, 1], "
            f"got {kwargs['min_lr_rate']}"
        )
    if kwargs.get("min_lr", 0) > args.learning_rate:
        raise UsageError(
            f"--lr_scheduler_kwargs: min_lr {kwargs['min_lr']} is above --learning_rate "
            f"{args.learning_rate}, so the schedule would climb to it: give a floor at or below the rate"
        )
    if kwargs.get("num_cycles", 1) == 0:
        raise UsageError(
            "--lr_scheduler_kwargs: num_cycles 0 never decays the rate: use --lr_scheduler_type constant, "
            "or a number of cycles > 0 (0.5: one half-cosine to the floor)"
        )
    if args.lr_scheduler_type == "cosine_with_min_lr" and len({"min_lr", "min_lr_rate"} & set(kwargs)) != 1:
        raise UsageError(
            "--lr_scheduler_type cosine_with_min_lr needs one of min_lr or min_lr_rate in --lr_scheduler_kwargs "
            "(e.g. '{\"min_lr_rate\": 0.1}': the floor is 10% of --learning_rate)"
        )
    if args.num_completions_to_print is not None and not args.log_completions:
        raise UsageError("--num_completions_to_print limits the table of --log_completions: add --log_completions")
    if args.num_completions_to_print is not None and args.num_completions_to_print < 1:
        raise UsageError(
            f"--num_completions_to_print must be >= 1 (or left out to print them all), got "
            f"{args.num_completions_to_print}"
        )


def try_generation_kwargs(generation_kwargs: dict) -> None:
    """--generation_kwargs as HF generate takes them, tried on a one-layer stand-in model (milliseconds) so that a
    value it cannot use (a string where a number belongs, an unknown cache) is one line before the policy loads."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    try:
        generation_config = GenerationConfig(do_sample=True, max_new_tokens=2, pad_token_id=0, **generation_kwargs)
        generation_config.validate(strict=True)
        with torch.random.fork_rng(devices=[]):  # the run's random streams stay as its seed set them
            prompt = torch.ones(1, 2, dtype=torch.long)
            LlamaForCausalLM(config).generate(prompt, attention_mask=prompt, generation_config=generation_config)
    except Exception as e:
        raise UsageError(
            f"--generation_kwargs {json.dumps(generation_kwargs)}: HF generate cannot use it ({describe(e)})"
        ) from None


# --lr_scheduler_type -> transformers' schedule: each with a linear warm-up from 0 over --warmup_steps
SCHEDULES = {
    "linear": "linear",
    "constant": "constant_with_warmup",
    "cosine": "cosine",
    "cosine_with_min_lr": "cosine_with_min_lr",
}


# ...and the arguments each takes in --lr_scheduler_kwargs (transformers' get_scheduler)
SCHEDULE_ARGUMENTS = {
    "linear": set(),
    "constant": set(),
    "cosine": {"num_cycles"},
    "cosine_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate"},
}


def clip_bounds(reward_clip_range: list[float]) -> tuple[float, float]:
    if len(reward_clip_range) == 1:
        return -abs(reward_clip_range[0]), abs(reward_clip_range[0])
    return reward_clip_range[0], reward_clip_range[1]


def looks_local(path: str) -> bool:
    """A path that cannot be a hub id: absolute, relative with ./ or ../, ~, or a file name with an extension we
    read."""
    return path.startswith(("/", "./", "../", "~")) or path.endswith(
        (".gguf", ".jsonl", ".json", ".parquet", ".csv", ".py")
    )


def lr_scheduler(optimizer, args, total_steps: int):
    """Linear warm-up from 0 over --warmup_steps optimizer steps (below 1: that fraction of total_steps, rounded up, as
    transformers does), then the --lr_scheduler_type schedule until total_steps."""
    from transformers import get_scheduler

    warmup_steps = math.ceil(args.warmup_steps * total_steps) if args.warmup_steps < 1 else int(args.warmup_steps)
    return get_scheduler(
        SCHEDULES[args.lr_scheduler_type],
        optimizer,
        warmup_steps,
        total_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )


LORA_OPTIONS = [
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_modules_to_save",
    "use_dora",
    "save_merged_model",
]


def check_adapter_args(args) -> None:
    """The LoRA options: only with --use_peft, in range, and never a reward model that is the policy's own weights."""
    defaults = {field.name: field.default for field in fields(args)}
    given = [f"--{name}" for name in LORA_OPTIONS if getattr(args, name) != defaults[name]]
    if given and not args.use_peft:
        raise UsageError(
            f"{' '.join(given)} set{'s' if len(given) == 1 else ''} up LoRA adapters, which --use_peft "
            "turns on: add --use_peft, or leave them out"
        )
    if not args.use_peft:
        return
    if args.lora_r < 1 or not args.lora_alpha > 0:
        raise UsageError(f"--lora_r must be >= 1 and --lora_alpha > 0, got {args.lora_r} and {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lora_target_modules == []:
        raise UsageError(
            "--lora_target_modules is empty: name the layers that get adapters (or all-linear), or leave "
            "it out for peft's default of the architecture"
        )
    policy = args.sft_model_path or args.model_name_or_path
    if args.reward_model_path is not None and same_path(args.reward_model_path, policy):
        raise UsageError(
            f"--reward_model_path {args.reward_model_path} is the policy's own model: with --use_peft the "
            "policy's weights are the base its adapter trains on, not a reward model; give a sequence "
            "classifier trained to score completions"
        )


def same_path(a: str, b: str) -> bool:
    return a == b or looks_local(a) and looks_local(b) and os.path.abspath(a) == os.path.abspath(b)
