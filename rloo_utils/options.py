"""The options, parsed and checked before anything expensive starts: a script's Args, its groups of options (each
in its feature's module) in sections of `--help` (parse_args); the checks common to every option and those of the
algorithm's own, then each group's own check() (check_args), each bad value refused in one line that names it and the
fix; the batch arithmetic."""

import contextlib
import functools
import io
import itertools
import math
import os
import re
import signal
import sys
import time
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass, replace
from typing import Annotated, Optional

import tyro

from rloo_utils.checkpoints import CheckpointOptions
from rloo_utils.data import DataOptions
from rloo_utils.errors import UsageError
from rloo_utils.evaluation import EvaluationOptions
from rloo_utils.logs import LoggingOptions
from rloo_utils.lora import LoraOptions
from rloo_utils.models import Generator, ModelOptions, OldTrlOptions, SpeedOptions, set_model_options
from rloo_utils.generation import GenerationOptions
from rloo_utils.off_policy import ImportanceSamplingOptions
from rloo_utils.paths import looks_local
from rloo_utils.rewards import FLOAT32_MAX, FLOAT32_TINY, RewardSourceOptions, clip_bounds
from rloo_utils.schedules import ScheduleOptions
from rloo_utils.tools import ToolUseOptions


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
    ScheduleOptions,
    SpeedOptions,
    ImportanceSamplingOptions,
    OldTrlOptions,
    Generator,  # last: the vLLM groups derived from it (a script's Args lists them after this) then precede it alone
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


def own_fields(group) -> list:
    """The options a group declares itself, not those of a group it is built on (VLLMOptions on ServerOptions): each
    option has one section, its declaring group's."""
    declared = vars(group).get("__annotations__", {})
    return [f for f in fields(group) if f.name in declared]


def section(group):
    """A group as its section of `--help` parses it: its own options, those it inherits hidden (they are parsed in
    their own group's section, and a flag can be parsed in only one)."""
    own = {f.name for f in own_fields(group)}
    inherited = [f.name for f in fields(group) if f.name not in own]
    if not inherited:
        return group
    hidden = [(name, Annotated[Optional[object], tyro.conf.Suppress], None) for name in inherited]
    return make_dataclass(group.__name__, hidden, bases=(group,), namespace={"__doc__": group.__doc__})


def in_sections(args_class):
    """args_class as the command line shows it: its own options, then each group's own (own_fields) in a section of
    `--help` of its own, titled by the group's name and described by its docstring; every flag keeps its name (no
    prefix), and its default is the script's."""
    defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(args_class)}
    spec = []
    for group in option_groups(args_class):
        names = [f.name for f in own_fields(group)]
        spec += [(name, Annotated[Optional[object], tyro.conf.Suppress], None) for name in names]  # not flat as well
        title = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", group.__name__.removesuffix("Options")).lower()
        view = section(group)
        group_defaults = functools.partial(view, **{name: defaults[name] for name in names})
        spec.append((group.__name__, Annotated[view, tyro.conf.arg(name=title)], field(default_factory=group_defaults)))
    return make_dataclass(args_class.__name__, spec, bases=(args_class,))


def flattened(parsed, args_class):
    """The Args of what in_sections(args_class) parsed: its own options and those of each group side by side."""
    values = {f.name: getattr(parsed, f.name) for f in fields(args_class)}
    for group in option_groups(args_class):
        values.update({f.name: getattr(getattr(parsed, group.__name__), f.name) for f in own_fields(group)})
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
