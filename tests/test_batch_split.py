"""The gradient of one optimizer step does not depend on how its minibatch is split (issue 57): for every advantage
estimator, loss and aggregation (and, in the vLLM scripts, every importance-sampling mode), one micro-batch, k
micro-batches with gradient accumulation, and two processes (gloo) each holding half the rows give the same gradient and
loss to float rounding; a run's update is the same whatever its --per_device_train_batch_size.

The optimizer step is the loop's, written here with the scripts' own functions: the minibatch's token count from
tokens_in_loss, called once a step on the rows a process holds, as main() calls it (rloo_multigpu.py's all-reduces it
over the processes), each micro-batch's share of the loss from policy_loss, the shares' gradients summed (accumulation,
or FSDP's sum over the processes). That main() calls tokens_in_loss once a minibatch, not once a micro-batch, is held
by the runs: test_a_run_updates_alike_whatever_its_micro_batch_size here (rloo.py) and tests/test_multigpu.py's
1-against-2-processes test (rloo_multigpu.py). The four metrics that are by definition per micro-batch (val/ratio and
val/ratio_var, the clip extremes clip_ratio/low_min and high_max) are not part of this: docs/metrics.md says so.
"""

import datetime
import os

import pytest
import torch

import rloo
from conftest import free_port, join_processes, read_metrics, run_outcome, run_rloo
from rloo_utils import off_policy, packing

per_script = pytest.mark.usefixtures("each_script")  # each test runs against every script's functions

B, G, C = 8, 4, 6  # completions in the minibatch, per prompt, tokens per completion
LENGTHS = [6, 1, 3, 6, 2, 5, 4, 6]  # each completion's tokens
TOKEN_LEVEL = [
    {"loss_type": "token"},
    {"loss_type": "token", "ppo_clip": True},
    {"loss_type": "token", "ppo_clip": True, "dual_clip": 1.5},
    {"loss_type": "cispo"},
    {"loss_type": "gspo"},
    {"loss_type": "sapo"},
]
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# each with the entropy bonus (--entropy_coef), aggregated as its loss is; the default loss without it too
LOSSES = [{"loss_type": "sequence"}, {"loss_type": "sequence", "entropy_coef": 0.05}] + [
    {**loss, "loss_aggregation": a, "entropy_coef": 0.05} for loss in TOKEN_LEVEL for a in AGGREGATIONS
]
ESTIMATORS = [
    {"advantage_estimator": "rloo"},
    {"advantage_estimator": "grpo"},
    {"advantage_estimator": "dr_grpo"},
    {"advantage_estimator": "reinforce_pp"},
    {"advantage_estimator": "reinforce_pp", "token_level_kl": True},  # advantages that differ token by token
]
IMPORTANCE_SAMPLING = ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate", "sequence_geometric_mask"]


def options_id(options: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items())


def args_for(script, **options):
    """A script's Args with these options, after its checks and the defaults that depend on other options."""
    from rloo_utils.checks import check_args

    args = script.Args(**options)
    check_args(args)
    return script.resolve_defaults(args)


def minibatch(script, options: dict, on_policy: bool = False) -> dict:
    """A minibatch of B completions as the loop has it before the update: the policy's (B, C) log-probs, those of the
    policy that sampled (ratios well off 1, so that every clip acts, or exactly 1 on-policy), (B, C) advantages from the
    script's reward, KL and estimator, the (B, C) mask of uneven completions, the rows that train (an unscored one and
    one masked as truncated do not)."""
    args = args_for(script, **options, beta=0.1, num_generations=G)
    generator = torch.Generator().manual_seed(7)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(C)[None] < lengths[:, None]).float()  # (B, C)
    logprobs = -2 * torch.rand(B, C, generator=generator)  # (B, C)
    entropy = 3 * torch.rand(B, C, generator=generator) * mask  # (B, C) the policy's, 0 on padding
    old_logprobs = logprobs.clone() if on_policy else logprobs + 0.4 * torch.randn(B, C, generator=generator)
    ref_logprobs = old_logprobs + 0.1 * torch.randn(B, C, generator=generator)
    scores = torch.randn(B, generator=generator)
    scores[5] = float("nan")  # every reward function returned None
    kl = script.per_token_kl(old_logprobs, ref_logprobs, args.kl_estimator) * mask
    rlhf_reward, _ = script.kl_penalized_reward(scores, kl, mask, args.beta, args.token_level_kl)
    in_loss = script.has_baseline(rlhf_reward, G)
    in_loss[2] = False  # --mask_truncated_completions
    kl_before = script.kl_penalty_before(kl, args.beta, args.token_level_kl)
    advantages = script.compute_advantages(
        rlhf_reward, kl_before, in_loss, G, args.advantage_estimator, args.advantage_normalization
    )
    return {"args": args, "logprobs": logprobs, "old": old_logprobs, "advantages": advantages, "mask": mask,
            "in_loss": in_loss, "entropy": entropy}  # fmt: skip


