"""Asynchronous rollouts (--max_staleness): the queue's schedule, failures and checkpoint
(rloo_utils/rollout_queue.py), the metrics of a rollout sampled from older weights, the refusals, and end to end on a
vLLM server: the logged staleness, an exact resume after a SIGKILL, and rloo_multigpu.py on two processes."""

import dataclasses
import re
import os
import sys
import threading
import time

import pytest
import torch

import rloo
import rloo_multigpu
import rloo_vllm
from rloo_utils.errors import RunError, UsageError
from rloo_utils import off_policy
from rloo_utils.checks import check_args
from rloo_utils.options import parse_args
from rloo_utils.off_policy import Correction, ImportanceSamplingOptions, sampling_metrics
from rloo_utils.rollout_queue import RolloutQueue
from rloo_utils.vllm_options import check_vllm_args
from conftest import (
    WAIT,
    run_outcome,
    run_rloo,
)
from test_multigpu import PER_MICRO_BATCH, run_torchrun
from test_vllm import kill_the_server_under_a_run, resume_args, sigkill_after_updates


NO_GEOMETRIC_MASK = (
    "--importance_sampling_mode sequence_geometric_mask masks through the importance-sampling correction, which "
    "--no_importance_sampling_correction turns off: give one of them"
)


class RecordingEngine:
    """An engine whose weights are a version number: generate() answers a request with (its update, the version it
    sampled from), taking `delay` seconds, and records when the weights changed under a request in flight."""

    def __init__(self, delay: float = 0.02, fail_at: int = 0):
        self.version, self.delay, self.fail_at = 0, delay, fail_at
        self.events, self.pushed_under_a_request = [], False
        self.lock = threading.Lock()

    def request(self, update: int) -> dict:
        self.events.append(("asked", update))
        return {"update": update}

    def generate(self, request: dict):
        version = self.version
        time.sleep(self.delay)
        if request["update"] == self.fail_at:
            raise RunError(f"the server failed on the rollout of update {self.fail_at}")
        self.pushed_under_a_request |= self.version != version
        return [([request["update"], version], [-0.5, -0.25])]

    def push(self, version: int) -> None:
        self.version = version


def train(queue: RolloutQueue, engine: RecordingEngine, first: int, last: int) -> list:
    """The training loop's side of the queue, from update `first` to `last`: the versions each rollout came from."""
    versions = []
    for update in range(first, last + 1):
        rollout = queue.take(update)
        assert rollout.outputs[0][0] == [update, rollout.version]  # the engine's answer to this update's request
        versions.append(rollout.version)
        engine.events.append(("trained", update))
        queue.before_push()
        engine.push(update)
        queue.pushed(update)
    return versions


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_each_rollout_is_sampled_from_the_weights_the_schedule_gives_and_never_under_a_push(max_staleness):
    engine = RecordingEngine()
    queue = RolloutQueue(max_staleness, 6, engine.generate, timeout=WAIT)
    queue.start(0, engine.request)
    versions = train(queue, engine, 1, 6)
    # v(j) = max(0, j - 1 - N): at most N versions older than the policy that trains on it (after update j - 1)
    assert versions == [max(0, j - 1 - max_staleness) for j in range(1, 7)]
    assert not engine.pushed_under_a_request
    # asked once each, in order; with N > 0 the rollout of update k + 1 + N is asked before update k + 1 trains
    asked = [u for kind, u in engine.events if kind == "asked"]
    assert asked == list(range(1, 7))
    for k in range(1, 6 - max_staleness):
        ask, trained = engine.events.index(("asked", k + 1 + max_staleness)), engine.events.index(("trained", k + 1))
        assert ask < trained


