"""Logging: metrics.jsonl, the sample tables, TensorBoard or W&B (resumed runs append); the progress bar; the metrics of
an update that come from the completions and the optimizer steps; the stage timer."""

import contextlib
import json
import math
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rloo_utils.data import message_text
from rloo_utils.errors import UsageError
from rloo_utils.processes import get_rank
from rloo_utils.rewards import group_std, weighted_reward


@dataclass
class LoggingOptions:
    """Logging: Weights & Biases, sample tables, the sampled completions"""

    RESUMABLE: ClassVar = {"track", "wandb_project_name", "wandb_entity", "log_completions", "num_completions_to_print"}

    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works; tags come from WANDB_TAGS)"""
    wandb_project_name: str = "rloo"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    num_sample_generations: int = 10
    """how many times to print and log a table of sample completions (0: never)"""
    num_sample_prompts: int = 4
    """prompts in each sample table"""
    log_completions: bool = False
    """each update, print and log (completions.jsonl, W&B) the sampled completions with their rewards and advantages"""
    num_completions_to_print: Optional[int] = None
    """rows of that table printed each update (all are logged); None: all"""

    def tracking(self) -> dict:
        """Where the logs go besides the run folder: W&B (track), its project and entity."""
        return {"track": self.track, "wandb_project_name": self.wandb_project_name, "wandb_entity": self.wandb_entity}

    def check(self) -> None:
        """The tables' sizes: a sample table with rows, a number of completions to print of a table that is logged."""
        if self.num_sample_generations and not self.num_sample_prompts:
            raise UsageError(
                "--num_sample_prompts 0 leaves the sample tables (--num_sample_generations "
                f"{self.num_sample_generations}) empty: give at least 1, or --num_sample_generations 0 for none"
            )
        if self.num_completions_to_print is not None and not self.log_completions:
            raise UsageError("--num_completions_to_print limits the table of --log_completions: add --log_completions")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 1:
            raise UsageError(
                f"--num_completions_to_print must be >= 1 (or left out to print them all), got "
                f"{self.num_completions_to_print}"
            )


# The names old TRL gives the numbers TRL 1.x names otherwise, written beside them wherever an update's metrics are
# written: a run compares with either generation's runs in openrlbenchmark (docs/metrics.md)
OLD_TRL_NAMES = {"entropy": "policy/entropy_avg", "clip_ratio/region_mean": "policy/clipfrac_avg"}
TABLES = ("samples", "completions")  # the tables a run logs (Logger.log_table), each to <name>.jsonl


