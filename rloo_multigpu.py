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

Read it in order: Args (the algorithm's options; a feature's are its module's), the estimators and losses, main()
(set-up in a few calls, then the training loop, one stage of an update after the other), and completion_logprobs, the
definition of the log-probs. The seams the loop calls are in rloo_utils/: the sampler (sharded_sampling.ShardedSampler:
HF generate on the shards, or a vLLM server; a rollout, the value it gives, and what every sampler does: rollouts.py),
the default log-probs (packing.py), the scorer, the evaluation. What a reader of the algorithm never needs (checks, the
set-up, run folders, checkpoints and resume, logging) is there too, called by its module's name: checks.check_args(...).

    python rloo_multigpu.py --help                            # every option; batch sizes are per process
    torchrun --nproc_per_node 2 rloo_multigpu.py              # the embedded default on 2 processes
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 rloo_multigpu.py ...
"""

import contextlib
import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Callable, Literal, Optional

import torch
import transformers
import tyro
from rich.console import Console

from rloo_utils import checkpoints, checks, data, errors, evaluation, lifecycle, logs, lora, off_policy, options
from rloo_utils import packing, rollout_queue, rollouts, set_up, vision
from rloo_utils.models import optimizer_step, set_up_cuda
from rloo_utils.processes import agreed, all_reduce, end_processes, gather_rows, init_processes
from rloo_utils.processes import launch_world_size, max_over_processes, reduce_micro_stats
from rloo_utils.rewards import group_std, shaped_scores, task_scores
from rloo_utils.scoring import TrainerState
from rloo_utils.sharded import ShardedScorer, ShardingOptions, load_sharded_checkpoint, load_sharded_models, reshard
from rloo_utils.sharded import save_sharded_checkpoint, save_sharded_model
from rloo_utils.sharded_sampling import ShardedSampler
from rloo_utils.vllm_options import ServerOptions, check_vllm_args
from rloo_utils.vllm_sampling import sampler_support
from rloo_utils.vllm_server import VLLMServer


@dataclass
class Args(options.FeatureOptions, ShardingOptions, ServerOptions):
    """Every option: the algorithm's here; a feature's in its module (FeatureOptions), a section of --help each."""

    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (prefix of the run name)"""
    seed: int = 1
    """seed of python, numpy and torch"""

    # Reward (where the score comes from: RewardSourceOptions)
    missing_eos_penalty: Optional[float] = None
    """subtracted from the score of a completion that did not stop by itself ("EOS trick")"""
    normalize_reward: bool = False
    """whiten the scores over the batch before the KL penalty (old TRL)"""
    reward_clip_range: Optional[list[float]] = None
    """clip scores to [lo, hi] (two numbers) or [-c, c] (one number), after normalize_reward"""

    # Generation (the prompts, and the sampler's filters and stop tokens: GenerationOptions)
    num_generations: Annotated[int, tyro.conf.arg(aliases=("--rloo_k",))] = 4
    """completions per prompt (G, the RLOO k); at least 2"""
    max_completion_length: Annotated[int, tyro.conf.arg(aliases=("--response_length",))] = 32
    """maximum number of generated tokens per completion"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed on logits / temperature"""
    mask_truncated_completions: bool = False
    """completions that did not end get no gradient; their reward, KL penalty included, still counts in the baseline"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose G scores are all equal (no gradient) is dropped, new prompts sampled"""
    max_sampling_rounds: int = 10
    """(dynamic_sampling) rounds of sampling per update, the first included; then dropped groups fill what is missing"""

    # RL objective
    beta: Annotated[float, tyro.conf.arg(aliases=("--kl_coef",))] = 0.05
    """KL coefficient: reward = score - beta * KL(policy || reference); 0 loads no reference model"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL: k1 = log p - log p_ref; k3 = exp(-d) + d - 1 (Schulman 2020)"""
    token_level_kl: bool = False
    """each token's advantage carries the KL penalties from that token on (REINFORCE++ eq. 1)"""
    advantage_estimator: "AdvantageEstimator" = "rloo"
    """baseline within each group of G: rloo = mean of the other G-1; grpo, dr_grpo, reinforce_pp = the group mean"""
    advantage_normalization: Literal["estimator", "none", "group", "batch"] = "estimator"
    """scaling of the centred advantages: none, group (/ group std), batch (whitened), or the estimator's own"""
    loss_type: "LossType" = "sequence"
    """sequence (TRL's RLOO: clipped sequence ratio), token (-A log p), cispo, gspo or sapo (docs/algorithm.md)"""
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
    loss_aggregation: Optional[
        Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    ] = None
    """(token-level losses) per-token losses to the minibatch loss; None: seq-mean-token-mean for gspo"""
    entropy_coef: float = 0.0
    """entropy bonus: c x the policy's entropy over the loss's tokens, aggregated as the loss is, subtracted from it"""

    # Optimisation
    total_episodes: int = 640
    """total number of completions to train on"""
    per_device_train_batch_size: int = 16
    """completions per forward/backward micro-batch, on each process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    max_tokens_per_micro_batch: Optional[int] = None
    """micro-batches packed to at most this many tokens (prompt + completion) instead of fixed rows; same gradient"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over one rollout batch"""
    num_ppo_epochs: int = 1
    """passes over each rollout batch (ratio != 1 from the second minibatch on)"""
    learning_rate: float = 3e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""


# ---- KL, advantages, losses ------------------------------------------------------------------------------------------
def per_token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(policy || reference) estimated per sampled token (http://joschu.net/blog/kl-approx.html)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    return torch.exp(-d) + d - 1  # k3: unbiased and always >= 0


def kl_penalized_reward(scores, kl, mask, beta: float, token_level: bool):
    """Fold the KL penalty into the reward (detached; TRL order). Returns (B,) sequence rewards and (B,) -beta*KL.

    Sequence level: r = score - beta * sum_t kl_t. Token level (old TRL): r_t = -beta*kl_t with the score added at the
    last real token; its sum over t is the same number. The per-token form acts through compute_advantages' kl_before.
    """
    kl_penalty = -beta * kl * mask  # (B, C)
    if token_level:
        last = packing.last_true_index(mask)  # (B,)
        token_rewards = kl_penalty.clone()
        token_rewards[torch.arange(len(last)), last] += scores
        return token_rewards.sum(1), kl_penalty.sum(1)
    return scores + kl_penalty.sum(1), kl_penalty.sum(1)


def kl_penalty_before(kl, beta: float, token_level: bool):
    """(B, C) beta times the KL of the tokens before each token, which the token-level KL does not charge it
    (compute_advantages; REINFORCE++, Hu 2025, eq. 1); zeros with the sequence-level KL: every token is charged all."""
    return beta * (kl.cumsum(1) - kl) if token_level else torch.zeros_like(kl)


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


def has_baseline(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(B,) rows that are scored and have a scored sibling to compare with; the others get no gradient."""
    scorable = ~rewards.view(-1, num_generations).isnan()
    return (scorable & (scorable.sum(1, keepdim=True) > 1)).view(-1)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: its baseline, (B,) rewards and G -> (B,) rewards centred within their groups; the
    scaling it comes with in its paper (--advantage_normalization estimator); the scalings it refuses, and why."""

    baseline: Callable
    normalization: str
    refuses: dict = field(default_factory=dict)


# --advantage_estimator: a new estimator is a function and an entry
ESTIMATORS = {
    "rloo": Estimator(rloo_advantages, "none"),  # r_i - mean_{j != i} r_j (Ahmadian et al. 2024)
    "grpo": Estimator(group_mean_advantages, "group"),  # (r_i - mean) / (std + 1e-4) (Shao et al. 2024)
    "dr_grpo": Estimator(  # r_i - mean (Liu et al. 2025)
        group_mean_advantages,
        "none",
        refuses={
            "batch": "does not take batch normalisation: Dr. GRPO drops the division by a std (--advantage_estimator "
            "reinforce_pp whitens group-centred advantages over the batch)"
        },
    ),
    "reinforce_pp": Estimator(  # r_i - mean, whitened over the batch (Hu 2025)
        group_mean_advantages,
        "batch",
        refuses=dict.fromkeys(
            ["none", "group"],
            "needs batch normalisation (REINFORCE++ whitens the group-centred advantages over the whole batch)",
        ),
    ),
}
AdvantageEstimator = Literal[tuple(ESTIMATORS)]  # --advantage_estimator's choices


def whiten_over_batch(advantages: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A - mean) / (std + 1e-4) over the rows that carry a gradient (the others stay 0), and the divisor."""
    if valid.sum() < 2:
        return advantages, torch.ones(())
    a = advantages[valid]
    return torch.where(valid, (advantages - a.mean()) / (a.std() + 1e-4), 0.0), a.std() + 1e-4


def compute_advantages(rewards, kl_before, in_loss, num_generations: int, estimator: str, normalization: str):
    """(B, C) advantage of each completion token: the estimator's baseline within each group, then the scaling; rows
    that do not train get 0. kl_before (B, C): the KL penalty of the tokens before each token, which the token-level
    KL does not charge it (REINFORCE++, Hu 2025, eq. 1: r_t = -beta kl_t, plus the score at the last token; the return
    from t on sums r_s for s >= t), so A_t = A + kl_before_t, scaled like A; zeros with the sequence-level KL. Column 0
    (no token before it) is the completion's advantage A, the one the sequence-level losses use.

    rloo          r_i - mean_{j != i} r_j                 (Ahmadian et al. 2024)
    grpo          (r_i - mean) / (std + 1e-4)             (Shao et al. 2024, DeepSeekMath)
    dr_grpo       r_i - mean                              (Liu et al. 2025, Dr. GRPO)
    reinforce_pp  r_i - mean, then whitened over the batch (Hu 2025, REINFORCE++)
    """
    advantages = ESTIMATORS[estimator].baseline(rewards, num_generations)  # (B,)
    divisor = torch.ones_like(advantages)  # what the centred reward is divided by
    if normalization == "group":
        divisor = group_std(rewards, num_generations) + 1e-4
        advantages = advantages / divisor
    elif normalization == "batch":
        advantages, batch_std = whiten_over_batch(advantages, in_loss)
        divisor = divisor * batch_std
    return torch.where(in_loss[:, None], advantages[:, None] + kl_before / divisor[:, None], 0.0)  # (B, C)


# The losses: each takes (b, C) log-probs under the policy and under the one that sampled, (b, C) advantages per token
# (with the sequence-level KL every token of a completion has its A), the (b, C) mask of the policy's tokens and the
# options; it returns its losses, (b,) one per completion or (b, C) one per token, the detached log-ratio
# log pi / pi_old of the units its clip acts on, (b,) or (b, C), and statistics of its own by their metric's name (their
# mean over those units is logged). A new loss is a function and an entry in LOSSES.
def sequence_loss(logprobs, old_logprobs, advantages, mask, args):
    """TRL's RLOO: PPO's clipped surrogate (Schulman et al. 2017) on the sequence ratio rho_i = pi(y_i|x_i) /
    pi_old(y_i|x_i), (b,) losses max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)): the whole completion is one
    action."""
    logprob_sum, old_logprob_sum = (logprobs * mask).sum(1), (old_logprobs * mask).sum(1)  # (b,)
    ratio, a = torch.exp(logprob_sum - old_logprob_sum), advantages[:, 0]
    loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high))
    return loss, logprob_sum.detach() - old_logprob_sum, {}


def token_loss(logprobs, old_logprobs, advantages, mask, args):
    """REINFORCE per token (Williams 1992), (b, C) losses -A log pi(y_t); with --ppo_clip, PPO's clipped surrogate on
    each token's ratio, and with --dual_clip c (Ye et al. 2020) the loss of a token with A < 0 capped at c|A|, so that
    a huge ratio cannot blow up the update."""
    log_ratio = logprobs.detach() - old_logprobs
    if not args.ppo_clip:
        return -advantages * logprobs, log_ratio, {}
    ratio = torch.exp(logprobs - old_logprobs)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - args.epsilon, 1 + args.epsilon_high))
    if args.dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -args.dual_clip * advantages), loss)
    return loss, log_ratio, {}


def cispo_loss(logprobs, old_logprobs, advantages, mask, args):
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped ratio under a stop-gradient, (b, C) losses
    -sg(clip(ratio)) A log pi(y_t). Unlike PPO no token loses its gradient; clipping only bounds its weight."""
    log_ratio = logprobs.detach() - old_logprobs
    weight = torch.exp(log_ratio).clamp(1 - args.epsilon, 1 + args.epsilon_high)
    return -weight * advantages * logprobs, log_ratio, {}


def masked_mean_per_row(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, C) -> (B,): the mean of each row over its real tokens."""
    return (x * mask).sum(1) / mask.sum(1).clamp(min=1)


def gspo_loss(logprobs, old_logprobs, advantages, mask, args):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios
    s = exp(mean_t (log pi - log pi_old)), clipped like PPO. Token form, (b, C): s_t = sg(s) pi(y_t) / sg(pi(y_t)) has
    the value s and the gradient s grad log pi(y_t); averaged over the tokens of a sequence it is s grad log s. Its
    log-ratio is log s, (b,)."""
    log_s = masked_mean_per_row(logprobs.detach() - old_logprobs, mask)  # (b,)
    s = torch.exp(log_s)[:, None] * torch.exp(logprobs - logprobs.detach())  # (b, C)
    loss = torch.maximum(-advantages * s, -advantages * s.clamp(1 - args.epsilon, 1 + args.epsilon_high))
    return loss, log_s, {}


def sapo_loss(logprobs, old_logprobs, advantages, mask, args):
    """SAPO (arXiv:2511.20347, 2025): a smooth sigmoid gate in place of the hard clip, (b, C) losses -gate A with
    gate = sigmoid(tau (ratio - 1)) 4 / tau, tau = tau_pos where A > 0 else tau_neg. d gate / d ratio = 1 at ratio 1
    (REINFORCE on-policy) and fades away from it."""
    ratio = torch.exp(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, args.sapo_tau_pos, args.sapo_tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return -gate * advantages, logprobs.detach() - old_logprobs, {"sapo/gate_mean": gate.detach()}


@dataclass(frozen=True)
class Loss:
    """A loss: its function; how its per-token losses make the minibatch's (--loss_aggregation's default; None: one
    loss per completion); its clip range [1 - epsilon, 1 + epsilon_high] where --epsilon is not given; SAPO's gate
    temperatures (tau_pos, tau_neg)."""

    function: Callable
    aggregation: Optional[str]
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    gate_temperatures: Optional[tuple[float, float]] = None


# --loss_type: a new loss is a function and an entry
LOSSES = {
    "sequence": Loss(sequence_loss, None),  # TRL's RLOO
    "token": Loss(token_loss, "token-mean"),  # REINFORCE, or PPO per token (--ppo_clip)
    "cispo": Loss(cispo_loss, "token-mean"),
    "gspo": Loss(gspo_loss, "seq-mean-token-mean", 3e-4, 4e-4),  # each sequence weighs the same; the paper's clip range
    "sapo": Loss(sapo_loss, "token-mean", gate_temperatures=(1.0, 1.05)),
}
LossType = Literal[tuple(LOSSES)]  # --loss_type's choices


def check_algorithm(args: Args) -> None:
    """The estimator's and the loss's options, alone and together: what does not make sense is refused with why."""
    if args.normalize_advantages and args.advantage_normalization not in ("estimator", "batch"):
        raise errors.UsageError(
            f"--normalize_advantages means --advantage_normalization batch, which contradicts "
            f"--advantage_normalization {args.advantage_normalization}; give one of them"
        )
    normalization = "batch" if args.normalize_advantages else args.advantage_normalization
    refused = ESTIMATORS[args.advantage_estimator].refuses.get(normalization)
    if refused:
        raise errors.UsageError(
            f"--advantage_estimator {args.advantage_estimator} {refused}, got --advantage_normalization {normalization}"
        )
    for name in ["epsilon", "epsilon_high", "sapo_tau_pos", "sapo_tau_neg"]:
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise errors.UsageError(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.epsilon is not None and args.epsilon >= 1:
        raise errors.UsageError(
            f"--epsilon must be < 1 (the ratio is clipped to [1 - epsilon, 1 + epsilon_high]), got {args.epsilon}"
        )
    if args.ppo_clip and args.loss_type != "token":
        reason = "clips its sequence ratio already" if args.loss_type == "sequence" else "has its own ratio handling"
        raise errors.UsageError(
            f"--ppo_clip layers PPO clipping on --loss_type token; --loss_type {args.loss_type} {reason}"
        )
    if args.dual_clip is not None and not args.ppo_clip:
        raise errors.UsageError("--dual_clip is part of PPO clipping: add --ppo_clip (with --loss_type token)")
    if args.dual_clip is not None and not args.dual_clip > 1:
        raise errors.UsageError(
            f"--dual_clip must be > 1 (it caps the loss of A < 0 tokens at c*|A|), got {args.dual_clip}"
        )
    if args.loss_aggregation is not None and LOSSES[args.loss_type].aggregation is None:
        raise errors.UsageError(
            f"--loss_aggregation applies to token-level losses; --loss_type {args.loss_type} has one term per "
            "completion (its ratio sums the token log-probs)"
        )
    if (args.sapo_tau_pos, args.sapo_tau_neg) != (None, None) and LOSSES[args.loss_type].gate_temperatures is None:
        raise errors.UsageError(
            f"--sapo_tau_pos/--sapo_tau_neg are the gate temperatures of --loss_type sapo, "
            f"not of --loss_type {args.loss_type}"
        )


def resolve_defaults(args: Args) -> Args:
    """The defaults that follow from other options: the estimator's scaling and the loss's clip range, aggregation and
    gate temperatures, from their entries above; each feature's, from its option group (options.derived_defaults).
    After the checks, which see what the user gave."""
    estimator, loss = ESTIMATORS[args.advantage_estimator], LOSSES[args.loss_type]
    normalization = args.advantage_normalization
    if normalization == "estimator":
        normalization = "batch" if args.normalize_advantages else estimator.normalization
    epsilon = loss.epsilon if args.epsilon is None else args.epsilon
    epsilon_high = args.epsilon_high
    if epsilon_high is None:
        epsilon_high = loss.epsilon_high if args.epsilon is None else epsilon
    tau_pos, tau_neg = loss.gate_temperatures or (None, None)
    return replace(
        options.derived_defaults(args),
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        advantage_normalization=normalization,
        loss_aggregation=loss.aggregation and (args.loss_aggregation or loss.aggregation),
        sapo_tau_pos=tau_pos and (args.sapo_tau_pos or tau_pos),
        sapo_tau_neg=tau_neg and (args.sapo_tau_neg or tau_neg),
    )


def tokens_in_loss(mask, in_loss):
    """The tokens of a minibatch's rows that enter the loss, token-mean's divisor: counted over the whole global
    minibatch, every process's rows, so that the shares of every micro-batch of every process add up to its loss."""
    return all_reduce((mask * in_loss[:, None]).sum()).clamp(min=1)


def aggregate_loss(
    token_loss, loss_mask, mode: str, mini_batch_size: int, mini_batch_tokens, max_completion_length: int
):
    """This micro-batch's share of the minibatch loss from (b, C) per-token losses; the shares of all micro-batches of
    a minibatch add up to its loss, so the normalisers count the whole minibatch."""
    if mode == "token-mean":  # every token weighs the same
        return (token_loss * loss_mask).sum() / mini_batch_tokens
    if mode == "seq-mean-token-mean":  # every sequence weighs the same
        return masked_mean_per_row(token_loss, loss_mask).sum() / mini_batch_size
    if mode == "seq-mean-token-sum":
        return (token_loss * loss_mask).sum() / mini_batch_size
    return (token_loss * loss_mask).sum() / (mini_batch_size * max_completion_length)  # Dr. GRPO: a constant


def policy_loss(
    args: Args, logprobs, old_logprobs, advantages, mask, in_loss, mini_batch_size: int, mini_batch_tokens, entropy=None
):
    """The --loss_type loss of one micro-batch, (b, C) advantages per token, in_loss the rows that enter it, less the
    entropy bonus (--entropy_coef, of the (b, C) entropies); and its statistics (logs.LossStats): logs.clip_statistics
    over the units of its clip, the sum of the token ratios, the bonus; the loss's own, summed over those units."""
    losses, log_ratio, own_stats = LOSSES[args.loss_type].function(logprobs, old_logprobs, advantages, mask, args)
    aggregate = functools.partial(  # a sequence loss sums its tokens' log-probs: its entropy bonus sums their entropies
        aggregate_loss,
        loss_mask=mask * in_loss[:, None],
        mode=args.loss_aggregation or "seq-mean-token-sum",
        mini_batch_size=mini_batch_size,
        mini_batch_tokens=mini_batch_tokens,
        max_completion_length=args.max_completion_length,
    )
    loss = (losses * in_loss).sum() / mini_batch_size if losses.dim() == 1 else aggregate(losses)
    per_token = log_ratio.dim() == 2  # the clip's units: tokens, or completions
    units = mask if per_token else torch.ones_like(in_loss, dtype=mask.dtype)
    unit_advantages = advantages if per_token else advantages[:, 0]
    stats = logs.clip_statistics(log_ratio, unit_advantages, units, args.epsilon, args.epsilon_high, args.dual_clip)
    stats["token_ratio"] = ((logprobs.detach() - old_logprobs).exp() * mask).sum()
    if args.entropy_coef:  # an entropy bonus keeps the policy from collapsing to one answer (TRL's; Skywork-OR1)
        bonus = args.entropy_coef * aggregate(entropy)
        loss, stats["entropy_bonus"] = loss - bonus, bonus.detach()
    return loss, logs.LossStats(stats, {name: (values * units).sum() for name, values in own_stats.items()})


# ---- main(): set-up and the training loop ----------------------------------------------------------------------------
def main(args: Args) -> None:
    launch_world_size()  # the rendezvous variables, checked before anything waits for the other processes
    rank, world_size, device = init_processes(args.ddp_timeout)
    set_up_cuda(args.tf32)
    sys.excepthook = lifecycle.report_one_line_error  # init_process_group wrapped it, to put [rank<N>]: before lines
    # Every check that needs no model comes first; then the run claims its folders (runs/<run_name>, the output folder).
    # Every process runs the checks; a failure on any stops all of them, reported once by rank 0 (`agreed`)
    use_server = args.vllm_server_host is not None or args.vllm_server_base_url is not None
    with agreed():
        checks.check_args(args, world_size)
        check_vllm_args(args, server=use_server)
        check_algorithm(args)
        args = resolve_defaults(args)
        plan = set_up.plan_run(args, world_size, sharded=True)  # over all processes
        server = VLLMServer(args) if use_server else None  # reachable, before the run claims anything
    batch_size, mini_batch_size, num_updates = plan.batch_size, plan.mini_batch_size, plan.num_updates
    local_batch_size = batch_size // world_size  # the completions each process rolls out
    G = args.num_generations
    run_dir, output_dir, guard = lifecycle.claim_run(args, plan, batch_size)

    seed = (args.seed + 1_000_003 * rank) % 2**32  # each process samples its own completions
    transformers.set_seed(seed)  # python's, numpy's and torch's
    autocast = contextlib.nullcontext  # bf16 is FSDP's mixed precision (shard)
    console = Console(quiet=rank != 0)

    # The policy, its reference for the KL, the reward model: each process holds its shards of them (FSDP2), read from
    # the files without any process holding a whole model (rloo_utils/sharded.py)
    models = load_sharded_models(args, plan, device, world_size)
    policy, ref_policy, tokenizer = models.policy, models.ref_policy, models.tokenizer

    steps_per_update = args.num_ppo_epochs * args.num_mini_batches
    num_optimizer_steps = num_updates * steps_per_update
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with --use_peft: the adapters
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = args.lr_scheduler(optimizer, num_optimizer_steps)  # warm-up, then --lr_scheduler_type's
    # What reward functions get besides the completions (TRL's trainer_state), and what they log (log_extra, log_metric)
    trainer_state = TrainerState(max_steps=num_optimizer_steps, num_train_epochs=plan.num_train_epochs)
    if plan.checkpoint is not None:
        load_sharded_checkpoint(plan.checkpoint, policy, optimizer)
    # Until the first optimizer step of an update the policy is the one that sampled: its log-probs are the detached
    # ones of the training forward (ratio exactly 1). With one epoch and one minibatch that is every step, and
    # log pi_old needs its own forward only for the KL.
    ratio_is_one = args.num_ppo_epochs == 1 and args.num_mini_batches == 1
    # log pi(y_t | x, y_<t): completion_logprobs, the definition; by default (--padding_free) the same numbers without
    # padding or the (B, L, V) logits held at once (rloo_utils/packing.py, tested equal)
    logprobs_of = completion_logprobs
    if args.padding_free:
        logprobs_of = packing.padding_free_logprobs(
            policy, plan.image_column, console, autocast, args.fused_output_layer
        )
    local_mini_batch_size = mini_batch_size // world_size

    # The loop's seams: prompts to a rollout, a rollout to rewards, both again (--dynamic_sampling), the evaluation
    own_rows = rank * local_batch_size  # this process's rows of the global batch
    sampler = ShardedSampler.for_run(args, models, plan, device, autocast, console, logprobs_of, server)
    generation_config = sampler.configs[0]  # sampling (then greedy, for the sample tables; the evaluation's)
    support = sampler_support(args.top_k, args.top_p, args.min_p) if server is not None else None  # vLLM's tokens
    packing.compile_decoder_layers(policy, args.compile_decoder_layers)  # the training forward's, one by one
    scorer = ShardedScorer.for_run(args, models, plan, trainer_state, device, autocast, console)
    with agreed():
        logger = logs.open_logger(plan, run_dir, console, num_updates, **args.tracking())  # a resumed run's logs go on
    evaluator = evaluation.Evaluator(args, plan, sampler, scorer, console, logger)
    resampler = rollouts.DynamicSampling(
        sampler, scorer, plan.train_dataset, G, args.max_sampling_rounds, args.seed, args.missing_eos_penalty
    )
    console.print(set_up.first_line(plan, run_dir, device, G, num_optimizer_steps, args.bf16, world_size))
    console.print(evaluator.plan())

    # ---- Training loop -----------------------------------------------------------------------------------------------
    # A resumed run goes on where its checkpoint ends (optimizer, schedule, counters, random generators). From here on
    # Ctrl-C and SIGTERM stop the run after its update with a checkpoint; a failure leaves one (rloo_utils/lifecycle.py)
    queue = None  # --max_staleness N: the server samples the rollouts of the next N updates while this one trains
    if args.max_staleness:  # (rloo_utils/rollout_queue.py: which weights sample which, what a checkpoint keeps)
        queue = rollout_queue.RolloutQueue(args.max_staleness, num_updates, sampler.background_outputs)
    stateful = {"scheduler": scheduler, **({} if queue is None else {"rollouts": queue})}
    save_weights = functools.partial(save_sharded_checkpoint, policy=policy, optimizer=optimizer)  # each its shards
    progress = guard.start(
        save_weights, stateful, logger, console, num_updates, closing=() if server is None else (server,)
    )
    batches = data.prompt_batches(plan.train_dataset, batch_size // G, args.seed, progress.update, rank, world_size)
    if queue is not None:
        queue.start(progress.update, functools.partial(sampler.request, batches, generation_config))
    for update in range(progress.update + 1, num_updates + 1):
        timer = logs.StageTimer()
        evaluator.before_update(update, progress.episode, timer)  # the sample tables, the held-out evaluation
        update_start = time.perf_counter()

        # Rollout: each prompt repeated G times, its completions adjacent, so group g is rows [g*G, (g+1)*G), sampled by
        # the policy (HF generate or a server), or with --max_staleness by the queue from weights up to N updates older
        if queue is None:
            prompts, columns = data.repeated(next(batches), G)
            with timer("generation"):  # a seed per completion (sampler.seeds_for): what a resumed run samples again
                rollout = sampler.sample(
                    prompts, columns, generation_config, sampler.seeds_for(update, 0, len(prompts))
                )
        else:
            with timer("generation"):
                with agreed():  # a generation that failed on one process stops every process
                    queued = queue.take(update)
                request = queued.request
                rollout = sampler.sample(
                    request["prompts"], request["columns"], generation_config, request["seeds"], outputs=queued.outputs
                )

        # Reward: weighted sum of the sources (NaN-aware), EOS trick; checked, normalised, clipped over the batch, below
        trainer_state.global_step = (update - 1) * steps_per_update  # what reward functions see of the run
        trainer_state.epoch = progress.episode / G / len(plan.train_dataset)
        with timer("reward"), agreed():  # a reward function that raises on one process stops all of them together
            rewards_per_func, completions = scorer.score(rollout)  # (b, F)
        scores = task_scores(rewards_per_func, scorer.weights, rollout.ended, args.missing_eos_penalty)  # (b,)
        sampled = {}  # --dynamic_sampling: groups with equal scores give no gradient; new prompts' take their place
        if args.dynamic_sampling:  # each process its own groups, every process in every round
            rollout, rewards_per_func, scores, completions, sampled = resampler.refill(
                rollout, rewards_per_func, scores, completions, update, timer
            )
        sampler.rollout_done(rollout, timer)  # sampling is over: a server is checked

        # log pi_old: a forward of its own when the KL, a later minibatch or the off-policy correction needs it; else
        # the update's forward fills it. Against vLLM's log-probs the trainer's are taken on vLLM's distribution: with
        # --top_k, --top_p or --min_p renormalised over the tokens it could draw, as vLLM's are (sampler_support)
        mask = rollout.policy_mask  # (b, C) the tokens the policy chose: only they enter loss and KL
        old_logprobs, ref_logprobs = torch.zeros_like(mask), None  # (b, C)
        is_correction = server is not None and args.importance_sampling_correction
        trainer_sampling_logprobs = old_logprobs
        if not ratio_is_one or ref_policy is not None or is_correction or support is not None:
            with timer("old_logprobs"):
                logprobs = packing.rollout_logprobs(
                    policy,
                    rollout,
                    logprobs_of,
                    autocast,
                    args.local_rollout_forward_batch_size,
                    args.temperature,
                    support,
                )
                old_logprobs, trainer_sampling_logprobs = logprobs if support is not None else (logprobs, logprobs)
        if ref_policy is not None:
            with timer("reference_forward"), lora.adapter_disabled(ref_policy):
                ref_logprobs = packing.rollout_logprobs(
                    ref_policy, rollout, logprobs_of, autocast, args.local_rollout_forward_batch_size, args.temperature
                )  # (b, C)
            if ref_policy is not policy:
                reshard(ref_policy)

        # The whole batch on every process, in rank order: the rewards, baselines, normalisations and metrics below are
        # those of one process holding every row; each process then updates on its own rows, from own_rows on.
        # The rollout's images and multi-turn record stay this process's own.
        rollout = rollouts.gather_rollout(rollout, tokenizer.pad_token_id)  # (B, P) prompts, (B, C) completions
        old_logprobs, rewards_per_func = gather_rows(old_logprobs), gather_rows(rewards_per_func)  # (B, C), (B, F)
        scores = gather_rows(scores)  # (B,)
        ref_logprobs = gather_rows(ref_logprobs) if ref_policy is not None else None  # (B, C)
        trainer_sampling_logprobs = gather_rows(trainer_sampling_logprobs) if support is not None else old_logprobs
        tool_counts = all_reduce(torch.tensor(rollout.tool_counts())).tolist() if rollout.turns else (0, 0, 0)
        mask = rollout.policy_mask  # (B, C)
        with agreed():  # every process holds the whole batch: a range check that fails stops them together
            scores = shaped_scores(scores, update, args.normalize_reward, args.reward_clip_range)

        # KL: folded into the reward, detached, against the policy that sampled (k1 or k3 per token)
        kl = torch.zeros_like(mask)  # (B, C): none without a reference (beta 0)
        if ref_policy is not None:
            kl = per_token_kl(old_logprobs, ref_logprobs, args.kl_estimator) * mask
        rlhf_reward, non_score_reward = kl_penalized_reward(scores, kl, mask, args.beta, args.token_level_kl)

        # Advantage: the estimator's baseline over the scorable siblings of each group, then its normalisation
        in_loss = has_baseline(rlhf_reward, G)  # (B,) rows that enter the loss (scored, with a scored sibling)
        if args.mask_truncated_completions:
            in_loss &= rollout.ended
        kl_before = kl_penalty_before(kl, args.beta, args.token_level_kl)  # (B, C)
        advantages = compute_advantages(
            rlhf_reward, kl_before, in_loss, G, args.advantage_estimator, args.advantage_normalization
        )  # (B, C)

        # Off-policy correction: vLLM sampled from the policy up to its numerics; the loss of each completion (or token)
        # is weighted by its truncated or masked importance ratio, a weight >= 0 on its advantage being one on its loss
        correction = off_policy.Correction(advantages)  # none
        if is_correction:
            correction = off_policy.correction(
                trainer_sampling_logprobs, rollout.sampling_logprobs, mask, advantages, *args.correction_options()
            )

        # Update: num_ppo_epochs passes, each split into num_mini_batches optimizer steps of gradient_accumulation_steps
        # micro-batches (or those --max_tokens_per_micro_batch packs); each micro-batch adds its share of the global
        # minibatch loss (policy_loss) to the gradient, which FSDP sums over the processes. Each process takes its
        # minibatches from its own rows.
        policy.train()
        stats = logs.UpdateStats()  # per micro-batch and per optimizer step
        epoch_generator = torch.Generator().manual_seed(args.seed * 1_000_003 + update)
        row_tokens = packing.row_tokens(rollout.prompt_mask, rollout.completion_mask, args.padding_free)  # (B,)
        for epoch in range(args.num_ppo_epochs):
            order = own_rows + torch.randperm(local_batch_size, generator=epoch_generator).to(device)
            for mb_start in range(0, local_batch_size, local_mini_batch_size):
                on_policy = epoch == 0 and mb_start == 0  # no optimizer step yet since the rollout
                mb = order[mb_start : mb_start + local_mini_batch_size]
                mini_batch_tokens = tokens_in_loss(mask[mb], in_loss[mb])  # over every process's rows
                step_loss = torch.zeros((), device=device)
                for idx in packing.micro_batches(
                    mb,
                    row_tokens,
                    args.per_device_train_batch_size,
                    args.max_tokens_per_micro_batch,
                    max_over_processes,
                ):
                    with timer("policy_forward_backward"):
                        with autocast():
                            logprobs, entropy = logprobs_of(
                                policy,
                                rollout.prompt_ids[idx],
                                rollout.prompt_mask[idx],
                                rollout.completion_ids[idx],
                                rollout.completion_mask[idx],
                                args.temperature,
                                with_entropy=True,
                                entropy_grad=args.entropy_coef != 0,
                                images=vision.images_batch(rollout.images, idx - own_rows, device, policy.dtype),
                            )  # (b, C)
                        # the policy is still the one that sampled: ratio exactly 1, later epochs compare to it
                        if on_policy:
                            old_logprobs[idx] = logprobs.detach()
                        loss, loss_stats = policy_loss(
                            args,
                            logprobs,
                            old_logprobs[idx],
                            correction.advantages[idx],
                            mask[idx],
                            in_loss[idx],
                            mini_batch_size,
                            mini_batch_tokens,
                            entropy,
                        )
                        loss.backward()
                    step_loss += loss.detach()
                    stats.add_micro_batch(loss_stats, entropy.detach(), mask[idx], row_tokens[idx])
                step_loss = all_reduce(step_loss)  # the global minibatch's loss
                with timer("optimizer"):
                    learning_rate = scheduler.get_last_lr()[0]  # the rate this step uses
                    grad_norm, stepped = optimizer_step(policy, optimizer, args.max_grad_norm, step_loss)
                    scheduler.step()  # a skipped step counts too: the schedule follows the updates
                stats.add_step(step_loss, grad_norm, learning_rate)
                progress.count_step(stepped)
        # Weight sync: the next rollout (and sample table) samples from the updated policy
        if queue is not None:  # the server finishes the rollouts of older weights first: none samples from two
            with timer("generation_wait"), agreed():
                queue.before_push()
        sampler.sync_weights(timer)
        if queue is not None:
            queue.pushed(update)  # the rollout they are scheduled to sample is asked for
        progress.advance(update, batch_size, rollout.num_tokens)
        old_logprobs = gather_rows(old_logprobs[own_rows : own_rows + local_batch_size])  # as the update filled them in

        # Logging: the metric names of both TRL generations, so openrlbenchmark can compare runs
        update_seconds = time.perf_counter() - update_start
        logged_columns, logged_metrics = scorer.logs.take(len(rollout.prompts))  # what reward functions logged
        # the rollout's generation: with --max_staleness the server's own seconds, in the queue's thread (and those of
        # --dynamic_sampling's rounds, made when the update asked for them)
        generation_seconds = timer.seconds["generation"]
        if args.max_staleness:
            generation_seconds = queued.seconds + timer.seconds["resampling"]
        generated_tokens = sampled.get("sampling/generated_tokens", float(mask.sum()))  # every round's
        metrics = {
            "episode": progress.episode,
            "global_step": update * steps_per_update,  # optimizer steps, the x-axis of TRL 1.x's runs
            "eps": progress.episode / (time.time() - progress.start_time),
            "num_tokens": progress.num_tokens,  # prompt and completion tokens so far (TRL 1.16)
            "step_time": update_seconds
            / len(stats.losses),  # seconds per optimizer step, the rollout included (TRL 1.16)
            **logs.reward_metrics(rewards_per_func, scorer.names, scorer.weights, rlhf_reward, G),
            **logs.completion_metrics(rollout.completion_ids, mask.long(), rollout.ended, sampler.eos_ids),  # policy's
            **logs.tool_metrics(*tool_counts),
            **sampled,
            **off_policy.sampling_metrics(trainer_sampling_logprobs, rollout.sampling_logprobs, mask, correction),
            **stats.metrics(reduce_micro_stats),  # of the global micro-batches
            # old-TRL names: the score that enters the reward, and the reward with its KL penalty
            "objective/scores": float(scores.nanmean()),
            "objective/non_score_reward": float(non_score_reward.mean()),
            "objective/rlhf_reward": float(rlhf_reward.nanmean()),
            "objective/entropy": float((-old_logprobs * mask).sum(1).mean()),  # sampled tokens' -log pi, per completion
            # health and speed
            "advantages/mean": float(advantages[in_loss, 0].mean()) if in_loss.any() else 0.0,
            "advantages/std": float(advantages[in_loss, 0].std()) if in_loss.sum() > 1 else 0.0,
            "prompts/truncated": rollout.num_truncated,
            "optim/skipped_steps": progress.skipped_steps,
            "perf/tokens_per_second": rollout.num_tokens / update_seconds,
            "perf/generated_tokens_per_second": generated_tokens / max(generation_seconds, 1e-9),
            **({"perf/weight_sync_bytes": server.last_push_bytes} if server is not None else {}),  # rank 0 sends
            **{f"time/{k}": v for k, v in timer.seconds.items()},
            "time/update": update_seconds,
            **(
                {
                    "async/staleness": update - 1 - queued.version,
                    "async/resampled": float(queued.resampled),  # too old when taken: sampled again (its mean: share)
                    "time/background_generation": queued.seconds,
                }
                if args.max_staleness
                else {}
            ),
            **logged_metrics,
        }
        if ref_policy is not None:
            metrics["objective/kl"] = float(kl.sum(1).mean())
            metrics["kl"] = float(kl.sum() / mask.sum().clamp(min=1))
        logger.log(metrics, progress.episode)
        if args.log_completions:  # TRL's table: the sampled completions with their rewards and advantages
            rows = logs.completion_rows(
                rollout.prompts, completions, rewards_per_func, scorer.names, advantages[:, 0], logged_columns
            )
            logs.show_samples(console, logger, rows, progress.episode, "completions", args.num_completions_to_print)
        # Checkpoint: every save_steps updates, and before stopping on a signal or on too many skipped steps
        guard.update_done(progress)
    evaluator.after_training(progress.update, progress.episode)  # the trained policy's

    # ---- Output: the trained model (with --use_peft: the adapter; --save_merged_model: also merged) ------------------
    checkpoints.save_outputs(
        output_dir, policy, models.processor or tokenizer, args.save_merged_model, save_sharded_model
    )
    if server is not None:
        server.close()
    guard.finished()  # the model is saved: nothing left to rescue
    logger.close()
    console.print(f"saved the trained model to {output_dir} ({time.time() - progress.start_time:.0f} s)")
    end_processes(0)


# ---- Log-probabilities: the definition -------------------------------------------------------------------------------
def completion_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    images: Optional[dict] = None,
    support: Optional[Callable] = None,
):
    """(B, C) log pi(y_t | x, y_<t) of each completion token under `model`, on logits / temperature; 0 on padding.
    The definition, in one padded forward: the logits at position t predict token t + 1. with_entropy: also the (B, C)
    entropies -sum_v p_v log p_v, with their gradient if entropy_grad (the entropy bonus's: autograd then keeps
    another (B, C, V) for the backward); with a sampler's `support` (sampler_support), the (B, C) log-probs
    renormalised over the tokens it could draw, the distribution vLLM's log-probs are on. images: a VLM's image tensors
    (images_batch).
    --padding_free (the default) gives the same numbers from chunked_completion_logprobs (rloo_utils/packing.py, tested
    equal): a forward of the real tokens only, whose (B, L, V) logits are never held at once."""
    input_ids = torch.cat([prompt_ids, completion_ids], 1)  # (B, P + C)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    # positions count real tokens, so that left padding changes nothing (a VLM that builds its own: None)
    position_ids = None if vision.builds_own_positions(model) else packing.position_ids_from(attention_mask)
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **vision.vision_inputs(model, input_ids, images),
    )
    logits = output.logits[:, prompt_ids.shape[1] - 1 : -1].float() / temperature  # (B, C, V)
    logprobs = logits.log_softmax(-1)
    out = [logprobs.gather(-1, completion_ids[..., None]).squeeze(-1)]  # (B, C)
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            out.append(-(logprobs.exp() * logprobs).sum(-1))
    with torch.no_grad():
        if support is not None:
            kept = support(logits).scatter(-1, completion_ids[..., None], True)  # the sampled token is always kept
            renormalised = logits.masked_fill(~kept, -math.inf).log_softmax(-1)
            out.append(renormalised.gather(-1, completion_ids[..., None]).squeeze(-1))
    out = [values * completion_mask for values in out]
    return out[0] if len(out) == 1 else tuple(out)


if __name__ == "__main__":
    sys.excepthook = lifecycle.report_one_line_error  # one line for bad input; a failed run's rescue (on_failure)
    signal.signal(signal.SIGTERM, errors.Terminated.handler)  # until training starts, SIGTERM stops like Ctrl-C
    main(options.parse_args(Args))
