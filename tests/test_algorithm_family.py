"""The advantage estimators and policy losses of seed 002: each against values computed by hand, gradients checked
with torch.autograd, the default against the previous implementation, and an end-to-end run of each."""

import math
import types

import pytest
import torch

import rloo
from rloo_utils import logs
from rloo_utils.logs import update_metrics
from rloo_utils.checks import check_args
from conftest import read_metrics, run_rloo


per_script = pytest.mark.usefixtures("each_script")  # a test of shared functions runs against every script


def args_for(*argv: str) -> rloo.Args:
    """Args as the script sees them after its checks and defaults."""
    import tyro

    args = tyro.cli(rloo.Args, args=list(argv), use_underscores=True)
    check_args(args)
    return rloo.resolve_defaults(args)


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float).requires_grad_()


# ----------------------------------------------------------------------------------------------------------------
# Advantage estimators: one group [1, 2, 3, 6] (mean 3, unbiased std sqrt(14/3)) and one group [0, 0, 4, 4]
# ----------------------------------------------------------------------------------------------------------------
REWARDS = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 4.0, 4.0])
ALL = torch.ones(8, dtype=torch.bool)


def by_hand(estimator):
    groups = REWARDS.view(2, 4)
    centred = groups - groups.mean(1, keepdim=True)  # [-2, -1, 0, 3], [-2, -2, 2, 2]
    if estimator == "rloo":
        return (centred * 4 / 3).view(-1)
    if estimator == "grpo":
        return (centred / (torch.tensor([[math.sqrt(14 / 3)], [math.sqrt(16 / 3)]]) + 1e-4)).view(-1)
    if estimator == "dr_grpo":
        return centred.view(-1)
    flat = centred.view(-1)  # reinforce_pp: mean 0 already; whitened with the batch's unbiased std
    return flat / (math.sqrt(sum(x * x for x in flat.tolist()) / 7) + 1e-4)


@per_script
@pytest.mark.parametrize("estimator", ["rloo", "grpo", "dr_grpo", "reinforce_pp"])
def test_each_estimator_by_hand_with_its_default_normalisation(estimator):
    args = args_for("--advantage_estimator", estimator)
    kl_before = torch.zeros(8, 3)
    advantages = rloo.compute_advantages(
        REWARDS, kl_before, ALL, 4, args.advantage_estimator, args.advantage_normalization
    )
    assert advantages.shape == (8, 3)  # every token carries its completion's advantage (no token-level KL)
    torch.testing.assert_close(advantages, by_hand(estimator)[:, None].expand(8, 3))
    # With a token-level KL, its part is divided by what the centred reward was divided by: 1, the group's std or the
    # batch's
    divisor = {
        "rloo": torch.ones(8),
        "dr_grpo": torch.ones(8),
        "grpo": (torch.tensor([[math.sqrt(14 / 3)], [math.sqrt(16 / 3)]]) + 1e-4).expand(2, 4).reshape(-1),
        "reinforce_pp": torch.full((8,), math.sqrt(30 / 7) + 1e-4),  # the centred rewards' squares sum to 30
    }[estimator]
    kl_before[:, 1:] = 0.5
    with_kl = rloo.compute_advantages(
        REWARDS, kl_before, ALL, 4, args.advantage_estimator, args.advantage_normalization
    )
    torch.testing.assert_close(with_kl[:, 1:] - with_kl[:, :1], 0.5 / divisor[:, None].expand(8, 2))
    torch.testing.assert_close(with_kl[:, 0], advantages[:, 0])


@per_script
def test_rloo_with_group_normalisation_divides_the_leave_one_out_advantage_by_the_group_std():
    advantages = rloo.compute_advantages(REWARDS, torch.zeros(8, 1), ALL, 4, "rloo", "group")[:, 0]
    std = torch.tensor([math.sqrt(14 / 3)] * 4 + [math.sqrt(16 / 3)] * 4)
    torch.testing.assert_close(advantages, by_hand("rloo") / (std + 1e-4))