def step(script, batch: dict, micro_batches: list[torch.Tensor], mini_batch_size: int = B):
    """The loss and the (2, B, C) gradient on the log-probs and on the entropies of one optimizer step of this process,
    each micro-batch (rows of the minibatch) adding its share as the loop's accumulation does; the token count the
    script's own, of the rows this process holds (all of the micro-batches'). The gradient on the parameters is these
    times the forward's Jacobian, the same in every split: equal gradients here are equal steps."""
    logprobs = batch["logprobs"].clone().requires_grad_()
    entropy = batch["entropy"].clone().requires_grad_()
    mask, in_loss = batch["mask"], batch["in_loss"]
    rows = torch.cat(micro_batches)  # main() calls it on `mask[mb], in_loss[mb]`: this process's rows of the minibatch
    mini_batch_tokens = script.tokens_in_loss(mask[rows], in_loss[rows])
    loss, gradient = torch.zeros(()), torch.zeros(2, *logprobs.shape)
    for idx in micro_batches:
        share, _ = script.policy_loss(
            batch["args"],
            logprobs[idx],
            batch["old"][idx],
            batch["advantages"][idx],
            mask[idx],
            in_loss[idx],
            mini_batch_size,
            mini_batch_tokens,
            entropy[idx],
        )
        gradient += torch.stack(
            torch.autograd.grad(share, [logprobs, entropy], allow_unused=True, materialize_grads=True)
        )
        loss += share.detach()
    return loss, gradient


ROW_TOKENS = torch.tensor(LENGTHS) + 4  # a prompt of 4 tokens and the completion, each row (packing.row_tokens)


def splits(order: torch.Tensor) -> dict:
    """The minibatch in 2 micro-batches of 4 rows, and in 8 of 1, in the loop's shuffled order; and as
    --max_tokens_per_micro_batch packs it at 16 and 20 tokens (5 and 4 micro-batches of 1 to 3 rows)."""
    fixed = {f"{size} rows": list(order.split(size)) for size in (4, 1)}
    budgets = {f"{n} tokens": packing.micro_batches(order, ROW_TOKENS, 4, n) for n in (16, 20)}
    assert [sorted(len(m) for m in micro) for micro in budgets.values()] == [[1, 1, 2, 2, 2], [1, 2, 2, 3]]
    return {**fixed, **budgets}


def assert_same_step(a, b, what: str):
    # (the loss less the entropy bonus: a difference of terms near 1, rounded in float32 to some 1e-7)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: loss: {m}")
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: gradient: {m}")