def test_with_max_staleness_the_next_rollout_is_generated_while_the_update_trains():
    generated, next_one_generated = [], threading.Event()

    def generate(request):
        generated.append(request["update"])
        if request["update"] == 2:
            next_one_generated.set()
        return [([request["update"]], [0.0])]

    queue = RolloutQueue(1, 3, generate, timeout=WAIT)
    queue.start(0, lambda update: {"update": update})
    queue.take(1)
    # update 1 trains: the rollout of update 2 is generated meanwhile, in the queue's thread, before anyone takes it
    assert next_one_generated.wait(timeout=60)
    generated.clear()
    synchronous = RolloutQueue(0, 3, generate, timeout=WAIT)
    synchronous.start(0, lambda update: {"update": update})
    assert generated == []  # N = 0: a rollout is generated when its update takes it, from the newest weights
    synchronous.take(1)
    assert generated == [1]


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_failed_generation_is_raised_in_the_training_loop_before_its_update_trains(max_staleness):
    engine = RecordingEngine(fail_at=3)
    queue = RolloutQueue(max_staleness, 6, engine.generate, timeout=WAIT)
    queue.start(0, engine.request)
    with pytest.raises(RunError, match="update 3"):
        train(queue, engine, 1, 6)
    trained = [u for kind, u in engine.events if kind == "trained"]
    assert trained == [1, 2]  # N = 0: raised when update 3 takes it; N = 1: before update 2's weights are pushed
    assert engine.version == (2 if max_staleness == 0 else 1)


def test_a_generation_that_exits_in_the_queues_thread_is_raised_where_it_is_taken_and_the_queue_goes_on():
    """A tool or an environment calling sys.exit in the queue's thread: raised by take (never a wait for ever), and the
    queue's thread still runs the next rollouts."""

    def generate(request):
        if request["update"] == 2:
            raise SystemExit("a tool called sys.exit")
        return [([request["update"]], [0.0])]

    queue = RolloutQueue(1, 4, generate, timeout=WAIT)
    queue.start(0, lambda update: {"update": update})
    queue.take(1)
    with pytest.raises(SystemExit, match="sys.exit"):
        queue.before_push()
    queue.pending.pop(2)
    queue.pushed(1)  # asks for update 3's, in the same thread
    assert queue.take(3).outputs == [([3], [0.0])]


@pytest.mark.timeout(60)  # the break it guards (a wait without its bound) fails here, not at the suite's 600 s
def test_a_wait_for_a_generation_that_never_ends_fails_at_the_queues_timeout():
    """The tests' queues wait `timeout` seconds at most (the scripts', None, as long as the generation takes): a
    rollout made ahead that never comes fails take() and before_push() with a TimeoutError, not a hang."""
    released = threading.Event()

    def generate(request):
        released.wait(timeout=WAIT)  # (ends when the test does: the queue's thread is a daemon, but let it go)
        return [([request["update"]], [0.0])]

    queue = RolloutQueue(1, 3, generate, timeout=0.5)
    queue.start(0, lambda update: {"update": update})
    try:
        for wait in (lambda: queue.take(1), queue.before_push):
            start = time.perf_counter()
            with pytest.raises(TimeoutError, match="weights after update 0 was not generated within 0.5 s"):
                wait()
            assert 0.5 <= time.perf_counter() - start < 10
    finally:
        released.set()
    assert queue.take(1).outputs == [([1], [0.0])]  # once generated, taken as always