@per_script
def test_group_estimators_skip_unscorable_rows_and_rows_that_do_not_train():
    rewards = torch.tensor(
        [
            1.0,
            math.nan,
            3.0,
            5.0,  # mean of the scorable three: 3
            2.0,
            math.nan,
            math.nan,
            math.nan,
        ]
    )  # a single scorable reward: no baseline
    # Row 3: a truncated completion (--mask_truncated_completions); row 4 has no baseline.
    trains = rloo.has_baseline(rewards, 4) & torch.tensor([True, True, True, False, True, True, True, True])
    assert trains.tolist() == [True, False, True, False, False, False, False, False]
    dr = rloo.compute_advantages(rewards, torch.zeros(8, 1), trains, 4, "dr_grpo", "none")[:, 0]
    torch.testing.assert_close(dr, torch.tensor([-2.0, 0, 0, 0, 0, 0, 0, 0]))
    grpo = rloo.compute_advantages(rewards, torch.zeros(8, 1), trains, 4, "grpo", "group")[:, 0]
    torch.testing.assert_close(grpo, torch.tensor([-2.0 / (2.0 + 1e-4), 0, 0, 0, 0, 0, 0, 0]))  # std of 1, 3, 5 is 2
    # REINFORCE++ whitens over the rows that train only: here rows 0 and 2, centred -2 and 0.
    pp = rloo.compute_advantages(rewards, torch.zeros(8, 1), trains, 4, "reinforce_pp", "batch")[:, 0]
    torch.testing.assert_close(
        pp, torch.tensor([-1 / (math.sqrt(2) + 1e-4), 0, 1 / (math.sqrt(2) + 1e-4), 0, 0, 0, 0, 0])
    )


@per_script
def test_estimator_defaults_and_the_trl_flag():
    assert args_for().advantage_normalization == "none"
    assert args_for("--advantage_estimator", "grpo").advantage_normalization == "group"
    assert args_for("--advantage_estimator", "grpo", "--normalize_advantages").advantage_normalization == "batch"
    assert args_for("--advantage_estimator", "dr_grpo").advantage_normalization == "none"
    assert args_for("--advantage_estimator", "reinforce_pp").advantage_normalization == "batch"


FORK_ESTIMATOR = """
def best_of_group_advantages(rewards, num_generations):
    \"\"\"A_i = r_i - max of its group: what a fork might try.\"\"\"
    r = rewards.view(-1, num_generations)
    return (r - r.amax(1, keepdim=True)).view(-1)


ESTIMATORS = {
    "best_of_group": Estimator(best_of_group_advantages, "group"),"""


def fork_of(script: str, registry: str, addition: str, tmp_path, monkeypatch):
    """A copy of the script with `addition` (a function and the first entry of the registry) put in, imported."""
    import importlib.util
    import os
    import sys

    from conftest import ROOT

    source = open(os.path.join(ROOT, script)).read()
    assert source.count(f"\n{registry} = {{") == 1
    fork = tmp_path / f"fork_{script}"
    fork.write_text(source.replace(f"\n{registry} = {{", addition))
    monkeypatch.syspath_prepend(ROOT)  # its rloo_utils/, as a fork beside the script has it
    spec = importlib.util.spec_from_file_location(fork.stem, fork)
    forked = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, forked)  # as a script's own module is, while its classes are made
    spec.loader.exec_module(forked)
    return forked


@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_a_new_estimator_is_a_function_and_an_entry(script, tmp_path, monkeypatch):
    """A fork adds an estimator by adding its function and its entry to ESTIMATORS, nothing else: the option takes its
    name (the choices are the registry's), the estimator's normalisation is its default, and the advantages are its."""
    import typing

    forked = fork_of(script, "ESTIMATORS", FORK_ESTIMATOR, tmp_path, monkeypatch)
    assert typing.get_args(forked.AdvantageEstimator) == tuple(forked.ESTIMATORS) == ("best_of_group", "rloo", "grpo",
        "dr_grpo", "reinforce_pp")  # fmt: skip
    import tyro

    args = tyro.cli(forked.Args, args=["--advantage_estimator", "best_of_group"], use_underscores=True)
    check_args(args)
    args = forked.resolve_defaults(args)
    assert args.advantage_normalization == "group"
    advantages = forked.compute_advantages(REWARDS, torch.zeros(8, 1), ALL, 4, "best_of_group", "none")[:, 0]
    torch.testing.assert_close(advantages, torch.tensor([-5.0, -4.0, -3.0, 0.0, -4.0, -4.0, 0.0, 0.0]))
    with pytest.raises(SystemExit):  # and a name that is not in the registry is refused by the parser
        tyro.cli(forked.Args, args=["--advantage_estimator", "best_of_grup"], use_underscores=True)


