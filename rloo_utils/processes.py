"""torch.distributed's process group, seen from any script: with none, get_rank() is 0, get_world_size() is 1 and
`agreed()` lets an error through as it is."""

import contextlib
import datetime
import os
import socket
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rloo_utils.errors import RunError, UsageError, describe


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """(b, ...) rows of each process -> (world size x b, ...) rows of all, in rank order, on every process."""
    if get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


@contextlib.contextmanager
def agreed():
    """`with agreed():` around work that holds no collective: if it raises on any process, the first failing process's
    error is raised on every process, so that all of them stop together, and rank 0 reports it once (with the rank
    that failed). Without this, one process's bad input or failing reward function would leave the others waiting.
    Ctrl-C, SIGTERM before training and sys.exit stop this process only (torchrun stops the others). Off the training
    thread (the rollout queue's) it holds no collective: a failure there is raised where the training thread takes the
    rollout, under agreed()."""
    if get_world_size() == 1 or threading.current_thread() is not threading.main_thread():
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
        shared = (UsageError if kind == "UsageError" else RunError)(
            message + (f" (on rank {failed_rank})" if failed_rank else "")
        )
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


def background_working() -> bool:
    """Whether a background thread is still working (the rollout queue's, making a rollout ahead: torch's or a
    tokenizer's C++ code), under which the interpreter's teardown can abort the process (SIGABRT, "terminate called
    without an active exception"): a process that stops then exits at once (end_processes)."""
    return any(getattr(thread, "working", False) for thread in threading.enumerate())


def from_rank_0(value):
    """Rank 0's value, on every process."""
    if get_world_size() == 1:
        return value
    values = [value]
    dist.broadcast_object_list(values)
    return values[0]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A shard (DTensor) gathered whole, where the group's collectives run (a collective); any other tensor as it is."""
    return tensor.to(tensor.device_mesh.device_type).full_tensor() if hasattr(tensor, "full_tensor") else tensor


def max_over_processes(value: int) -> int:
    """The largest of every process's value (a collective); with no process group, the value itself."""
    if not dist.is_initialized():
        return value
    largest = torch.tensor(value)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest)


def any_process(flag: bool) -> bool:
    """Whether the flag is set on any process (a collective); with no process group, the flag itself."""
    return max_over_processes(int(flag)) > 0


RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # set by torchrun


def launch_world_size() -> int:
    """The number of processes this run is launched with (torchrun's WORLD_SIZE; 1 for a plain `python`)."""
    given = [v for v in RENDEZVOUS_VARIABLES if v in os.environ]
    if given and len(given) < len(RENDEZVOUS_VARIABLES):
        missing = [v for v in RENDEZVOUS_VARIABLES if v not in os.environ]
        raise UsageError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: launch with torchrun, which sets them all, or "
            "unset them to run one process"
        )
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        assert world_size >= 1 and 0 <= int(os.environ.get("RANK", "0")) < world_size
    except (ValueError, AssertionError):
        raise UsageError(
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} RANK={os.environ.get('RANK')} do not describe a "
            "process of the group: launch with torchrun"
        ) from None
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
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return dist.get_rank(), dist.get_world_size(), device


def all_gather_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pad_token_id: int):
    """gather_rows for left-padded prompts, whose widths differ between processes: padded to the widest first."""
    width = torch.tensor(prompt_ids.shape[1], device=prompt_ids.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    pad = int(width) - prompt_ids.shape[1]
    return gather_rows(F.pad(prompt_ids, (pad, 0), value=pad_token_id)), gather_rows(F.pad(prompt_mask, (pad, 0)))


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, op=op)
    return x


def reduce_micro_stats(stats: dict[str, list[torch.Tensor]]) -> dict[str, list[float]]:
    """Per-micro-batch statistics of this process -> those of the global micro-batches (the same micro-batch of every
    process): sums are summed, low_min (all units clipped) is a minimum, high_max (any unit clipped) and forward_tokens
    (what one process's forward held) maxima."""
    values = torch.stack([torch.stack(v).float() for v in stats.values()])  # (statistics, micro-batches)
    reduced = {op: all_reduce(values, op) for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX)}
    op_of = {"low_min": dist.ReduceOp.MIN, "high_max": dist.ReduceOp.MAX, "forward_tokens": dist.ReduceOp.MAX}
    return {name: reduced[op_of.get(name, dist.ReduceOp.SUM)][i].tolist() for i, name in enumerate(stats)}