@pytest.fixture
def group_of_one():
    """The process group of one that a plain `python rloo_multigpu.py` forms (its all-reduce: the identity), on an
    in-memory store: no port taken, nothing written to the environment; gone after the test. A group this process
    formed already is used as it is: an in-process vLLM engine (an earlier test's, shared by its file) forms one of
    this process alone, which lives as long as the engine, and a second init_process_group would fail."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1, "a group of one process is what rloo_multigpu.py's reference forms"
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("loss", LOSSES, ids=options_id)
@per_script
@pytest.mark.usefixtures("group_of_one")  # rloo_multigpu.py's tokens_in_loss all-reduces
def test_the_gradient_of_a_step_does_not_depend_on_its_micro_batches(loss):
    order = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    for estimator in ESTIMATORS:
        for on_policy in (False, True):
            batch = minibatch(rloo, {**estimator, **loss}, on_policy)
            whole = step(rloo, batch, [torch.arange(B)])
            assert whole[1][0].abs().sum() > 0, "a loss with no gradient would pass vacuously"
            assert (whole[1][1].abs().sum() > 0) == ("entropy_coef" in loss), "the bonus's gradient, and only with it"
            for size, micro_batches in splits(order).items():
                assert_same_step(step(rloo, batch, micro_batches), whole, f"{estimator}, micro-batches of {size}")
            if not on_policy:  # vLLM's samples: weighted, masked
                sampling_logprobs = batch["old"] + 0.2 * torch.randn(B, C, generator=torch.Generator().manual_seed(5))
                for mode in IMPORTANCE_SAMPLING:
                    bounds = (0.9, 1.1) if mode == "sequence_geometric_mask" else (0.5, 2.0)
                    weights = off_policy.importance_sampling_weights(
                        batch["old"], sampling_logprobs, batch["mask"], mode, *bounds
                    )
                    # and the off-policy sequence mask on top, as the loop applies it
                    weights = weights * off_policy.off_policy_sequence_mask(
                        batch["old"], sampling_logprobs, batch["mask"], batch["advantages"][:, 0], 0.05
                    )
                    weighted = {**batch, "advantages": batch["advantages"] * weights}
                    whole = step(rloo, weighted, [torch.arange(B)])
                    for size, micro_batches in splits(order).items():
                        what = f"{estimator}, {mode}, micro-batches of {size}"
                        assert_same_step(step(rloo, weighted, micro_batches), whole, what)


def test_a_token_budget_packs_first_fit_decreasing_and_splits_to_the_count_the_processes_agree():
    rows = torch.tensor([5, 0, 3, 1, 4, 2])  # a minibatch's rows of the rollout, shuffled
    tokens = torch.tensor([3, 5, 2, 7, 3, 4])  # each rollout row's
    fixed = packing.micro_batches(rows, tokens, 4, None)
    assert [m.tolist() for m in fixed] == [[5, 0, 3, 1], [4, 2]]  # 4 rows each, in order
    # longest first: row 3 (7), 1 (5), 5 (4), 0 (3), 4 (3), 2 (2), each into the first micro-batch with room in 10
    packed = packing.micro_batches(rows, tokens, 4, 10)
    assert [m.tolist() for m in packed] == [[0, 3], [5, 1], [4, 2]]  # 10, 9 and 5 tokens, rows in minibatch order
    # another process packed into 5: the fullest with two rows is split, then the next
    agreed = packing.micro_batches(rows, tokens, 4, 10, agree=lambda count: 5)
    assert [m.tolist() for m in agreed] == [[3], [1], [4, 2], [0], [5]]
    assert len(packing.micro_batches(rows, tokens, 4, 10, agree=lambda count: 6)) == 6  # one row each at most
    padded = packing.row_tokens(torch.ones(3, 5), torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]), padding_free=False)
    assert padded.tolist() == [8, 8, 8]  # a padded forward holds every row at the batch's width
    real = packing.row_tokens(torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([[1, 0], [1, 1]]), padding_free=True)
    assert real.tolist() == [3, 5]


def two_processes_step(rank: int, port: int, results: str) -> None:
    """One of two processes of rloo_multigpu.py's update, with its functions: its own half of the minibatch's rows (the
    loop's: each process takes its minibatches from its own rows), the token count of its rows from the script's
    tokens_in_loss (which all-reduces it), its shares of the global loss in micro-batches of 2 and in those a token
    budget packs, their gradients summed over the processes here (FSDP's sum, set in sharded.shard)."""
    import torch.distributed as dist

    import rloo_multigpu
    from rloo_utils.processes import all_reduce, max_over_processes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    own = torch.arange(rank * B // 2, (rank + 1) * B // 2)
    outcomes = {}
    for loss in LOSSES:
        for estimator in ESTIMATORS:
            batch = minibatch(rloo_multigpu, {**estimator, **loss})
            order = own[torch.randperm(len(own), generator=torch.Generator().manual_seed(rank))]
            local_loss, local_gradient = step(rloo_multigpu, batch, list(order.split(2)))
            outcomes[options_id({**estimator, **loss})] = (all_reduce(local_loss), all_reduce(local_gradient))
            # at 12 tokens rank 0's rows pack into 3 micro-batches, rank 1's into 4: rank 0 splits one, as FSDP needs
            micro = packing.micro_batches(order, ROW_TOKENS, 2, 12, max_over_processes)
            counts = torch.tensor([len(micro), -len(micro)])
            assert all_reduce(counts, dist.ReduceOp.MAX).tolist() == [4, -4], counts
            local_loss, local_gradient = step(rloo_multigpu, batch, micro)
            outcomes[options_id({**estimator, **loss}) + " 12 tokens"] = (
                all_reduce(local_loss),
                all_reduce(local_gradient),
            )
    if rank == 0:
        torch.save(outcomes, results)
    dist.destroy_process_group()


@pytest.mark.slow  # two processes start: the fast tier starts none
@pytest.mark.usefixtures("group_of_one")  # the reference: rloo_multigpu.py's tokens_in_loss on one process
def test_two_processes_give_the_gradient_of_one(tmp_path):
    import torch.multiprocessing as mp

    import rloo_multigpu

    results = str(tmp_path / "two.pt")
    context = mp.start_processes(
        two_processes_step, args=(free_port(), results), nprocs=2, start_method="spawn", join=False
    )
    join_processes(context, seconds=300)  # about 20 s on 2 cores; the group's own timeout is 120 s
    two = torch.load(results)
    assert len(two) == 2 * len(LOSSES) * len(ESTIMATORS)
    for loss in LOSSES:
        for estimator in ESTIMATORS:
            batch = minibatch(rloo_multigpu, {**estimator, **loss})
            name = options_id({**estimator, **loss})
            for split in (name, name + " 12 tokens"):
                assert_same_step(two[split], step(rloo_multigpu, batch, [torch.arange(B)]), split)


# A run: 2 updates of 16 completions, 2 epochs of 2 minibatches (the later ones off-policy), each minibatch of 8 one
# micro-batch of 8, or 4 of 2, or those a budget of 40 tokens packs (rows of up to 32 + 8); its logged update metrics
# and its weights the same
def per_device_run(tiny, data, cwd, per_device: int, *loss) -> tuple:
    proc = run_rloo(
        *("--model_name_or_path", tiny["policy"], "--dataset_name", data, "--reward_model_path", tiny["reward"]),
        *("--total_episodes", 32, "--num_generations", 4, "--max_completion_length", 8, "--learning_rate", "3e-3"),
        *("--max_prompt_length", 32),
        *("--num_ppo_epochs", 2, "--num_mini_batches", 2, "--per_device_train_batch_size", per_device),
        *("--gradient_accumulation_steps", 8 // per_device, "--beta", 0.1, "--run_name", "run", "--seed", 4),
        *loss,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(cwd), run_outcome(str(cwd / "runs" / "run"))[2]


PER_MICRO_BATCH = {"val/ratio", "val/ratio_var", "clip_ratio/low_min", "clip_ratio/high_max"}  # docs/metrics.md
SPLIT = {"perf/micro_batches_per_step", "perf/micro_batch_tokens_max"}  # what the split is


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss",
    # a loss per completion, and one per token with the entropy bonus
    [["--loss_type", "sequence"], ["--loss_type", "token", "--ppo_clip", "--entropy_coef", "0.01"]],
    ids=" ".join,
)
def test_a_run_updates_alike_whatever_its_micro_batch_size(loss, tiny, prompts_file, tmp_path):
    for folder in ("8", "2", "budget"):
        (tmp_path / folder).mkdir()
    metrics, weights = per_device_run(tiny, prompts_file, tmp_path / "8", 8, *loss)  # one micro-batch per minibatch
    for folder, split in [("2", [2]), ("budget", [8, "--max_tokens_per_micro_batch", 40])]:
        other_metrics, other_weights = per_device_run(tiny, prompts_file, tmp_path / folder, *split, *loss)
        assert metrics[-1]["loss/policy_avg"] != 0 and len(metrics) == len(other_metrics) == 2
        assert ("loss/entropy_bonus" in metrics[-1]) == ("--entropy_coef" in loss)
        assert all(m["perf/micro_batches_per_step"] == 1 for m in metrics)
        assert all(m["perf/micro_batches_per_step"] > 1 for m in other_metrics)
        if folder == "budget":  # each held at most the budget (one micro-batch of 8 held more), and several rows
            assert all(
                m["perf/micro_batch_tokens_max"] <= 40 < n["perf/micro_batch_tokens_max"]
                for m, n in zip(other_metrics, metrics)
            )
            assert all(m["perf/micro_batches_per_step"] < 8 for m in other_metrics)
        for a, b in zip(metrics, other_metrics):
            for k in a.keys() - PER_MICRO_BATCH - SPLIT:
                if not k.startswith("time/") and k not in {"eps", "step_time"} and "per_second" not in k:
                    assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (folder, k)
        for k in weights:  # Adam magnifies rounding where a gradient is ~0: a few weights in a thousand may differ
            off = ~torch.isclose(other_weights[k], weights[k], rtol=1e-3, atol=1e-4)
            assert off.float().mean() <= 1e-3, (folder, k, int(off.sum()))


@per_script
def test_a_budget_that_cannot_hold_the_longest_row_is_refused():
    from rloo_utils.errors import UsageError

    with pytest.raises(UsageError, match=r"--max_tokens_per_micro_batch 100 cannot hold the longest row \(.* = 288"):
        args_for(rloo, max_prompt_length=256, max_completion_length=32, max_tokens_per_micro_batch=100)
    args_for(rloo, max_prompt_length=256, max_completion_length=32, max_tokens_per_micro_batch=288)