FORK_LOSS = """
def sequence_reinforce_loss(logprobs, old_logprobs, advantages, mask, args):
    \"\"\"-A log pi(y) per completion, with the mean sequence ratio as a statistic of its own.\"\"\"
    logprob_sum = (logprobs * mask).sum(1)
    log_ratio = logprob_sum.detach() - (old_logprobs * mask).sum(1)
    return -advantages[:, 0] * logprob_sum, log_ratio, {"fork/ratio_mean": log_ratio.exp()}


LOSSES = {
    "sequence_reinforce": Loss(sequence_reinforce_loss, None),"""


@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_a_new_loss_is_a_function_and_an_entry(script, tmp_path, monkeypatch):
    """A fork adds a loss by adding its function and its entry to LOSSES, nothing else: --loss_type takes its name,
    the training loop's policy_loss makes the minibatch loss of it, and its statistics reach the logged metrics."""
    import typing

    import tyro

    forked = fork_of(script, "LOSSES", FORK_LOSS, tmp_path, monkeypatch)
    assert typing.get_args(forked.LossType) == tuple(forked.LOSSES)
    assert typing.get_args(forked.LossType)[:2] == ("sequence_reinforce", "sequence")
    args = tyro.cli(forked.Args, args=["--loss_type", "sequence_reinforce"], use_underscores=True)
    check_args(args)
    args = forked.resolve_defaults(args)
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([[2.0], [-1.0]]).expand(2, 3)
    loss, stats = forked.policy_loss(args, logprobs, old, advantages, mask, torch.tensor([True, True]), 2, None)
    torch.testing.assert_close(loss, torch.tensor(-(2.0 * -3.0 + -1.0 * -1.5) / 2))  # the mean of -A log pi(y)
    torch.testing.assert_close(stats.sums["units"], torch.tensor(2.0))  # one unit per completion
    torch.testing.assert_close(stats.own["fork/ratio_mean"], torch.tensor(math.exp(0.5) + math.exp(0.5)))
    micro = {
        name: [float(value)]
        for name, value in {**stats.sums, **stats.own, "entropy": 0.0, "tokens": 5.0, "forward_tokens": 8.0}.items()
    }
    metrics = update_metrics(micro, [loss.item()], [1.0], [1e-5], list(stats.own))
    assert metrics["fork/ratio_mean"] == pytest.approx(math.exp(0.5))  # its mean over the units, logged
    with pytest.raises(SystemExit):  # and a name that is not in the registry is refused by the parser
        tyro.cli(forked.Args, args=["--loss_type", "sequence_reinfroce"], use_underscores=True)


# ----------------------------------------------------------------------------------------------------------------
# Losses, per token. Three tokens with ratios r = [1.5, 0.5, 1.1] against pi_old, advantages per sequence.
# ----------------------------------------------------------------------------------------------------------------
OLD = torch.tensor([[-1.0, -2.0, -0.5]])
RATIOS = torch.tensor([[1.5, 0.5, 1.1]])


MASK = torch.ones(1, 3)
SAPO = types.SimpleNamespace(sapo_tau_pos=1.0, sapo_tau_neg=1.05)


def current_logprobs():
    return (OLD + RATIOS.log()).requires_grad_()


def options(epsilon=0.2, epsilon_high=0.2, ppo_clip=False, dual_clip=None):
    """The options a loss reads."""
    return types.SimpleNamespace(epsilon=epsilon, epsilon_high=epsilon_high, ppo_clip=ppo_clip, dual_clip=dual_clip)


@per_script
def test_token_policy_gradient_by_hand():
    logprobs = current_logprobs()
    loss, log_ratio, _ = rloo.token_loss(logprobs, OLD, torch.tensor([[2.0]]), MASK, options())
    torch.testing.assert_close(loss, -2.0 * logprobs.detach())
    torch.testing.assert_close(log_ratio.exp(), RATIOS)  # not in the loss: for the clip metrics
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.full((1, 3), -2.0))


