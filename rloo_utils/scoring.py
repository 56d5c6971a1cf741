"""The Scorer of a rollout: the reward model's forward (its inputs made its own way where its tokenizer differs), the
reward functions called with what TRL gives them (TrainerState), and what they log (RewardLogs)."""

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rloo_utils.code_reward import CodeReward
from rloo_utils.data import content_text, left_pad
from rloo_utils.errors import RunError
from rloo_utils.packing import last_true_index, pack_sequences, packing_layout, position_ids_from, varlen_kwargs
from rloo_utils.processes import get_rank
from rloo_utils.rewards import call_reward_funcs, reward_func_arguments


def reward_model_inputs(
    reward_tokenizer,
    prompts: list,
    completions: list[str],
    ended: torch.Tensor,
    chat_template_kwargs: Optional[dict] = None,
):
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
            text = reward_tokenizer.apply_chat_template(
                prompt + [{"role": "assistant", "content": completion}], tokenize=False, **(chat_template_kwargs or {})
            )
            row = reward_tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append(row)
    return left_pad(rows, reward_tokenizer.pad_token_id if reward_tokenizer.pad_token_id is not None else 0)


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

    def keep_rows(self, rows: list[int], num_scored: int) -> None:
        """Only these rows of the columns logged since the last take, of num_scored rows scored (--dynamic_sampling:
        the rows an update keeps of every round's); a column of another length is left for take() to report."""
        for name, values in self.columns.items():
            if len(values) == num_scored:
                self.columns[name] = [values[i] for i in rows]

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
                    raise RunError(
                        f"a reward function's log_extra({name!r}, values) gave {len(values)} values for {n} "
                        "completions: one value per completion, once per call"
                    )
        columns = {
            name: [v for c, _, n in everyone for v in c.get(name, [None] * n)]
            for name in sorted({name for c, _, _ in everyone for name in c})
        }
        metrics = {}
        for name in sorted({name for _, m, _ in everyone for name in m}):
            values = [v for _, m, _ in everyone for v in m.get(name, [])]
            metrics[f"log_metric/{name}"] = sum(values) / len(values)
        return columns, metrics

    def clear(self) -> None:
        self.columns.clear()
        self.metrics.clear()


@torch.no_grad()
def reward_model_scores(reward_model, input_ids, attention_mask, packing: Optional[str] = None) -> torch.Tensor:
    """(B,) scores: the value head read at the last real token, which for a completion that ended is its EOS, as in
    "The N+ implementation details of RLHF with PPO" (found by the mask: the padding token may equal EOS).
    Padding-free with `packing` (pack_sequences), as completion_logprobs."""
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    last = last_true_index(attention_mask)  # (B,)
    if packing:
        ids, positions, index = pack_sequences(input_ids, attention_mask, packing)
        hidden = backbone(
            input_ids=ids, position_ids=positions, use_cache=False, **varlen_kwargs(attention_mask, packing)
        ).last_hidden_state.flatten(0, 1)
        return reward_model.score(hidden[index[torch.arange(len(last)), last]]).squeeze(-1).float()
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        use_cache=False,
    ).last_hidden_state
    return reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1).float()


