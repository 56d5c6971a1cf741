"""A sampler that is not the trained policy: vLLM (its own kernels, bfloat16 weights, rollouts of older weights with
--max_staleness) or HF generate on a bfloat16 copy of the policy (--sampler_weights). The importance-sampling
correction (its options and checks, and the correction itself: the weights and masks that enter the loss), the copy of
the policy's weights that samples, and the metrics of the sampler-trainer gap."""

import math
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import torch
import tyro

from rloo_utils.errors import UsageError
from rloo_utils.lora import merged_weights, plain_state_dict, transformers_model


@dataclass
class ImportanceSamplingOptions:
    """The off-policy correction of a sampler whose numerics differ from the policy's: vLLM, or a bfloat16 copy
    (--sampler_weights); truncated or masked importance sampling (TRL's GRPO, whose vllm_* names work too)"""

    importance_sampling_correction: Annotated[
        bool, tyro.conf.arg(aliases=("--vllm_importance_sampling_correction",))
    ] = True
    """weight the loss by pi_trainer / pi_sampler, truncated or masked, where another model samples (vLLM, a copy)"""
    importance_sampling_mode: Annotated[
        Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate", "sequence_geometric_mask"],
        tyro.conf.arg(aliases=("--vllm_importance_sampling_mode",)),
    ] = "sequence_mask"
    """sequence_* (a ratio per completion) or token_*; *_truncate clips it, *_mask zeroes it; geometric: its mean"""
    importance_sampling_clip_max: Annotated[
        Optional[float], tyro.conf.arg(aliases=("--vllm_importance_sampling_clip_max",))
    ] = 3.0
    """upper bound C_max of the importance ratio (None: none)"""
    importance_sampling_clip_min: Annotated[
        Optional[float], tyro.conf.arg(aliases=("--vllm_importance_sampling_clip_min",))
    ] = None
    """lower bound C_min of the importance ratio (None: none)"""
    geometric_mask_bounds: Annotated[tuple[float, float], tyro.conf.arg(aliases=("--vllm_geometric_mask_bounds",))] = (
        0.99,
        1.01,
    )
    """(sequence_geometric_mask) a completion whose mean token ratio leaves these bounds is masked (SkyRL's)"""
    off_policy_mask_threshold: Annotated[
        Optional[float], tyro.conf.arg(aliases=("--vllm_off_policy_mask_threshold",))
    ] = None
    """mask a completion with A < 0 whose mean log pi_sampler - log pi_trainer exceeds this (DeepSeek-V3.2)"""

    def correction_options(self) -> tuple:
        """correction()'s mode, bounds and mask threshold."""
        return self.importance_sampling_mode, self.importance_sampling_bounds(), self.off_policy_mask_threshold

    def importance_sampling_bounds(self) -> tuple[Optional[float], Optional[float]]:
        """The bounds of the importance ratio in this mode: the geometric mean's own, or [clip_min, clip_max]."""
        if self.importance_sampling_mode == "sequence_geometric_mask":
            return tuple(self.geometric_mask_bounds)
        return self.importance_sampling_clip_min, self.importance_sampling_clip_max

    def check(self) -> None:
        """The correction's bounds, and its mode against the loss."""
        low, high = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if (
            (low is not None and low < 0)
            or (high is not None and high <= 0)
            or (None not in (low, high) and low >= high)
        ):
            raise UsageError(
                f"the importance-sampling bounds need 0 <= clip_min < clip_max, got clip_min {low}, clip_max {high}"
            )
        mode, geometric_bounds = self.importance_sampling_mode, tuple(self.geometric_mask_bounds)
        if not 0 < geometric_bounds[0] < 1 < geometric_bounds[1]:
            raise UsageError(
                f"--geometric_mask_bounds must hold 1 between them, low > 0 (a completion's mean token ratio is "
                f"masked outside them; SkyRL starts at 0.99 1.01), got {geometric_bounds[0]:g} {geometric_bounds[1]:g}"
            )
        if geometric_bounds != (0.99, 1.01) and mode != "sequence_geometric_mask":
            raise UsageError(
                "--geometric_mask_bounds are the bounds of --importance_sampling_mode sequence_geometric_mask, "
                f"and the mode is {mode}: give that mode, or leave the bounds out"
            )
        if mode == "sequence_geometric_mask" and not self.importance_sampling_correction:  # else masks nothing
            raise UsageError(
                "--importance_sampling_mode sequence_geometric_mask masks through the importance-sampling correction, "
                "which --no_importance_sampling_correction turns off: give one of them"
            )
        threshold = self.off_policy_mask_threshold
        if threshold is not None and threshold < 0:
            raise UsageError(f"--off_policy_mask_threshold must be >= 0 (a mean log-ratio), got {threshold}")
        if threshold is not None and not self.importance_sampling_correction:
            raise UsageError(
                "--off_policy_mask_threshold masks with the sampler's log-probs, which "
                "--no_importance_sampling_correction leaves out of the loss: give one of them"
            )
        if self.importance_sampling_correction and mode.startswith("token") and self.loss_type == "sequence":
            raise UsageError(
                f"--importance_sampling_mode {mode} weights tokens, and --loss_type sequence has one term per "
                "completion: use sequence_mask or sequence_truncate"
            )