@per_script
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_token_ppo_clip_by_hand(advantage):
    logprobs = current_logprobs()
    loss, log_ratio, _ = rloo.token_loss(logprobs, OLD, torch.tensor([[advantage]]), MASK, options(0.2, 0.3, True))
    torch.testing.assert_close(log_ratio.exp(), RATIOS)
    if advantage > 0:  # 1.5 is clipped at 1.3 (no gradient); 0.5 and 1.1 are not (the clip only stops increases)
        expected, grad = [-1.3, -0.5, -1.1], [0.0, -0.5, -1.1]
    else:  # 0.5 is clipped at 0.8 (no gradient); 1.5 and 1.1 keep -A r
        expected, grad = [1.5, 0.8, 1.1], [1.5, 0.0, 1.1]
    torch.testing.assert_close(loss.detach(), torch.tensor([expected]))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([grad]))  # d(-A r)/d log p = -A r
    low, high = logs.clipped_units(torch.exp(logprobs.detach() - OLD), torch.tensor([[advantage]]), 0.2, 0.3)
    assert ((logprobs.grad == 0) == (low | high)).all()  # the clip fraction counts exactly the cut tokens


@per_script
def test_dual_clip_caps_the_loss_of_negative_advantages():
    old = torch.zeros(1, 3)
    logprobs = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], requires_grad=True)
    loss, _, _ = rloo.token_loss(logprobs, old, torch.tensor([[-1.0]]), MASK, options(0.2, 0.2, True, dual_clip=3.0))
    # ratio 5 with A = -1: PPO's loss 5 is capped at c|A| = 3 and has no gradient; ratio 2 stays at 2.
    torch.testing.assert_close(loss.detach(), torch.tensor([[3.0, 2.0, 3.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    positive, _, _ = rloo.token_loss(logprobs.detach(), old, torch.tensor([[1.0]]), MASK, options(0.2, 0.2, True, 3.0))
    torch.testing.assert_close(positive, torch.full((1, 3), -1.2))  # A > 0: only the usual clip


@per_script
def test_cispo_weight_is_clipped_and_stop_gradient():
    logprobs = current_logprobs()
    loss, log_ratio, _ = rloo.cispo_loss(logprobs, OLD, torch.tensor([[2.0]]), MASK, options(0.2, 0.3))
    torch.testing.assert_close(log_ratio.exp(), RATIOS)  # unclipped: the clip metrics see the ratio itself
    weight = torch.tensor([[1.3, 0.8, 1.1]])  # clip(r, 0.8, 1.3)
    torch.testing.assert_close(loss.detach(), -weight * 2.0 * logprobs.detach())
    loss.sum().backward()
    # Only log p carries a gradient: -sg(w) A. Without the stop-gradient the middle term would add -A w log p.
    torch.testing.assert_close(logprobs.grad, -weight * 2.0)


@per_script
def test_gspo_token_form_has_the_gradient_of_the_sequence_ratio():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.7, 0.0, 0.0]]).requires_grad_()
    old = torch.tensor([[-1.1, -1.9, -0.45, 0.0], [-0.3, -0.6, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    advantages = torch.tensor([1.5, -0.5])
    token_loss, log_s, _ = rloo.gspo_loss(logprobs, old, advantages[:, None], mask, options(0.2, 0.2))
    loss = (token_loss * mask).sum(1) / mask.sum(1)  # GSPO averages over the tokens of a sequence
    # The value: s_i = exp(mean_t (log p - log p_old)) for every token of sequence i: exp((0.1 - 0.1 - 0.05) / 3) and
    # exp((0 - 0.1) / 2)
    s = torch.tensor([0.9834715, 0.9512294])
    torch.testing.assert_close(token_loss.detach(), (-advantages * s)[:, None].expand(2, 4))
    torch.testing.assert_close(log_s.exp(), s)  # one ratio per sequence
    loss.sum().backward()
    # The gradient is that of the sequence-level objective -A s_i, with s_i a function of the log-probs.
    direct = logprobs.detach().clone().requires_grad_()
    (-advantages * torch.exp(((direct - old) * mask).sum(1) / mask.sum(1))).sum().backward()
    torch.testing.assert_close(logprobs.grad * mask, direct.grad * mask)
    torch.testing.assert_close(logprobs.grad * mask, (-advantages * s / mask.sum(1))[:, None] * mask)


@per_script
def test_gspo_clips_the_whole_sequence():
    logprobs = torch.tensor([[0.2, 0.4]], requires_grad=True)  # s = exp(0.3) > 1 + 0.2: clipped for A > 0
    loss, _, _ = rloo.gspo_loss(logprobs, torch.zeros(1, 2), torch.tensor([[1.0]]), torch.ones(1, 2), options(0.2, 0.2))
    torch.testing.assert_close(loss.detach(), torch.full((1, 2), -1.2))
    loss.sum().backward()
    assert (logprobs.grad == 0).all()


@per_script
def test_sapo_gate_by_hand_and_its_gradient():
    # sigmoid(tau (r - 1)) at the ratios 1.5, 0.5, 1.1: tau 1 for A > 0, 1.05 for A <= 0
    sigmoids = {1.0: [0.622459, 0.377541, 0.524979], 1.05: [0.628316, 0.371684, 0.526226]}
    gates = {1.0: [2.489837, 1.510163, 2.099917], 1.05: [2.393585, 1.415938, 2.004670]}  # 4 / tau times those
    for advantage, tau in [(2.0, 1.0), (-2.0, 1.05)]:
        logprobs = current_logprobs()
        loss, log_ratio, stats = rloo.sapo_loss(logprobs, OLD, torch.tensor([[advantage]]), MASK, SAPO)
        gate = stats["sapo/gate_mean"]
        torch.testing.assert_close(log_ratio.exp(), RATIOS)
        sig = torch.tensor([sigmoids[tau]])
        torch.testing.assert_close(gate, torch.tensor([gates[tau]]))
        torch.testing.assert_close(loss.detach(), -advantage * sig * 4 / tau)
        loss.sum().backward()
        # d gate / d r = 4 sig (1 - sig), d r / d log p = r
        torch.testing.assert_close(logprobs.grad, -advantage * 4 * sig * (1 - sig) * RATIOS)
    on_policy = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _, _ = rloo.sapo_loss(on_policy, on_policy.detach(), torch.tensor([[3.0]]), torch.ones(1, 2), SAPO)
    loss.sum().backward()
    torch.testing.assert_close(on_policy.grad, torch.full((1, 2), -3.0))  # on-policy: the REINFORCE gradient


# ----------------------------------------------------------------------------------------------------------------
# Aggregation and the policy_loss the training loop calls
# ----------------------------------------------------------------------------------------------------------------
TOKEN_LOSS = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
TOKEN_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3) / 3),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 3) / 2),
        ("seq-mean-token-sum", (3 + 3) / 2),
        ("seq-mean-token-sum-norm", 6 / (2 * 3)),
    ],
)
@per_script
def test_aggregation_by_hand_and_over_micro_batches(mode, expected):
    whole = rloo.aggregate_loss(
        TOKEN_LOSS, TOKEN_MASK, mode, mini_batch_size=2, mini_batch_tokens=3, max_completion_length=3
    )
    assert whole.item() == pytest.approx(expected)
    shares = [rloo.aggregate_loss(TOKEN_LOSS[i : i + 1], TOKEN_MASK[i : i + 1], mode, 2, 3, 3) for i in range(2)]
    assert sum(shares).item() == pytest.approx(expected)  # gradient accumulation gives the minibatch's loss