def test_a_checkpoint_keeps_the_rollouts_of_older_weights_and_a_resumed_queue_goes_on_as_the_first():
    engine = RecordingEngine()
    uninterrupted = RolloutQueue(2, 8, engine.generate, timeout=WAIT)
    uninterrupted.start(0, engine.request)
    expected = train(uninterrupted, engine, 1, 8)

    engine = RecordingEngine()
    queue = RolloutQueue(2, 8, engine.generate, timeout=WAIT)
    queue.start(0, engine.request)
    train(queue, engine, 1, 3)
    state = queue.state_dict()
    # after update 3: the rollouts of updates 4 and 5 (from the weights after updates 1 and 2) are kept; that of
    # update 6, from the weights after update 3 (the checkpoint's own), is sampled again
    kept = state["per_process"][0]["kept"]
    assert sorted(kept) == [4, 5]
    saved = {u: (rollout["version"], rollout["rows"][0]["ids"].tolist()) for u, rollout in kept.items()}
    assert saved == {4: (1, [4, 1]), 5: (2, [5, 2])}
    assert kept[4]["rows"][0]["logprobs"].dtype == torch.float64
    assert kept[4]["seconds"] >= engine.delay  # its generation's, logged by the resumed run

    resumed_engine = RecordingEngine()
    resumed_engine.push(3)  # the checkpoint's weights
    resumed = RolloutQueue(2, 8, resumed_engine.generate, timeout=WAIT)
    resumed.load_state_dict(state)
    resumed.start(3, resumed_engine.request)
    assert [u for kind, u in resumed_engine.events if kind == "asked"] == [4, 5, 6]  # every request made again
    assert resumed.pending[4].seconds == kept[4]["seconds"]
    assert expected[3:] == train(resumed, resumed_engine, 4, 8)


def test_the_checkpoint_of_a_failure_inside_an_update_keeps_the_rollout_it_took():
    """An update took its rollout and failed (a reward function raised) before its weights were pushed: the checkpoint
    of the last complete update keeps that rollout (from older weights, which a resumed run cannot sample again)."""
    engine = RecordingEngine()
    queue = RolloutQueue(1, 6, engine.generate, timeout=WAIT)
    queue.start(0, engine.request)
    train(queue, engine, 1, 2)
    taken = queue.take(3)  # ... and update 3 fails here
    state = queue.state_dict()
    assert sorted(state["per_process"][0]["kept"]) == [3] and taken.version == 1
    resumed = RolloutQueue(1, 6, RecordingEngine().generate, timeout=WAIT)
    resumed.load_state_dict(state)
    resumed.start(2, engine.request)
    assert resumed.take(3).outputs == taken.outputs


def test_a_kept_rollout_staler_than_max_staleness_is_sampled_again():
    engine = RecordingEngine()
    queue = RolloutQueue(2, 8, engine.generate, timeout=WAIT)
    queue.start(0, engine.request)
    train(queue, engine, 1, 3)
    state = queue.state_dict()
    engine = RecordingEngine()
    engine.push(3)
    resumed = RolloutQueue(1, 8, engine.generate, timeout=WAIT)
    resumed.load_state_dict(state)
    resumed.start(3, engine.request)
    # kept: the rollouts of updates 4 and 5, from the weights after updates 1 and 2. Update 4's is 2 versions older
    # than the policy that trains on it (after update 3): too stale for N = 1, sampled again when taken, from the
    # engine's weights (the checkpoint's), and said so; update 5's, 2 older than the policy after update 4, is too
    four = resumed.take(4)
    assert (four.version, four.resampled, four.outputs[0][0]) == (3, True, [4, 3])
    resumed.before_push(), engine.push(4), resumed.pushed(4)
    five = resumed.take(5)
    assert (five.version, five.resampled) == (4, True)
    resumed.before_push(), engine.push(5), resumed.pushed(5)
    six = resumed.take(6)  # asked after update 4's push, from its weights: one version old, within the bound
    assert (six.version, six.resampled) == (4, False)