# ---- The correction --------------------------------------------------------------------------------------------------
@dataclass
class Correction:
    """The off-policy correction of a rollout: the (B, C) advantages the loss takes; for the logs the (B, 1) or (B, C)
    importance weights, the ratios before their bounds (what the bounds cut) and the (B, 1) completions kept (with
    --off_policy_mask_threshold). Correction(advantages): none, the policy sampled."""

    advantages: torch.Tensor
    weights: Optional[torch.Tensor] = None
    ratios: Optional[torch.Tensor] = None
    kept: Optional[torch.Tensor] = None


def correction(trainer_logprobs, sampling_logprobs, mask, advantages, mode: str, bounds: tuple, mask_threshold):
    """The off-policy correction of a sampler whose numerics differ from the policy's (vLLM; a copy in bfloat16): the
    (B, C) advantages weighted by the truncated or masked importance ratio of each completion (or token), a weight >= 0
    on its advantage being one on its loss, and with a mask_threshold (--off_policy_mask_threshold) the completions the
    sampler drifted from (A < 0) left out. mode, bounds, mask_threshold: the options group's correction_options()."""
    ratios = importance_sampling_weights(trainer_logprobs, sampling_logprobs, mask, mode, None, None)
    weights = importance_sampling_weights(trainer_logprobs, sampling_logprobs, mask, mode, *bounds)
    loss_advantages, kept = advantages * weights, None
    if mask_threshold is not None:
        kept = off_policy_sequence_mask(trainer_logprobs, sampling_logprobs, mask, advantages[:, 0], mask_threshold)
        loss_advantages = loss_advantages * kept
    return Correction(loss_advantages, weights, ratios, kept)


def importance_sampling_weights(old_logprobs, sampling_logprobs, mask, mode: str, clip_min, clip_max) -> torch.Tensor:
    """Truncated / masked importance sampling of the sampler-trainer gap (TRL's GRPO; Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"): rho = pi_trainer / pi_sampler of the sampled tokens, per
    completion (B, 1) for sequence_* modes or per token (B, C); sequence_geometric_mask: the geometric mean of a
    completion's token ratios, whose bounds are tight ([0.99, 1.01]) because it does not grow with the length. Detached:
    it weights the loss, it is not trained."""
    log_rho = (old_logprobs - sampling_logprobs) * mask  # (B, C)
    if mode == "sequence_geometric_mask":  # the geometric mean of the token ratios (SkyRL; OpenRLHF, NeMo-RL)
        log_rho = log_rho.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
    elif mode.startswith("sequence"):
        log_rho = log_rho.sum(1, keepdim=True)  # (B, 1)
    rho = log_rho.exp()
    low = clip_min if clip_min is not None else 0.0
    high = clip_max if clip_max is not None else math.inf
    if mode.endswith("truncate"):
        return rho.clamp(low, high)
    return rho.masked_fill((rho < low) | (rho > high), 0.0)