@per_script
def test_default_loss_by_hand_over_the_rows_that_train():
    """The sequence loss (TRL's RLOO, rloo.py before the loss family): the sum over the rows that train of
    max(-A rho, -A clip(rho, 0.8, 1.2)), divided by the minibatch size, rho the ratio of summed log-probs; its gradient
    -A rho / 8 on every token of an unclipped row, 0 on a clipped one; its statistics count completions."""
    generator = torch.Generator().manual_seed(0)
    logprobs = (-3 * torch.rand(6, 5, generator=generator)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]] * 2, dtype=torch.float)
    ratios = torch.tensor([1.5, 0.5, 0.9, 1.1, 1.25, 1.0])  # each row's rho, put on its first token
    old = logprobs.detach().clone()
    old[:, 0] -= ratios.log()
    advantages = torch.tensor([2.0, -1.0, 1.0, -1.0, -2.0, 0.5])
    trains = torch.tensor([True, True, False, True, True, True])
    loss, stats = rloo.policy_loss(args_for(), logprobs, old, advantages[:, None].expand(6, 5), mask, trains, 8, None)
    # per row: max(-3, -2.4) = -2.4 (clipped), max(0.5, 0.8) = 0.8 (clipped), row 2 does not train, max(1.1, 1.1),
    # max(2.5, 2.4) = 2.5, max(-0.5, -0.5); (-2.4 + 0.8 + 1.1 + 2.5 - 0.5) / 8
    assert loss.item() == pytest.approx(1.5 / 8)
    (grad,) = torch.autograd.grad(loss, logprobs)
    per_row = torch.tensor([0.0, 0.0, 0.0, 1.1, 2.5, -0.5]) / 8  # -A rho / 8 where the unclipped term is the max
    torch.testing.assert_close(grad, per_row[:, None] * mask)
    assert stats.sums["units"].item() == 6 and stats.sums["clipped_high"].item() == 1  # row 0: rho > 1.2 with A > 0
    # 0.5 (log rho)^2 summed over the rows: ln 1.5, ln 0.5, ln 0.9, ln 1.1, ln 1.25, 0
    assert stats.sums["approxkl"].item() == pytest.approx(0.3574164, rel=1e-5)
    assert not stats.own and "dual_clipped" not in stats.sums


