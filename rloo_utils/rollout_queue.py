"""The queue of asynchronous rollouts (--max_staleness N): a vLLM server generates the rollouts of the next updates
while the trainer trains on this one. The schedule is fixed, so that a run and its resumed copy sample the same
rollouts: the rollout of update j is sampled from the weights after update v(j) = max(0, j - 1 - N), at most N versions
older than the policy that trains on it (the weights after update j - 1). N = 0 is the synchronous loop: each rollout is
generated when its update asks for it, from the newest weights.

The trainer's side, per update k: take(k) waits for its rollout; the update trains; before_push() waits for the rollouts
still being generated (from older weights: new weights must not reach the server under a request in flight); the new
weights are pushed; pushed(k) asks for the rollout of update k + 1 + N, from them. A checkpoint keeps the finished
rollouts of older weights, which a resumed run cannot sample again; one of the checkpoint's own weights is sampled
again, from the same seeds. The scripts say what a request is and how a rollout is generated."""

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from rloo_utils.processes import get_rank, get_world_size
from rloo_utils.rollouts import Rollout


@dataclass
class QueuedRollout:
    """What an update trains on: its request (prompts, columns, seeds...), the engine's outputs (per completion: token
    ids and their sampling log-probs; a multi-turn rollout made whole; None where the script generates at take time),
    the weight version that sampled it, the seconds its generation took, and whether it was sampled again at take
    time because the one made ahead was older than --max_staleness allows."""

    request: dict
    outputs: Any
    version: int
    seconds: float
    resampled: bool = False


class Worker:
    """The queue's thread: one daemon thread that runs generations in the order they are asked for. One thread, kept
    for the whole run, so that a tool's or an environment's thread-bound state (an event loop, a connection) lives as
    long as the run, and no two background rollouts call the same tool at once."""

    def __init__(self):
        self.jobs = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.loop, name="rollouts", daemon=True)
        self.thread.working = False  # a run that fails meanwhile exits at once (lifecycle.report_one_line_error)
        self.thread.start()

    def loop(self) -> None:
        while True:
            job = self.jobs.get()
            self.thread.working = True
            job.run()
            self.thread.working = self.jobs.qsize() > 0


class Generation:
    """One rollout's generation: in the queue's thread (background, so the update runs meanwhile), or when its result
    is asked for. A failure is raised where the result is asked for, in the training loop."""

    def __init__(self, generate: Callable, request: dict, version: int, worker: Optional[Worker], kept=None):
        """kept: a checkpoint's finished generation (its outputs and seconds), which is not run again."""
        self.generate, self.request, self.version, self.background = generate, request, version, worker is not None
        self.outputs, self.seconds = (kept["outputs"], kept["seconds"]) if kept else (None, 0.0)
        self.error, self.done = None, threading.Event()
        if kept:
            self.done.set()
        elif worker is not None:
            worker.jobs.put(self)

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    def run(self) -> None:
        start = time.perf_counter()
        try:
            self.outputs = self.generate(self.request)
        except BaseException as e:  # (a tool's sys.exit too) raised again by result(), in the training loop
            self.error = e
        finally:
            self.seconds = time.perf_counter() - start
            self.done.set()

    def result(self, timeout: Optional[float] = None) -> QueuedRollout:
        """Its rollout, waited for `timeout` seconds at most (None: as long as the generation takes)."""
        if not self.background and not self.done.is_set():
            self.run()
        if not self.done.wait(timeout):
            raise TimeoutError(
                f"the rollout sampled from the weights after update {self.version} was not generated "
                f"within {timeout:g} s"
            )
        if self.error is not None:
            raise self.error
        return QueuedRollout(self.request, self.outputs, self.version, self.seconds)