class Scorer:
    """A rollout's rewards, (B, F) by every source: the reward model first, then the reward functions (NaN where one
    returned None). The functions get what TRL gives them (prompts, completions, completion_ids, the dataset's columns,
    trainer_state, log_extra and log_metric; in multi-turn rollouts the conversations and environments)."""

    @classmethod
    def for_run(cls, args, models, plan, trainer_state: TrainerState, device, autocast, console) -> "Scorer":
        """The run's scorer: the models' reward model and tokenizers, the plan's reward functions, their names and
        weights, and its tools; the options --padding_free, --local_rollout_forward_batch_size, --chat_template_kwargs
        and --reward_timeout. A code_reward's line says the protections its sandbox has in force."""
        for code in dict.fromkeys(f for f in plan.reward_funcs + plan.metric_funcs if isinstance(f, CodeReward)):
            console.print(code.sandbox.start(), markup=False, highlight=False)
        return cls(
            tokenizer=models.tokenizer,
            reward_tokenizer=models.reward_tokenizer,
            reward_model=models.reward_model,
            reward_funcs=plan.reward_funcs,
            reward_names=plan.reward_names,
            reward_weights=plan.reward_weights,
            tool_use=plan.tool_use,
            trainer_state=trainer_state,
            device=device,
            autocast=autocast,
            console=console,
            padding_free=args.padding_free,
            local_rollout_forward_batch_size=args.local_rollout_forward_batch_size,
            chat_template_kwargs=args.chat_template_kwargs,
            reward_timeout=args.reward_timeout,
        )

    def __init__(
        self,
        *,
        tokenizer,
        reward_tokenizer,
        reward_model: Optional[torch.nn.Module],
        reward_funcs: list[Callable],
        reward_names: list[str],
        reward_weights: torch.Tensor,
        tool_use,
        trainer_state: TrainerState,
        device: torch.device,
        autocast: Callable,
        console,
        padding_free: bool,
        local_rollout_forward_batch_size: int,
        chat_template_kwargs: Optional[dict],
        reward_timeout: Optional[float],
    ):
        """tokenizer: the policy's, which decodes the completions; reward_tokenizer: a reward model's own (None: it
        reads the policy's token ids); reward_model: None where none scores; reward_funcs: the reward functions (after
        the reward model); reward_names: (F,) every source's name, the reward model first; reward_weights: (F,) theirs
        (--reward_weights); tool_use: a multi-turn rollout's tools and environments (set_up.RunPlan's; None: single
        turn), to which a scored rollout gives its environments back; trainer_state: what the functions get as TRL's
        trainer_state; autocast(): the reward model's forwards under --bf16; console: where a fallback is said;
        padding_free (--padding_free): a reward model's forwards without padding where it allows;
        local_rollout_forward_batch_size: the rows of one of its forwards; chat_template_kwargs: the reward tokenizer's
        chat template's own arguments (--chat_template_kwargs); reward_timeout: the seconds a function may take
        (--reward_timeout; None: no limit)."""
        self.tokenizer, self.reward_tokenizer, self.reward_model = tokenizer, reward_tokenizer, reward_model
        self.funcs, self.names = reward_funcs, reward_names
        self.weights = reward_weights.to(device)  # (F,) --reward_weights
        self.trainer_state, self.device, self.autocast = trainer_state, device, autocast
        self.forward_batch_size, self.chat_template_kwargs = local_rollout_forward_batch_size, chat_template_kwargs
        self.timeout = reward_timeout
        backbone = self.reward_model and getattr(self.reward_model, self.reward_model.base_model_prefix)
        self.packing = packing_layout(backbone, padding_free, False, console, "reward model", autocast)
        self.logs = RewardLogs()  # what the functions log (log_extra, log_metric)
        self.tool_use = tool_use  # a rollout made ahead gives its environments back once scored

    def score(self, rollout) -> tuple[torch.Tensor, list[str]]:
        """(B, F) rewards of every source, and the decoded completions."""
        texts = self.tokenizer.batch_decode(
            rollout.completion_ids * rollout.completion_mask
            + self.tokenizer.pad_token_id * (1 - rollout.completion_mask),
            skip_special_tokens=True,
        )
        per_source = [] if self.reward_model is None else [self.model_scores(rollout, texts)]
        per_source += self.call(self.funcs, self.names[len(per_source) :], rollout, texts)
        if rollout.turns is not None:
            self.tool_use.release(rollout.turns)
        return torch.stack(per_source, 1).to(self.device), texts

    def model_scores(self, rollout, texts: list[str]) -> torch.Tensor:
        """(B,) the reward model's scores, in chunks: of the policy's token ids, or (a reward model with a tokenizer of
        its own) of the prompts and completions as text again."""
        chunk = self.forward_batch_size
        if self.reward_tokenizer is None:  # it reads the policy's own token ids
            input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
            attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
        else:
            input_ids, attention_mask = (
                t.to(self.device)
                for t in reward_model_inputs(
                    self.reward_tokenizer, rollout.prompts, texts, rollout.ended, self.chat_template_kwargs
                )
            )
        with self.autocast():
            scores = torch.cat(
                [
                    reward_model_scores(
                        self.reward_model, input_ids[i : i + chunk], attention_mask[i : i + chunk], self.packing
                    )
                    for i in range(0, len(input_ids), chunk)
                ]
            ).cpu()
        bad = (~scores.isfinite()).nonzero()
        if len(bad):
            raise RunError(
                f"reward model {self.names[0]} gave a non-finite score ({scores[bad[0, 0]]}) at index "
                f"{int(bad[0, 0])}: check its weights, or leave out --bf16"
            )
        return scores

    def call(self, funcs, names, rollout, texts: list[str], check=None) -> list[torch.Tensor]:
        """Each function's (B,) values on the rollout (call_reward_funcs: NaN for None, one line for a failure)."""
        turns = rollout.turns
        return call_reward_funcs(
            funcs,
            names,
            len(texts),
            self.timeout,
            check,
            **reward_func_arguments(
                rollout.prompts, texts, rollout.completion_ids, rollout.completion_mask, turns and turns.messages
            ),
            **({"environments": turns.environments, "environment_rewards": turns.rewards} if turns else {}),
            trainer_state=self.trainer_state,
            log_extra=self.logs.log_extra,
            log_metric=self.logs.log_metric,
            **rollout.columns,
        )