@pytest.mark.parametrize(
    "argv",
    [
        ["--loss_type", "token"],
        ["--loss_type", "token", "--ppo_clip"],
        ["--loss_type", "cispo"],
        ["--loss_type", "gspo"],
        ["--loss_type", "sapo"],
    ],
)
@per_script
def test_policy_loss_routes_each_loss_type_and_masks_rows_that_do_not_train(argv):
    args = args_for(*argv)
    logprobs = current_logprobs().expand(2, 3).clone().detach().requires_grad_()
    old, mask, advantages = OLD.expand(2, 3), torch.ones(2, 3), torch.tensor([1.0, 5.0])
    trains = torch.tensor([True, False])
    loss, stats = rloo.policy_loss(
        args, logprobs, old, advantages[:, None].expand(2, 3), mask, trains, 2, mask[:1].sum()
    )
    loss.backward()
    assert (logprobs.grad[1] == 0).all() and (logprobs.grad[0] != 0).any()  # the row that does not train adds nothing
    assert list(stats.own) == (["sapo/gate_mean"] if args.loss_type == "sapo" else [])
    assert stats.sums["units"].item() == (2 if args.loss_type == "gspo" else 6)  # gspo clips whole sequences
    torch.testing.assert_close(stats.sums["token_ratio"], (RATIOS.sum() * 2).reshape(()))


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--loss_type", "token"],
        ["--loss_type", "token", "--ppo_clip", "--dual_clip", "2"],
        ["--loss_type", "cispo"],
        ["--loss_type", "gspo"],
        ["--loss_type", "sapo"],
    ],
)
@per_script
def test_on_the_first_minibatch_every_loss_is_reinforce(argv):
    """Before the first optimizer step pi_old is pi (the detached log-probs): every ratio is exactly 1 and every loss
    has the gradient of -A log pi, aggregated its way (per completion for sequence and gspo, per token otherwise)."""
    args = args_for(*argv)
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask, advantages, trains = (
        torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        torch.tensor([1.5, -0.5]),
        torch.ones(2).bool(),
    )
    loss, stats = rloo.policy_loss(
        args, logprobs, logprobs.detach(), advantages[:, None].expand(2, 3), mask, trains, 2, mask.sum()
    )
    assert stats.sums["approxkl"] == 0 and stats.sums["clipped_low"] == 0 and stats.sums["clipped_high"] == 0
    loss.backward()
    per_token = {"sequence": 1 / 2, "token": 1 / 5, "cispo": 1 / 5, "sapo": 1 / 5}  # sum over sequences / 2; tokens / 5
    weight = (
        torch.tensor([[1 / 6], [1 / 4]]) if args.loss_type == "gspo" else per_token[args.loss_type]
    )  # seq-mean-token-mean
    torch.testing.assert_close(logprobs.grad, -advantages[:, None] * mask * weight)


@per_script
def test_loss_defaults():
    gspo = args_for("--loss_type", "gspo")
    assert (gspo.epsilon, gspo.epsilon_high, gspo.loss_aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert args_for("--loss_type", "gspo", "--epsilon", "0.01").epsilon_high == 0.01
    token = args_for("--loss_type", "token")
    assert (token.epsilon, token.epsilon_high, token.loss_aggregation) == (0.2, 0.2, "token-mean")
    sapo = args_for("--loss_type", "sapo")
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.0, 1.05)
    default = args_for()
    assert (default.loss_type, default.epsilon, default.epsilon_high, default.loss_aggregation) == (
        "sequence",
        0.2,
        0.2,
        None,
    )


