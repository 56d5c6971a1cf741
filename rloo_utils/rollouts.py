"""Asynchronous rollouts (--max_staleness N): a vLLM server generates the rollouts of the next updates while the
trainer trains on this one. The schedule is fixed, so that a run and its resumed copy sample the same rollouts: the
rollout of update j is sampled from the weights after update v(j) = max(0, j - 1 - N), at most N versions older than
the policy that trains on it (the weights after update j - 1). N = 0 is the synchronous loop: each rollout is generated
when its update asks for it, from the newest weights.

The trainer's side, per update k: take(k) waits for its rollout; the update trains; before_push() waits for the rollouts
still being generated (from older weights: new weights must not reach the server under a request in flight); the new
weights are pushed; pushed(k) asks for the rollout of update k + 1 + N, from them. A checkpoint keeps the finished
rollouts of older weights, which a resumed run cannot sample again; one of the checkpoint's own weights is sampled
again, from the same seeds. The scripts say what a request is and how a rollout is generated."""

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rloo_utils.processes import get_rank, get_world_size


@dataclass
class QueuedRollout:
    """What an update trains on: its request (prompts, columns, seeds...), the engine's outputs (per completion: token
    ids and their sampling log-probs; None where the script generates at take time), the weight version that sampled
    it, and the seconds its generation took."""

    request: dict
    outputs: Any
    version: int
    seconds: float


class Generation:
    """One rollout's generation: in a daemon thread (background, so the update runs meanwhile), or when its result is
    asked for. A failure is raised where the result is asked for, in the training loop."""

    def __init__(self, generate: Callable, request: dict, version: int, background: bool, kept: Optional[dict] = None):
        """kept: a checkpoint's finished generation (its outputs and seconds), which is not run again."""
        self.generate, self.request, self.version = generate, request, version
        self.outputs, self.seconds = (kept["outputs"], kept["seconds"]) if kept else (None, 0.0)
        self.error, self.finished = None, kept is not None
        self.thread = threading.Thread(target=self.run, daemon=True) if background and not self.finished else None
        if self.thread:
            self.thread.start()

    def run(self) -> None:
        start = time.perf_counter()
        try:
            self.outputs = self.generate(self.request)
        except Exception as e:  # raised again by result(), in the training loop
            self.error = e
        self.seconds = time.perf_counter() - start
        self.finished = True

    def result(self) -> QueuedRollout:
        if self.thread is not None:
            self.thread.join()
        elif not self.finished:
            self.run()
        if self.error is not None:
            raise self.error
        return QueuedRollout(self.request, self.outputs, self.version, self.seconds)


class RolloutQueue:
    """The rollouts of the coming updates (max_staleness + 1 of them at most), each sampled from its scheduled weights.
    generate(request): the engine's outputs for a rollout's request, run in a thread when max_staleness > 0 (it must not
    use the tokenizer or a collective); request(update), given to start(): what the rollout samples (called once per
    update, in order). Its state_dict() is what a checkpoint holds: the finished rollouts of weights older than the
    newest."""

    def __init__(self, max_staleness: int, num_updates: int, generate: Callable):
        self.max_staleness, self.num_updates, self.generate = max_staleness, num_updates, generate
        self.request: Callable = None  # update -> its rollout's request (start)
        self.pending: dict[int, Generation] = {}  # update -> its rollout's generation
        self.saved: dict[int, dict] = {}  # update -> {"version", "outputs", "seconds"}, from a checkpoint
        self.version = 0  # the weights the engine holds: those after this update

    def sampled_from(self, update: int) -> int:
        """v(j): the weights the rollout of update j is sampled from."""
        return max(0, update - 1 - self.max_staleness)

    def start(self, version: int, request: Callable) -> None:
        """The weights after update `version` are on the engine (0: a new run): ask for every rollout they or older
        weights sample, request(update) saying what each samples. A checkpoint's rollouts are used where they are at
        most max_staleness versions old."""
        self.version, self.request = version, request
        for update in range(version + 1, min(version + 1 + self.max_staleness, self.num_updates) + 1):
            request = self.request(update)
            kept = self.saved.pop(update, None)
            if kept is not None and update - 1 - kept["version"] <= self.max_staleness:
                self.pending[update] = Generation(self.generate, request, kept["version"], False, kept)
            else:  # a new run's, the checkpoint's own weights', or one now too stale: sampled from these weights
                self.pending[update] = Generation(self.generate, request, version, self.max_staleness > 0)
        self.saved.clear()

    def take(self, update: int) -> QueuedRollout:
        """The rollout of this update, waited for (a failure of its generation is raised here)."""
        return self.pending.pop(update).result()

    def before_push(self) -> None:
        """Wait for the rollouts still being generated: new weights must not reach the engine under them."""
        for generation in self.pending.values():
            generation.result()

    def pushed(self, update: int) -> None:
        """The weights after `update` are on the engine: ask for the rollout they are scheduled to sample."""
        self.version = update
        asked = update + 1 + self.max_staleness
        if asked <= self.num_updates:
            self.pending[asked] = Generation(self.generate, self.request(asked), update, self.max_staleness > 0)

    def state_dict(self) -> dict:
        """The finished rollouts of weights older than the engine's (a resumed run samples the others again), per
        process, as tensors: completion ids (int64) and their log-probs (float64, as the engine's JSON gave them).
        With a process group, a collective: every process's rollouts, in rank order."""
        own = {
            update: {
                "version": generation.version,
                "rows": [pack(ids, logprobs) for ids, logprobs in generation.outputs],
                "seconds": generation.seconds,
            }
            for update, generation in self.pending.items()
            if generation.version < self.version
            and generation.finished
            and generation.error is None
            and generation.outputs is not None
        }
        per_process = [own]
        if dist.is_initialized():
            per_process = [None] * get_world_size()
            dist.all_gather_object(per_process, own)
        return {"per_process": per_process}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's rollouts, this process's share (none where the run now has another number of processes: its
        rows are split otherwise, and are sampled again). start() puts them in the queue."""
        per_process = state["per_process"]
        if len(per_process) != get_world_size():
            return
        self.saved = {
            update: {
                "version": kept["version"],
                "outputs": [unpack(row) for row in kept["rows"]],
                "seconds": kept["seconds"],
            }
            for update, kept in per_process[get_rank()].items()
        }


def pack(ids: list[int], logprobs: list[float]) -> dict:
    return {"ids": torch.tensor(ids, dtype=torch.long), "logprobs": torch.tensor(logprobs, dtype=torch.float64)}


def unpack(row: dict) -> tuple[list[int], list[float]]:
    return row["ids"].tolist(), row["logprobs"].tolist()