def off_policy_sequence_mask(old_logprobs, sampling_logprobs, mask, advantages, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, section 3.1): (B, 1) 0 for a completion with a
    negative advantage whose mean log pi_sampler - log pi_trainer over its tokens exceeds the threshold, else 1. Such a
    completion is one the sampler made likelier than the policy would (a stale or mismatched sampler): learning from its
    failure pushes the policy away from what it would not have done anyway, and destabilises it."""
    drift = ((sampling_logprobs - old_logprobs) * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B,)
    return (~((advantages < 0) & (drift > threshold))).float()[:, None]


# ---- The weights HF generate samples from --------------------------------------------------------------------------
def sampler_dtype(
    choice: str, policy_dtype: torch.dtype, bf16: bool, device: torch.device, lora: bool = False
) -> Optional[torch.dtype]:
    """The dtype of the copy of the policy that samples (--sampler_weights), or None: the policy samples itself. auto: a
    bfloat16 copy where float32 weights train under --bf16 on CUDA, so that the static cache and the compiled decoding
    step run (autocast makes RoPE's keys float32 and the values bfloat16, which one static cache cannot hold) and each
    step reads 2 bytes a parameter, not 4; on a CPU the policy's own weights, so that every CPU number stays the same.
    Not for a LoRA policy (lora): its merged copy would hold 2 bytes a base parameter, 70% more than such a run holds
    (benchmark/results/memory_per_parameter.md), and memory is what LoRA is chosen for; `bfloat16` asks for it. A copy
    in the policy's own dtype would be the policy: none is made."""
    if choice == "auto":
        full = device.type == "cuda" and bf16 and policy_dtype == torch.float32 and not lora
        wanted = torch.bfloat16 if full else None
    else:
        wanted = None if choice == "policy" else getattr(torch, choice)
    return None if wanted == policy_dtype else wanted


def sampler_line(policy_dtype: torch.dtype, copy_dtype: Optional[torch.dtype]) -> str:
    """What the run says at start of the weights it samples from (the GPU kit reads it)."""
    weights = str(policy_dtype).removeprefix("torch.")
    if copy_dtype is None:
        return f"HF generate samples from the policy's own {weights} weights"
    copy = str(copy_dtype).removeprefix("torch.")
    return f"HF generate samples from a {copy} copy of the policy's {weights} weights, refreshed after each update"


@torch.no_grad()
def sampling_copy(policy, dtype: torch.dtype):
    """A plain transformers model of the policy's architecture in `dtype`, holding the policy's weights (a LoRA
    adapter merged in: the copy samples what the policy samples, at the speed of a model without adapters, for 2 bytes
    a parameter), frozen and in eval mode. refresh_copy keeps it the policy after each update."""
    from transformers.initialization import no_init_weights

    model = transformers_model(policy)
    with torch.device(next(policy.parameters()).device), no_init_weights():  # its weights come from the policy
        copy = type(model)._from_config(model.config, dtype=dtype)
    copy.generation_config = model.generation_config
    output = model.get_output_embeddings()
    if output is not None and output.weight is model.get_input_embeddings().weight:
        copy.tie_weights()  # one tensor for the LM head and the embeddings, as in the policy (built from a config: two)
    refresh_copy(copy, policy)
    check_copy(copy.eval().requires_grad_(False), dtype)
    return copy


@torch.no_grad()
def check_copy(copy, dtype: torch.dtype) -> None:
    """The copy's logits of a few tokens are finite, or one line: a float16 copy of a model whose activations pass
    float16's range (65504) would sample from NaN probabilities (bfloat16 has float32's range)."""
    ids = torch.arange(1, 17, device=next(copy.parameters()).device)[None] % copy.config.get_text_config().vocab_size
    if not torch.isfinite(copy(input_ids=ids).logits).all():
        name = str(dtype).removeprefix("torch.")
        raise UsageError(
            f"--sampler_weights {name}: the policy's activations pass {name}'s range (its logits are not finite): "
            "use bfloat16 (the range of float32)"
        )


@torch.no_grad()
def refresh_copy(copy, policy) -> None:
    """The copy's weights set to the policy's, in place (a compiled decoding step's CUDA graphs keep reading the same
    memory), one tensor at a time, a LoRA adapter merged in."""
    tensors = plain_state_dict(copy)
    for name, tensor in merged_weights(policy):
        tensors[name].copy_(tensor)


def sampling_metrics(old_logprobs, sampling_logprobs: Optional[torch.Tensor], mask, correction: Correction) -> dict:
    """TRL's names: per-token |log pi_trainer - log pi_sampler| over real tokens, and the importance weights' range;
    the sampler-trainer KL(pi_sampler || pi_trainer) per token, Schulman's k3 estimator (r - 1 - log r, r = pi_trainer
    / pi_sampler) on the sampler's samples; the share of the correction's importance ratios (before the bounds) that the
    bounds truncated or masked; with the off-policy sequence mask, the share of completions it masked. None where the
    policy sampled (sampling_logprobs None)."""
    if sampling_logprobs is None:
        return {}
    real = mask.bool()
    log_ratio = (old_logprobs - sampling_logprobs)[real]
    gap = log_ratio.abs()
    metrics = {
        "sampling/sampling_logp_difference/mean": float(gap.mean()) if real.any() else 0.0,
        "sampling/sampling_logp_difference/max": float(gap.max()) if real.any() else 0.0,
        "sampling/kl": float((log_ratio.exp() - 1 - log_ratio).mean()) if real.any() else 0.0,
    }
    if correction.weights is not None:
        weights = correction.weights
        per_unit = (lambda x: x.flatten()) if weights.shape[1] == 1 else (lambda x: x[real])  # completions or tokens
        flat, unbounded = per_unit(weights), per_unit(correction.ratios)
        metrics.update(
            {
                f"sampling/importance_sampling_ratio/{name}": float(getattr(flat, name)()) if len(flat) else 0.0
                for name in ("min", "mean", "max")
            }
        )
        clipped = (flat != unbounded).float()
        metrics["sampling/importance_sampling_ratio/clipped_fraction"] = float(clipped.mean()) if len(flat) else 0.0
    if correction.kept is not None:
        metrics["sampling/off_policy_masked_fraction"] = float(1 - correction.kept.mean())
    return metrics