# ----------------------------------------------------------------------------------------------------------------
# End to end: every estimator and every loss, two epochs of two minibatches so that the ratio leaves 1
# ----------------------------------------------------------------------------------------------------------------
RUNS = [
    ["--advantage_estimator", "grpo", "--loss_type", "token", "--ppo_clip", "--dual_clip", 2.0],
    ["--advantage_estimator", "dr_grpo", "--loss_type", "token", "--loss_aggregation", "seq-mean-token-sum-norm"],
    ["--advantage_estimator", "reinforce_pp", "--loss_type", "cispo", "--loss_aggregation", "seq-mean-token-sum"],
    ["--advantage_estimator", "rloo", "--loss_type", "gspo"],
    ["--advantage_estimator", "grpo", "--advantage_normalization", "batch", "--loss_type", "sapo"],
]


@pytest.mark.slow
@pytest.mark.parametrize("extra", RUNS, ids=[" ".join(map(str, r[1::2])) for r in RUNS])
def test_end_to_end(extra, tiny, prompts_file, tmp_path):
    proc = run_rloo(
        "--model_name_or_path",
        tiny["policy"],
        "--dataset_name",
        prompts_file,
        "--total_episodes",
        32,
        "--per_device_train_batch_size",
        8,
        "--max_completion_length",
        12,
        "--num_sample_generations",
        0,
        "--num_ppo_epochs",
        2,
        "--num_mini_batches",
        2,
        "--learning_rate",
        1e-3,
        "--reward_model_path",
        tiny["reward"],
        *extra,
        cwd=tmp_path,
    )  # a reward model: no ties
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    assert rows[0]["lr"] == pytest.approx(1e-3 * (8 + 7 + 6 + 5) / 32)  # the mean rate of the update's 4 steps, of 8
    for row in rows:
        assert row["val/ratio_var"] > 0 and row["policy/approxkl_avg"] > 0  # later minibatches are off-policy
        assert row["clip_ratio/region_mean"] == pytest.approx(row["clip_ratio/low_mean"] + row["clip_ratio/high_mean"])
        assert all(math.isfinite(row[k]) for k in ["loss/policy_avg", "val/ratio", "advantages/std"])
    loss_type = extra[extra.index("--loss_type") + 1]
    if loss_type == "gspo":  # the paper's clip range 3e-4 / 4e-4 on the sequence ratio does bite
        assert any(row["clip_ratio/region_mean"] > 0 for row in rows)
    if loss_type == "sapo":
        assert all(1.5 < row["sapo/gate_mean"] < 2.5 for row in rows)  # 2 / tau near the old policy
    else:
        assert "sapo/gate_mean" not in rows[0]
    assert ("clip_ratio/dual_mean" in rows[0]) == ("--dual_clip" in extra)
    if "reinforce_pp" in extra or "batch" in extra:  # whitened over the batch
        assert all(row["advantages/std"] == pytest.approx(1.0, abs=1e-2) for row in rows)


# ----------------------------------------------------------------------------------------------------------------
# Token-level KL (--token_level_kl)
# ----------------------------------------------------------------------------------------------------------------
def kl_before_of_the_loop(kl: torch.Tensor, beta: float, token_level_kl: bool = True) -> torch.Tensor:
    """kl_before as the training loop of the script under test computes it: main()'s own statement (found in its code,
    a call of kl_penalty_before) run here on kl in the script's namespace, so that what main passes is held too."""
    import ast
    import inspect
    import types

    (statement,) = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(rloo.main)))
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["kl_before"]
    ]
    code = compile(ast.Expression(statement.value), "main's kl_before", "eval")
    args = types.SimpleNamespace(beta=beta, token_level_kl=token_level_kl)
    return eval(code, vars(rloo), {"args": args, "kl": kl})