class RolloutQueue:
    """The rollouts of the coming updates (max_staleness + 1 of them at most), each sampled from its scheduled weights.
    generate(request): the engine's outputs for a rollout's request, run in the queue's thread when max_staleness > 0
    (it must not use a collective, nor the training thread's tokenizer); request(update), given to start(): what the
    rollout samples (called once per update, in order). Its state_dict() is what a checkpoint holds: the finished
    rollouts of weights older than the newest. timeout: the seconds a wait for a generation may take; None (the
    scripts') as long as it takes, as the generation is bounded itself (each server request by --vllm_server_timeout, a
    tool call by --tool_timeout where given) and its failure is raised where it is waited for. Tests bound theirs."""

    def __init__(self, max_staleness: int, num_updates: int, generate: Callable, timeout: Optional[float] = None):
        self.max_staleness, self.num_updates, self.generate = max_staleness, num_updates, generate
        self.timeout = timeout
        self.worker = Worker() if max_staleness > 0 else None
        self.request: Callable = None  # update -> its rollout's request (start)
        self.pending: dict[int, Generation] = {}  # update -> its rollout's generation
        self.saved: dict[int, dict] = {}  # update -> {"version", "outputs", "seconds"}, from a checkpoint
        self.version = 0  # the weights the engine holds: those after this update

    def sampled_from(self, update: int) -> int:
        """v(j): the weights the rollout of update j is sampled from."""
        return max(0, update - 1 - self.max_staleness)

    def start(self, version: int, request: Callable) -> None:
        """The weights after update `version` are on the engine (0: a new run): ask for every rollout they or older
        weights sample, request(update) saying what each samples. A checkpoint's rollouts are taken as they are (take()
        samples again one that is too old)."""
        self.version, self.request = version, request
        for update in range(version + 1, min(version + 1 + self.max_staleness, self.num_updates) + 1):
            request = self.request(update)
            kept = self.saved.pop(update, None)
            if kept is not None:
                self.pending[update] = Generation(self.generate, request, kept["version"], None, kept)
            else:  # a new run's, or the checkpoint's own weights': sampled from these weights
                self.pending[update] = Generation(self.generate, request, version, self.worker)
        self.saved.clear()

    def take(self, update: int) -> QueuedRollout:
        """The rollout of this update, waited for (a failure of its generation is raised here); it stays in the queue
        until the update is done (pushed), so that the checkpoint of a failure inside the update keeps it. One sampled
        from weights more than max_staleness updates older than the policy that trains on it (after update - 1) is not
        trained on: it is sampled again now, from the engine's weights (a checkpoint's, resumed with a lower bound)."""
        taken = self.pending[update].result(self.timeout)
        if update - 1 - taken.version <= self.max_staleness:
            return taken
        self.pending[update] = Generation(self.generate, taken.request, self.version, self.worker)  # where all are made
        return dataclasses.replace(self.pending[update].result(self.timeout), resampled=True)

    def before_push(self) -> None:
        """Wait for the rollouts still being generated: new weights must not reach the engine under them (a failure of
        one is raised here, before the push)."""
        for generation in self.pending.values():
            generation.result(self.timeout)

    def pushed(self, update: int) -> None:
        """The weights after `update` are on the engine: ask for the rollout they are scheduled to sample."""
        self.pending.pop(update, None)  # its rollout is trained on
        self.version = update
        asked = update + 1 + self.max_staleness
        if asked <= self.num_updates:
            self.pending[asked] = Generation(self.generate, self.request(asked), update, self.worker)

    def state_dict(self) -> dict:
        """The finished rollouts of weights older than the engine's (a resumed run samples the others again), per
        process, as tensors (pack_outputs); one a checkpoint cannot hold (a multi-turn rollout's environments) is left
        out, and the resumed run samples it again from the checkpoint's weights (said then). With a process group, a
        collective: every process's rollouts, in rank order."""
        own, left_out = {}, []
        for update, generation in self.pending.items():
            if not (generation.version < self.version and generation.finished and generation.error is None):
                continue
            packed = pack_outputs(generation.outputs)
            if packed is None:
                left_out.append(update)
                continue
            own[update] = {"version": generation.version, **packed, "seconds": generation.seconds}
        mine = {"kept": own, "left_out": left_out}
        per_process = [mine]
        if dist.is_initialized():
            per_process = [None] * get_world_size()
            dist.all_gather_object(per_process, mine)
        return {"per_process": per_process}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's rollouts, this process's share (none where the run now has another number of processes: its
        rows are split otherwise, and are sampled again). start() puts them in the queue."""
        per_process = state["per_process"]
        if len(per_process) != get_world_size():
            return
        own = per_process[get_rank()]
        own = own if "kept" in own else {"kept": own, "left_out": []}  # a checkpoint of single-turn rollouts only
        self.saved = {
            update: {"version": kept["version"], "outputs": unpack_outputs(kept), "seconds": kept["seconds"]}
            for update, kept in own["kept"].items()
        }
        if own["left_out"] and get_rank() == 0:
            print(
                f"the checkpoint could not keep the multi-turn rollouts of updates {own['left_out']} (environments, "
                "the user's objects, or values JSON cannot hold): they are sampled again, from its weights and the "
                "same seeds"
            )


def pack_outputs(outputs) -> Optional[dict]:
    """A finished generation as a checkpoint holds it (tensors, and plain values torch.load takes with weights_only):
    per completion its ids (int64) and log-probs (float64, as the engine's JSON gave them); a multi-turn rollout made
    whole, Rollout.state_dict (None where its rows hold environments, which a checkpoint cannot)."""
    if isinstance(outputs, Rollout):
        state = outputs.state_dict()
        return None if state is None else {"rollout": state}
    rows = [
        {"ids": torch.tensor(ids, dtype=torch.long), "logprobs": torch.tensor(logprobs, dtype=torch.float64)}
        for ids, logprobs in outputs
    ]
    return {"rows": rows}


def unpack_outputs(kept: dict):
    if "rollout" in kept:
        return Rollout.from_state_dict(kept["rollout"])
    return [(row["ids"].tolist(), row["logprobs"].tolist()) for row in kept["rows"]]