def test_the_sampler_trainer_kl_and_the_share_of_truncated_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])  # the trainer's log-probs of the sampled tokens
    sampled = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -0.5, 3.0]])  # vLLM's
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ratios = off_policy.importance_sampling_weights(old, sampled, mask, "token_truncate", None, None)
    weights = off_policy.importance_sampling_weights(old, sampled, mask, "token_truncate", None, 1.2)
    metrics = sampling_metrics(old, sampled, mask, Correction(None, weights, ratios))
    # k3 = exp(x) - 1 - x of the log-ratios 0.5, -1, 0, 0, -3.5 of the 5 real tokens, averaged:
    # (e^0.5 - 1.5 + e^-1 + 0 + 0 + e^-3.5 + 2.5) / 5
    assert metrics["sampling/kl"] == pytest.approx(0.6093596, rel=1e-6)
    assert metrics["sampling/kl"] > 0
    assert metrics["sampling/importance_sampling_ratio/clipped_fraction"] == pytest.approx(1 / 5)  # exp(0.5) > 1.2
    sequence_ratios = off_policy.importance_sampling_weights(old, sampled, mask, "sequence_mask", None, None)
    sequence = off_policy.importance_sampling_weights(old, sampled, mask, "sequence_mask", 0.5, 3.0)
    metrics = sampling_metrics(old, sampled, mask, Correction(None, sequence, sequence_ratios))
    assert metrics["sampling/importance_sampling_ratio/clipped_fraction"] == pytest.approx(1 / 2)  # exp(-3.5) masked


def test_the_two_sequence_masks_by_hand():
    """The geometric mask (SkyRL; OpenRLHF's and NeMo-RL's seq-mask-tis) keeps a completion whose mean token log-ratio
    log pi_trainer - log pi_vllm is inside log [0.99, 1.01], whatever its length; the off-policy sequence mask
    (DeepSeek-V3.2) drops a completion with A < 0 whose mean log pi_vllm - log pi_trainer exceeds the threshold. Each
    logs the share of completions it masked."""
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, 0.0, 0.0], [-2.0, -2.0, -2.0, 0.0]])  # the trainer's
    drift = torch.tensor([[0.005, 0.005, 0.005, 0.005], [0.04, 0.0, 0.0, 0.0], [-0.3, -0.3, -0.3, 0.0]])
    sampled = old + drift  # vLLM's: row 0 a little likelier throughout, row 1 on its first token, row 2 less likely
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    ratios = off_policy.importance_sampling_weights(old, sampled, mask, "sequence_geometric_mask", None, None)
    # geometric means exp(-0.005), exp(-0.02), exp(0.3): one per completion, however long
    torch.testing.assert_close(ratios, torch.tensor([[-0.005], [-0.02], [0.3]]).exp())
    kept = off_policy.importance_sampling_weights(old, sampled, mask, "sequence_geometric_mask", 0.99, 1.01)
    assert kept.flatten().tolist() == [pytest.approx(ratios[0, 0].item()), 0.0, 0.0]  # exp(-0.02) < 0.99 masked
    # the product ratio of row 0 is exp(-0.02): a sequence_mask with the same bounds would keep it, and its length
    # decides that (30 such tokens would be masked by a product, never by the mean)
    metrics = sampling_metrics(old, sampled, mask, Correction(None, kept, ratios))
    assert metrics["sampling/importance_sampling_ratio/clipped_fraction"] == pytest.approx(2 / 3)

    advantages = torch.tensor([-1.0, -1.0, 1.0])
    # mean drift log pi_vllm - log pi_trainer: 0.005, 0.02, -0.3
    kept = off_policy.off_policy_sequence_mask(old, sampled, mask, advantages, threshold=0.008)
    assert kept.flatten().tolist() == [1.0, 0.0, 1.0]  # row 1 drifted past it with A < 0; row 2 has A > 0
    assert off_policy.off_policy_sequence_mask(old, sampled, mask, -advantages, 0.008).flatten().tolist() == [1.0] * 3
    assert off_policy.off_policy_sequence_mask(old, sampled, mask, advantages, 0.0).flatten().tolist() == [
        0.0,
        0.0,
        1.0,
    ]
    metrics = sampling_metrics(old, sampled, mask, Correction(None, kept=kept))
    assert metrics["sampling/off_policy_masked_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"geometric_mask_bounds": (1.0, 1.01)}, "must hold 1 between them"),
        ({"geometric_mask_bounds": (0.9, 1.1)}, "are the bounds of --importance_sampling_mode"),
        ({"off_policy_mask_threshold": -0.1}, "must be >= 0"),
        ({"off_policy_mask_threshold": 0.1, "importance_sampling_correction": False}, "give one of them"),
        *[
            ({**geometric, "importance_sampling_correction": False}, NO_GEOMETRIC_MASK)
            for geometric in (
                {"importance_sampling_mode": "sequence_geometric_mask"},
                {"importance_sampling_mode": "sequence_geometric_mask", "geometric_mask_bounds": (0.9, 1.1)},
            )
        ],
    ],
)
def test_bad_sequence_mask_options_are_refused(options, needle, tiny):
    for script in (rloo, rloo_vllm, rloo_multigpu):
        args = dataclasses.replace(script.Args(model_name_or_path=tiny["policy"]), **options)
        with pytest.raises(UsageError, match=re.escape(needle)):
            ImportanceSamplingOptions.check(args)


