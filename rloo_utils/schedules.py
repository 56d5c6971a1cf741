"""The learning-rate schedule (ScheduleOptions): a linear warm-up over --warmup_steps, then the transformers schedule
--lr_scheduler_type names; its options checked before anything is loaded, and the run's scheduler (lr_scheduler)."""

import json
import math
from dataclasses import dataclass
from typing import Literal

from rloo_utils.errors import UsageError
from rloo_utils.json_options import JsonObject

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


@dataclass
class ScheduleOptions:
    """The learning-rate schedule: a linear warm-up, then the schedule of --lr_scheduler_type (transformers')"""

    lr_scheduler_type: Literal["linear", "constant", "cosine", "cosine_with_min_lr"] = "linear"
    """learning-rate schedule after warm-up: to 0 linearly or along a half cosine, constant, or cosine to a floor"""
    lr_scheduler_kwargs: JsonObject = None
    """the schedule's arguments as JSON (transformers'): '{"min_lr_rate": 0.1}' for cosine_with_min_lr, num_cycles"""
    warmup_steps: float = 0
    """optimizer steps of linear warm-up from 0; below 1, a fraction of all optimizer steps (TRL's warmup_ratio)"""

    def check(self) -> None:
        """--warmup_steps, and --lr_scheduler_kwargs against the schedule --lr_scheduler_type names and --learning_rate
        (checked here, without importing transformers before the run claims its folders)."""
        if self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps):
            raise UsageError(
                f"--warmup_steps {self.warmup_steps}: give a number of steps (a whole number), or a fraction of "
                "all optimizer steps below 1"
            )
        kwargs = self.lr_scheduler_kwargs or {}
        for key, value in kwargs.items():
            if key not in SCHEDULE_ARGUMENTS[self.lr_scheduler_type]:
                takes = ", ".join(sorted(SCHEDULE_ARGUMENTS[self.lr_scheduler_type])) or "nothing"
                raise UsageError(
                    f"--lr_scheduler_type {self.lr_scheduler_type} with --lr_scheduler_kwargs {json.dumps(kwargs)}: "
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
        if kwargs.get("min_lr", 0) > self.learning_rate:
            raise UsageError(
                f"--lr_scheduler_kwargs: min_lr {kwargs['min_lr']} is above --learning_rate "
                f"{self.learning_rate}, so the schedule would climb to it: give a floor at or below the rate"
            )
        if kwargs.get("num_cycles", 1) == 0:
            raise UsageError(
                "--lr_scheduler_kwargs: num_cycles 0 never decays the rate: use --lr_scheduler_type constant, "
                "or a number of cycles > 0 (0.5: one half-cosine to the floor)"
            )
        if self.lr_scheduler_type == "cosine_with_min_lr" and len({"min_lr", "min_lr_rate"} & set(kwargs)) != 1:
            raise UsageError(
                "--lr_scheduler_type cosine_with_min_lr needs one of min_lr or min_lr_rate in --lr_scheduler_kwargs "
                "(e.g. '{\"min_lr_rate\": 0.1}': the floor is 10% of --learning_rate)"
            )

    def lr_scheduler(self, optimizer, total_steps: int):
        """Linear warm-up from 0 over --warmup_steps optimizer steps (below 1: that fraction of total_steps, rounded up,
        as transformers does), then the --lr_scheduler_type schedule until total_steps."""
        from transformers import get_scheduler

        warmup_steps = math.ceil(self.warmup_steps * total_steps) if self.warmup_steps < 1 else int(self.warmup_steps)
        return get_scheduler(
            SCHEDULES[self.lr_scheduler_type],
            optimizer,
            warmup_steps,
            total_steps,
            scheduler_specific_kwargs=self.lr_scheduler_kwargs or {},
        )