@per_script
def test_token_level_kl_charges_each_token_the_kl_penalties_from_it_on():
    """REINFORCE++ eq. 1: r_t = -beta kl_t, plus the score at the last token. Token t's return is what follows it,
    score - beta sum_{s>=t} kl_s, and its advantage that return minus the completion's baseline. The advantage stage
    as the loop runs it (its kl_before, kl_penalized_reward, compute_advantages) against numbers worked out by hand."""
    scores = torch.tensor([1.0, 3.0])  # one group of two completions
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.4, -0.2, 0.0, 0.0]])  # masked: row 1 has 2 tokens
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    trains = torch.ones(2, dtype=torch.bool)
    # beta times the KL of the tokens before each token: row 0 0, 0.1, 0.1 + 0.2; row 1 0, 0.4
    kl_before = kl_before_of_the_loop(kl, beta=0.5)
    torch.testing.assert_close(kl_before * mask, torch.tensor([[0.0, 0.05, 0.15, 0.0], [0.0, 0.2, 0.0, 0.0]]))
    assert torch.equal(kl_before_of_the_loop(kl, beta=0.5, token_level_kl=False), torch.zeros(2, 4))
    # The completion's reward: score - beta * its whole KL, 1 - 0.5 * 0.6 and 3 - 0.5 * 0.2, at either level
    rewards, non_score = rloo.kl_penalized_reward(scores, kl, mask, beta=0.5, token_level=True)
    torch.testing.assert_close(rewards, torch.tensor([0.7, 2.9]))
    torch.testing.assert_close(non_score, torch.tensor([-0.3, -0.1]))
    torch.testing.assert_close(rloo.kl_penalized_reward(scores, kl, mask, 0.5, token_level=False)[0], rewards)
    # The baseline of each completion is its sibling's whole reward: A = 0.7 - 2.9 = -2.2 and 2.2. Token t's advantage
    # is its return minus it: row 0, 1 - 0.5 * (0.6, 0.5, 0.3) - 2.9; row 1, 3 - 0.5 * (0.2, -0.2) - 0.7.
    per_token = rloo.compute_advantages(rewards, kl_before, trains, 2, "rloo", "none")
    by_hand = torch.tensor([[-2.2, -2.15, -2.05, 0.0], [2.2, 2.4, 0.0, 0.0]])
    torch.testing.assert_close(per_token * mask, by_hand)
    # Without the flag every token carries the completion's advantage, the first token's with it (it is charged all)
    advantages = rloo.compute_advantages(rewards, kl_before_of_the_loop(kl, 0.5, False), trains, 2, "rloo", "none")
    torch.testing.assert_close(advantages, torch.tensor([[-2.2] * 4, [2.2] * 4]))
    # With a divisor the KL part is divided too: the group's std of 0.7 and 2.9 is 2.2 / sqrt(2)
    scaled = rloo.compute_advantages(rewards, kl_before, trains, 2, "rloo", "group")
    torch.testing.assert_close(scaled * mask, by_hand / (2.2 / math.sqrt(2) + 1e-4))
    none_train = rloo.compute_advantages(rewards, kl_before, torch.tensor([True, False]), 2, "rloo", "none")
    torch.testing.assert_close(none_train * mask, torch.tensor([[-2.2, -2.15, -2.05, 0.0], [0.0] * 4]))


@per_script
@pytest.mark.parametrize("loss_type", ["token", "cispo", "sapo"])
def test_token_level_kl_changes_the_gradient_of_token_losses_only(loss_type):
    kl = torch.tensor([[0.3, 0.6, 0.9], [0.2, 0.2, 0.0]])
    mask, trains = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]), torch.ones(2, dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0])
    rewards = torch.tensor([1.0, 0.0])  # one group: the leave-one-out advantages 1 and -1
    grads = {}
    for token_level_kl in [False, True]:
        for args in [args_for("--loss_type", loss_type), args_for()]:
            logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
            kl_before = kl_before_of_the_loop(kl, beta=1.0, token_level_kl=token_level_kl)  # the loop's
            per_token = rloo.compute_advantages(rewards, kl_before, trains, 2, "rloo", "none")  # A_t, unscaled
            loss, _ = rloo.policy_loss(args, logprobs, logprobs.detach(), per_token, mask, trains, 2, mask.sum())
            (grads[token_level_kl, args.loss_type],) = torch.autograd.grad(loss, logprobs)
    # On-policy, a token loss has the gradient -A_t / tokens: A_t = A + beta * (KL of the tokens before t)
    expected = -(advantages[:, None] + torch.tensor([[0.0, 0.3, 0.9], [0.0, 0.2, 0.4]])) * mask / 5
    torch.testing.assert_close(grads[True, loss_type], expected)
    assert not torch.allclose(grads[True, loss_type], grads[False, loss_type])
    assert torch.equal(grads[True, "sequence"], grads[False, "sequence"])  # one action: the full KL either way