def test_the_geometric_mask_without_the_correction_is_refused_from_the_command_line(tiny, monkeypatch):
    """TRL's names, as a user gives them: the mask weighs the loss only through the correction, which they turn off (it
    was taken, and nothing masked); with the correction on, the same options are taken."""
    geometric = ["--vllm_importance_sampling_mode", "sequence_geometric_mask", "--vllm_geometric_mask_bounds", "0.9"]
    argv = ["--model_name_or_path", tiny["policy"], *geometric, "1.1"]
    for script in (rloo, rloo_vllm, rloo_multigpu):
        monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *argv, "--no-vllm_importance_sampling_correction"])
        args = parse_args(script.Args)
        with pytest.raises(UsageError) as refused:
            check_args(args)
        assert str(refused.value) == NO_GEOMETRIC_MASK
        monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *argv])
        check_args(parse_args(script.Args))


def test_the_sequence_masks_need_vllm_samples(tiny):
    """rloo_multigpu.py without a server generates with HF generate: no sampler log-probs to mask with."""
    for options in (
        {"off_policy_mask_threshold": 0.1},
        {"importance_sampling_mode": "sequence_geometric_mask"},
    ):
        args = dataclasses.replace(rloo_multigpu.Args(model_name_or_path=tiny["policy"]), **options)
        with pytest.raises(UsageError, match="this run generates with HF generate"):
            check_vllm_args(args, server=False)
        check_vllm_args(args, server=True)  # with a server: taken


def test_max_staleness_is_refused_where_it_cannot_be_overlapped_or_corrected(tiny):
    def refused(script, server, *needles, **options):
        args = dataclasses.replace(script.Args(model_name_or_path=tiny["policy"]), **options)
        with pytest.raises(UsageError) as error:
            check_vllm_args(args, server=server)
        for needle in needles:
            assert needle in str(error.value), str(error.value)

    refused(rloo_vllm, True, "--max_staleness must be >= 0", max_staleness=-1)
    refused(
        rloo_vllm, False, "this run has no server", max_staleness=1
    )  # colocated: generation and update share a device
    refused(rloo_multigpu, False, "this run has no server", max_staleness=1)  # HF generate
    refused(
        rloo_vllm,
        True,
        "--no_importance_sampling_correction",
        max_staleness=2,
        importance_sampling_correction=False,
    )
    check_vllm_args(dataclasses.replace(rloo_vllm.Args(), max_staleness=1, vllm_mode="server"), server=True)
    for script in (rloo_vllm, rloo_multigpu):  # multi-turn rollouts too: made whole in the queue's thread
        check_vllm_args(dataclasses.replace(script.Args(), max_staleness=1, tools=["tools.py:f"]), server=True)


def server_args(tiny, prompts_file, server, *extra):
    return [*resume_args(tiny, prompts_file, "--vllm_mode", "server", "--vllm_server_base_url", server["url"], *extra)]