class Logger:
    """Every row goes to runs/<run_name>/metrics.jsonl, TensorBoard and (with --track) W&B."""

    def __init__(
        self,
        run_name: str,
        run_dir: str,
        resume: Optional[dict] = None,
        progress_bar=None,
        *,
        options: dict,
        track: bool,
        wandb_project_name: str,
        wandb_entity: Optional[str],
    ):
        """resume: the Logger.state() a checkpoint holds. Rows logged after that checkpoint are dropped, since the
        resumed run logs those updates again: no step appears twice, none is missing. progress_bar: a ProgressBar that
        each row of metrics moves on. options: every option by name, recorded as args.json, TensorBoard's
        hyperparameters and W&B's config. track (--track): to W&B too, in project wandb_project_name of entity
        wandb_entity (None: the default one)."""
        self.progress_bar = progress_bar
        from torch.utils.tensorboard import SummaryWriter

        sizes = (resume or {}).get("sizes", {})
        for name in set(sizes) | ({f"{table}.jsonl" for table in TABLES} if resume else set()):
            if os.path.exists(path := os.path.join(run_dir, name)) and os.path.getsize(path) > sizes.get(name, 0):
                os.truncate(path, sizes.get(name, 0))  # (a table begun after the checkpoint is emptied)
        self.last_step = resume["step"] if resume else None
        self.wandb, self.wandb_id, self.wandb_first_step = None, None, 0
        if track:
            import wandb

            tags = [t for t in os.environ.get("WANDB_TAGS", "").split(",") if t]
            self.wandb = wandb.init(
                project=wandb_project_name,
                entity=wandb_entity,
                config=options,
                name=run_name,
                tags=tags,
                save_code=True,
                dir=run_dir,
                id=(resume or {}).get("wandb_id"),
                resume="allow",
            )
            self.wandb_id = self.wandb.id
            # W&B cannot rewrite a step: it keeps the rows it got after the checkpoint, and takes new rows after them.
            self.wandb_first_step = self.wandb.starting_step
        # purge_step: TensorBoard hides what earlier event files hold from that step on
        self.writer = SummaryWriter(run_dir, purge_step=None if self.last_step is None else self.last_step + 1)
        self.writer.add_text(
            "hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in options.items())
        )
        self.run_dir = run_dir
        self.metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.table_files = {}  # name -> its .jsonl, opened at its first rows
        with open(os.path.join(run_dir, "args.json"), "w") as f:  # the options, for tools that read runs offline
            json.dump(options, f, indent=2)

    def log(self, metrics: dict, step: int, section: str = "train") -> None:
        """A row of metrics: an update's (section train) under their own names in metrics.jsonl, an evaluation's
        (eval) as eval/<name>; in TensorBoard and W&B as <section>/<name>, where TRL's trainers log theirs."""
        if section == "train":
            metrics = {**metrics, **{old: metrics[new] for new, old in OLD_TRL_NAMES.items() if new in metrics}}
        named = {f"{section}/{k}": v for k, v in metrics.items()}
        for k, v in named.items():
            self.writer.add_scalar(k, v, step)
        if self.wandb and step >= self.wandb_first_step:
            self.wandb.log(named, step=step)
        self.metrics_file.write(json.dumps({"step": step, **(metrics if section == "train" else named)}) + "\n")
        self.metrics_file.flush()
        self.last_step = step
        if self.progress_bar is not None and section == "train":
            self.progress_bar.update(metrics)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """A table's rows (`samples`: greedy sample completions; `completions`: the sampled training ones, with their
        rewards and advantages) to <name>.jsonl, TensorBoard's text and a W&B table."""
        columns = list(rows[0])
        cells = [[markdown_cell(v) for v in r.values()] for r in rows]
        self.writer.add_text(
            name,
            f"|{'|'.join(columns)}|\n|{'-|' * len(columns)}\n" + "\n".join("|" + "|".join(row) + "|" for row in cells),
            step,
        )
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
        return {
            "sizes": {
                "metrics.jsonl": self.metrics_file.tell(),
                **{name: os.path.getsize(os.path.join(self.run_dir, name)) for name in tables},
            },
            "step": self.last_step,
            "wandb_id": self.wandb_id,
        }

    def close(self, failed: bool = False) -> None:
        if self.progress_bar is not None:
            self.progress_bar.stop()
        self.writer.close()
        for f in [self.metrics_file, *self.table_files.values()]:
            f.close()
        if self.wandb:
            self.wandb.finish(exit_code=1 if failed else 0)


def markdown_cell(value) -> str:
    """A value as a cell of a markdown table: floats to 3 decimals, no '|' or line break to break the row."""
    return f"{value:.3f}" if isinstance(value, float) else str(value).replace("|", "/").replace("\n", " ")


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


def open_logger(
    plan, run_dir: str, console, num_updates: int, *, track: bool, wandb_project_name: str, wandb_entity: Optional[str]
):
    """The run's Logger (what it records and where: the run's options; W&B with track, in wandb_project_name under
    wandb_entity: LoggingOptions.tracking) and its progress bar over num_updates, continuing the logs of a resumed run
    (plan: set_up.RunPlan, whose training_state is its checkpoint's); on processes other than rank 0, one that writes
    nothing."""
    training_state = plan.training_state
    if get_rank() != 0:
        return QuietLogger()
    progress_bar = ProgressBar(console, num_updates, training_state["update"] if training_state else 0)
    resume = training_state["logger"] if training_state else None
    return Logger(
        os.path.basename(run_dir),
        run_dir,
        resume,
        progress_bar,
        options=plan.options,
        track=track,
        wandb_project_name=wandb_project_name,
        wandb_entity=wandb_entity,
    )


def show_samples(console, logger, rows: list[dict], step: int, name: str = "samples", num_printed=None) -> None:
    """A table of completions (rows of prompt, completion, then numbers): logged, and num_printed of its rows (None:
    all) printed. `samples`: the greedy sample completions; `completions`: the sampled training ones
    (--log_completions)."""
    table = Table(
        *rows[0],
        title=f"{'sample' if name == 'samples' else 'training'} completions at episode {step}",
        show_lines=True,
    )
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


def completion_rows(
    prompts: list,
    completions: list[str],
    rewards_per_func: torch.Tensor,
    reward_names: list[str],
    advantages: torch.Tensor,
    logged_columns: dict[str, list],
) -> list[dict]:
    """The rows of TRL's table of sampled completions (--log_completions): prompt, completion, each reward source's
    value (NaN: it returned None), the advantage, then the columns reward functions logged (log_extra), each under its
    own name unless the table has a column of that name: then as `log_extra/<name>`. The prompts (text or messages)
    and completions of every process, gathered (its rewards and advantages are the whole batch's already)."""
    prompts, completions = [message_text(p) for p in gather_objects(prompts)], gather_objects(completions)
    rewards, advantages = rewards_per_func.tolist(), advantages.tolist()
    own = {"step", "prompt", "completion", "advantage", *reward_names}  # (step: each row's, in completions.jsonl)
    logged = {name if name not in own else f"log_extra/{name}": values for name, values in logged_columns.items()}
    return [
        {
            "prompt": prompt,
            "completion": completion,
            **dict(zip(reward_names, rewards[i])),
            "advantage": advantages[i],
            **{name: values[i] for name, values in logged.items()},
        }
        for i, (prompt, completion) in enumerate(zip(prompts, completions))
    ]


def tool_metrics(calls: int, failures: int, completions: int) -> dict:
    """TRL's tools/ metrics: tool calls per completion, and the share of them that failed; none without completions
    that could call tools."""
    if not completions:
        return {}
    return {
        "tools/call_frequency": calls / max(completions, 1),
        "tools/failure_frequency": failures / calls if calls else 0.0,
    }


def completion_metrics(completion_ids, completion_mask, ended, eos_ids: list[int]) -> dict:
    """Lengths in real tokens (EOS included) of all completions and of those that ended (0 if none did), the fraction
    that did not end, and old TRL's count of EOS tokens (here only real ones: never padding)."""
    lengths = completion_mask.sum(1).float()  # (B,)
    terminated = lengths[ended] if ended.any() else torch.zeros(1)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device)) & completion_mask.bool()
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float((~ended).float().mean()),
        "completions/mean_terminated_length": float(terminated.mean()),
        "completions/min_terminated_length": float(terminated.min()),
        "completions/max_terminated_length": float(terminated.max()),
        "val/num_eos_tokens": int(is_eos.sum()),
    }


def clipped_units(ratio, advantages, epsilon_low: float, epsilon_high: float):
    """Units whose ratio left [1 - eps_low, 1 + eps_high] on the side its advantage pushes it (low: A < 0, high: A > 0):
    where PPO's clip cuts the gradient. The same definition for every loss, so clip fractions compare across them."""
    return (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def clip_statistics(log_ratio, advantages, units, epsilon_low: float, epsilon_high: float, dual_clip=None) -> dict:
    """Sums over the real units of a micro-batch's loss (tokens, or completions; units 1 for a real one), and whether
    all or any were clipped (TRL 1.16's min and max over the units): update_metrics makes the clip fractions of them."""
    ratio, real = log_ratio.exp(), units.bool()
    low, high = clipped_units(ratio, advantages, epsilon_low, epsilon_high)
    stats = {
        "units": units.sum(),
        "approxkl": (0.5 * log_ratio.square() * units).sum(),
        "clipped_low": (low * units).sum(),
        "clipped_high": (high * units).sum(),
        "low_min": (low | ~real).all(),
        "high_max": (high & real).any(),
    }
    if dual_clip is not None:  # units whose loss the dual clip capped
        stats["dual_clipped"] = (((ratio > dual_clip) & (advantages < 0)) * units).sum()
    return stats


def update_metrics(
    micro: dict[str, list[float]],
    losses: list[float],
    grad_norms: list[float],
    learning_rates: list[float],
    own_names: tuple = (),
) -> dict:
    """What the policy update did, from per-micro-batch sums and extremes (`micro`) and per-optimizer-step values;
    own_names: the loss's own statistics (LossStats.own) in `micro`."""
    units = max(sum(micro["units"]), 1.0)
    clip_fraction = (sum(micro["clipped_low"]) + sum(micro["clipped_high"])) / units
    entropy = sum(micro["entropy"]) / max(sum(micro["tokens"]), 1.0)
    ratios = [
        r / max(t, 1.0) for r, t in zip(micro["token_ratio"], micro["tokens"])
    ]  # each micro-batch's mean token ratio
    metrics = {
        "lr": statistics.fmean(learning_rates),  # the rates the update's optimizer steps used
        "entropy": entropy,
        "clip_ratio/region_mean": clip_fraction,
        "clip_ratio/low_mean": sum(micro["clipped_low"]) / units,
        "clip_ratio/high_mean": sum(micro["clipped_high"]) / units,
        "clip_ratio/low_min": statistics.fmean(micro["low_min"]),
        "clip_ratio/high_max": statistics.fmean(micro["high_max"]),
        "policy/approxkl_avg": sum(micro["approxkl"]) / units,
        "loss/policy_avg": statistics.fmean(losses),
        "val/ratio": statistics.fmean(ratios),
        "val/ratio_var": statistics.variance(ratios) if len(ratios) > 1 else math.nan,
        "optim/grad_norm": statistics.fmean(grad_norms),
        # what the micro-batches held (--max_tokens_per_micro_batch bounds the largest): prompt and completion tokens
        "perf/micro_batches_per_step": len(micro["tokens"]) / len(losses),
        "perf/micro_batch_tokens_max": max(micro["forward_tokens"]),
    }
    if "entropy_bonus" in micro:  # what --entropy_coef subtracted from the loss, a step's (its micro-batches' sum)
        metrics["loss/entropy_bonus"] = sum(micro["entropy_bonus"]) / len(losses)
    if "dual_clipped" in micro:
        metrics["clip_ratio/dual_mean"] = sum(micro["dual_clipped"]) / units
    metrics.update({name: sum(micro[name]) / units for name in own_names})  # their mean over the loss's units
    return metrics


@dataclass
class LossStats:
    """A micro-batch's statistics of its loss (a script's policy_loss): sums over the units of its clip (clip_statistics
    and the token ratio), and the loss's own, by their metric's name (SAPO's sapo/gate_mean), summed over those units:
    each logged as its mean over the update's units."""

    sums: dict
    own: dict


class UpdateStats:
    """What an update's micro-batches and optimizer steps did, kept on the device until the update is logged (one
    sync): per micro-batch the sums over the units of its loss (policy_loss's statistics), its entropy and tokens; per
    optimizer step its loss, gradient norm and learning rate."""

    def __init__(self):
        self.micro, self.losses, self.grad_norms, self.learning_rates = defaultdict(list), [], [], []
        self.own_names = {}  # the loss's own statistics, in the order they came

    def add_micro_batch(self, loss_stats: LossStats, entropy, mask, forward_tokens) -> None:
        """A micro-batch's: loss_stats (policy_loss's), (b, C) entropy and mask, (b,) tokens of its forward."""
        sums = dict(
            loss_stats.sums, entropy=(entropy * mask).sum(), tokens=mask.sum(), forward_tokens=forward_tokens.sum()
        )
        self.own_names.update(dict.fromkeys(loss_stats.own))
        for name, value in {**sums, **loss_stats.own}.items():
            self.micro[name].append(value)

    def add_step(self, loss, grad_norm, learning_rate: float) -> None:
        """An optimizer step's: its loss, its gradient norm before clipping, the learning rate it used."""
        self.losses.append(loss)
        self.grad_norms.append(grad_norm.detach().float())
        self.learning_rates.append(learning_rate)

    def metrics(self, reduce=None) -> dict:
        """update_metrics of them; reduce (rloo_multigpu.py's reduce_micro_stats): the micro-batches' statistics over
        every process."""
        if reduce is not None:
            micro = reduce(self.micro)
        else:  # one sync
            micro = dict(zip(self.micro, torch.stack([torch.stack(v).float() for v in self.micro.values()]).tolist()))
        losses, grad_norms = torch.stack(self.losses + self.grad_norms).view(2, -1).tolist()
        return update_metrics(micro, losses, grad_norms, self.learning_rates, list(self.own_names))


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
        self.progress = Progress(
            TextColumn("[bold]rloo"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=console,
        )
        self.task = self.progress.add_task("", total=num_updates, completed=start_update)

    def update(self, metrics: dict) -> None:
        self.progress.start()  # at the first update: nothing of the set-up's output is drawn over (again: no-op)
        self.progress.update(
            self.task,
            advance=1,
            description=f"reward {metrics['reward']:.3f}  kl "
            f"{metrics.get('kl', 0):.4f}  len {metrics['completions/mean_length']:.1f}",
        )

    def stop(self) -> None:
        self.progress.stop()


def reward_metrics(
    rewards_per_func, reward_names: list[str], reward_weights, rlhf_reward, num_generations: int
) -> dict:
    """`reward`: the weighted sum of the sources, before any penalty, normalisation or clipping (TRL 1.16); per source
    its mean and std where it applied; the fraction of groups whose rewards, KL penalty included, are all equal."""
    reward = weighted_reward(rewards_per_func, reward_weights)  # (B,)
    scored = reward[~reward.isnan()]
    std = group_std(rlhf_reward, num_generations).view(-1, num_generations)[:, 0]  # (num_prompts,)
    num_scored = (~rlhf_reward.view(-1, num_generations).isnan()).sum(1)
    metrics = {
        "reward": float(scored.mean()),
        "reward_std": float(scored.std()),
        "frac_reward_zero_std": float(((num_scored > 1) & torch.isclose(std, torch.zeros_like(std))).float().mean()),
    }
    for j, name in enumerate(reward_names):
        values = rewards_per_func[:, j][~rewards_per_func[:, j].isnan()]
        metrics[f"rewards/{name}/mean"] = float(values.mean())
        metrics[f"rewards/{name}/std"] = float(values.std()) if len(values) > 1 else math.nan
    return metrics