@pytest.mark.slow
def test_a_run_with_max_staleness_logs_it_and_a_sigkilled_one_resumes_as_the_same_run(
    tiny, server, prompts_file, tmp_path
):
    """With --max_staleness 1 the rollout of update j comes from the weights after update j - 2; the checkpoint after
    update 3 keeps the rollout of update 4 (from the weights after update 2, gone by then), and the resumed run asks the
    server for that of update 5 again: it ends as the uninterrupted run, metrics, sample tables and weights."""
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir(), interrupted.mkdir()
    args = server_args(tiny, prompts_file, server, "--max_staleness", 1)
    proc = run_rloo(*args, cwd=reference, script="rloo_vllm.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = run_outcome(str(reference / "runs" / "run"))
    assert [r["async/staleness"] for r in expected[0]] == [0, 1, 1, 1, 1, 1]
    assert all(r["sampling/kl"] >= 0 for r in expected[0])
    assert max(r["sampling/sampling_logp_difference/max"] for r in expected[0][1:]) > 1e-3  # older weights sampled
    assert all(0 <= r["sampling/importance_sampling_ratio/clipped_fraction"] <= 1 for r in expected[0])

    sigkill_after_updates(args, interrupted, 4)
    checkpoint = interrupted / "runs" / "run" / "checkpoints" / "checkpoint-3"
    assert sorted(os.listdir(checkpoint.parent)) == ["checkpoint-3"]
    state = torch.load(checkpoint / "training_state.pt", weights_only=True)
    assert list(state["rollouts"]["per_process"][0]["kept"]) == [4]  # sampled from the weights after update 2
    resumed = run_rloo(*args, "--resume_from_checkpoint", "latest", cwd=interrupted, script="rloo_vllm.py")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = run_outcome(str(interrupted / "runs" / "run"))
    assert [r["episode"] for r in got[0]] == [8 * i for i in range(1, 7)]
    assert got[0] == expected[0] and got[1] == expected[1]
    assert all(torch.equal(got[2][k], expected[2][k]) for k in expected[2])


@pytest.mark.slow
def test_rloo_multigpu_with_max_staleness_on_two_processes_is_the_run_of_one(tiny, server, prompts_file, tmp_path):
    """Each process asks the server for its rows of the rollout; the queue runs in step on both."""
    args = [
        a for a in server_args(tiny, prompts_file, server, "--max_staleness", 1) if a not in ("--vllm_mode", "server")
    ]
    args[args.index("--total_episodes") + 1] = 96  # 6 updates of 16 completions, in one minibatch (of every process)
    args[args.index("--num_mini_batches") + 1] = 1
    outcomes = []
    for nproc in (1, 2):
        cwd = tmp_path / str(nproc)
        cwd.mkdir()
        args[args.index("--per_device_train_batch_size") + 1] = 16 // nproc  # the same global batch
        proc = run_torchrun(nproc, *args, cwd=cwd)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outcomes.append(run_outcome(str(cwd / "runs" / "run")))
    (m1, s1, _), (m2, s2, _) = outcomes
    updates = [r for r in m1 if "episode" in r]
    assert [r["async/staleness"] for r in updates] == [0, 1, 1, 1, 1, 1]
    assert s1 == s2 and len(m1) == len(m2)  # the same greedy sample tables
    for a, b in zip(m1, m2):
        assert a.keys() == b.keys()
        for key in a.keys() - PER_MICRO_BATCH:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key  # rounding, through exp() and 6 updates


@pytest.mark.slow
def test_a_server_that_dies_under_a_background_rollout_is_one_line_and_the_run_keeps_its_checkpoint(
    tiny, dying_server, prompts_file, tmp_path
):
    """The server dies while the rollouts of later updates are being generated."""
    args = server_args(tiny, prompts_file, dying_server, "--max_staleness", 2, "--vllm_server_timeout", 10)
    kill_the_server_under_a_run(dying_server, args, tmp_path)
