"""Each formula of rloo.py against values computed by hand."""

import math
import types

import pytest
import torch

import rloo
from rloo_utils import logs
from rloo_utils.data import load_prompt_dataset
from rloo_utils.errors import UsageError
from rloo_utils.checks import batch_sizes
from rloo_utils.rewards import (
    whiten_nan,
    BUILTIN_REWARD_FUNCS,
    call_reward_funcs,
    load_reward_func,
    vader_sentiment,
    weighted_reward,
)
from rloo_utils.scoring import reward_model_inputs, reward_model_scores
from rloo_utils.generation import end_token_ids, tokenize_prompts
import rloo_utils.packing as packing_module
from rloo_utils.packing import logprobs_through_output_layer
from rloo_utils.rollouts import completion_mask_from

pytestmark = pytest.mark.usefixtures("each_script")  # every test runs against every script that has the function


# ----------------------------------------------------------------------------------------------------------------
# Leave-one-out advantages
# ----------------------------------------------------------------------------------------------------------------
def test_rloo_advantages_match_the_trl_seed_example():
    # The seed lists rewards in (k, B) layout: 3 prompts x 4 completions, completion j of prompt i at j * 3 + i.
    seed_layout = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=torch.float)
    grouped = seed_layout.view(4, 3).T.reshape(-1)  # our layout: the 4 completions of a prompt are adjacent
    advantages = rloo.rloo_advantages(grouped, num_generations=4)
    # A[0] of the seed: first completion of the first prompt; A[7]: third completion of the second prompt.
    assert advantages[0 * 4 + 0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)
    assert advantages[1 * 4 + 2].item() == pytest.approx(6 - (3 + 2 + 9) / 3)
    # Every entry against the seed's loop, and the identity A = G/(G-1) (r - mean).
    for i in range(12):
        group = grouped[i // 4 * 4 : i // 4 * 4 + 4]
        others = torch.cat([group[: i % 4], group[i % 4 + 1 :]])
        assert advantages[i].item() == pytest.approx(grouped[i].item() - others.mean().item())
    torch.testing.assert_close(
        advantages.view(3, 4), (grouped.view(3, 4) - grouped.view(3, 4).mean(1, keepdim=True)) * 4 / 3
    )


def test_rloo_advantages_with_none_rewards_ignore_the_unscorable_sibling():
    rewards = torch.tensor(
        [
            1.0,
            math.nan,
            3.0,
            5.0,  # one completion not scorable
            2.0,
            math.nan,
            math.nan,
            math.nan,  # no scorable sibling: no baseline, no signal
            4.0,
            6.0,
            4.0,
            6.0,
        ]
    )
    advantages = rloo.rloo_advantages(rewards, num_generations=4)
    expected = [
        1 - (3 + 5) / 2,
        0.0,
        3 - (1 + 5) / 2,
        5 - (1 + 3) / 2,
        0.0,
        0.0,
        0.0,
        0.0,
        4 - 16 / 3,
        6 - 14 / 3,
        4 - 16 / 3,
        6 - 14 / 3,
    ]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    # The old TRL bug: None collapsed to 0 would have given the first completion 1 - (0 + 3 + 5) / 3.
    assert advantages[0].item() != pytest.approx(1 - 8 / 3)


def test_whiten_over_batch_only_over_rows_that_train():
    advantages = torch.tensor([1.0, -1.0, 3.0, 0.0])
    valid = torch.tensor([True, True, True, False])
    out, divisor = rloo.whiten_over_batch(advantages, valid)
    # the three rows that train: mean 1, sample std sqrt((0 + 4 + 4) / 2) = 2
    torch.testing.assert_close(out[:3], torch.tensor([0.0, -2.0, 2.0]) / 2.0001)
    assert out[3] == 0 and divisor.item() == pytest.approx(2.0001)


# ----------------------------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------------------------
def test_weighted_reward_is_nan_aware():
    per_func = torch.tensor([[1.0, 2.0], [math.nan, 4.0], [math.nan, math.nan]])
    out = weighted_reward(per_func, torch.tensor([0.5, 2.0]))
    assert out[0].item() == pytest.approx(0.5 + 4.0)
    assert out[1].item() == pytest.approx(8.0)
    assert out[2].isnan()


def test_whiten_nan_keeps_nan_rows_and_uses_the_others():
    x = torch.tensor([1.0, 2.0, math.nan, 3.0])
    out = whiten_nan(x, eps=0.0)
    torch.testing.assert_close(out[[0, 1, 3]], torch.tensor([-1.0, 0.0, 1.0]))
    assert out[2].isnan()


def test_call_reward_func_turns_none_into_nan_and_checks_values():
    out = call_reward_funcs([lambda completions, **kw: [1, None, 2.5]], ["f"], 3, None, completions=["a", "b", "c"])[0]
    assert out[0] == 1 and out[1].isnan() and out[2] == 2.5
    with pytest.raises(UsageError, match="reward function f returned nan at index 0"):
        call_reward_funcs([lambda **kw: [math.nan]], ["f"], 1, None)[0]
    with pytest.raises(UsageError, match="returned 'x'"):
        call_reward_funcs([lambda **kw: ["x"]], ["f"], 1, None)[0]
    with pytest.raises(UsageError, match="list of 2 floats"):
        call_reward_funcs([lambda **kw: [1.0]], ["f"], 2, None)[0]
    with pytest.raises(UsageError, match="f raised ZeroDivisionError"):
        call_reward_funcs([lambda **kw: [1 / 0]], ["f"], 1, None)[0]


def test_vader_sentiment_reads_plain_and_conversational_completions():
    plain = vader_sentiment(["What a wonderful, joyful film.", "A dreadful, boring mess."])
    chat = vader_sentiment([[{"role": "assistant", "content": "What a wonderful, joyful film."}]])
    assert plain[0] > 0.5 and plain[1] < -0.5
    assert chat[0] == plain[0]


def test_load_reward_func_by_name_module_and_file(tmp_path):
    assert load_reward_func("vader_sentiment", BUILTIN_REWARD_FUNCS) is vader_sentiment
    assert load_reward_func("math:sqrt", {})(4) == 2
    file = tmp_path / "my_rewards.py"
    file.write_text("def shout(completions, **kw):\n    return [float(c.count('!')) for c in completions]\n")
    assert load_reward_func(f"{file}:shout", {})(completions=["a!!"]) == [2.0]
    with pytest.raises(UsageError, match="unknown reward function 'nope'"):
        load_reward_func("nope", BUILTIN_REWARD_FUNCS)
    with pytest.raises(UsageError, match="has no function 'missing'"):
        load_reward_func(f"{file}:missing", {})


# ----------------------------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(rloo.per_token_kl(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    # k3 = exp(-d) + d - 1 at d = 0.5 and -1: exp(-0.5) - 0.5 and e - 2
    torch.testing.assert_close(rloo.per_token_kl(logp, ref, "k3"), torch.tensor([[0.1065307, 0.7182818]]))
    assert (rloo.per_token_kl(logp, ref, "k3") >= 0).all()


def test_only_k1_in_the_reward_has_the_gradient_of_the_kl():
    """The KL penalty is folded into a detached reward, so it reaches the policy as REINFORCE does: E_pi[k(y) grad log
    pi(y)]. On an exact categorical, for k1 that is grad KL(pi || ref); for k3 it is not, though both values are unbiased
    (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL")."""
    torch.manual_seed(0)
    theta = torch.randn(6, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6), 0)
    logp = torch.log_softmax(theta, 0)
    kl = (logp.exp() * (logp - ref)).sum()
    (kl_grad,) = torch.autograd.grad(kl, theta, retain_graph=True)
    grads = {}
    for estimator in ["k1", "k3"]:
        k = rloo.per_token_kl(logp.detach(), ref, estimator)  # the per-token KL of each outcome, as rloo.py computes it
        assert (logp.exp() * k).sum().item() == pytest.approx(kl.item(), abs=1e-6)  # its expectation is the KL
        (grads[estimator],) = torch.autograd.grad((logp.exp().detach() * k * logp).sum(), theta, retain_graph=True)
    torch.testing.assert_close(grads["k1"], kl_grad)
    assert (grads["k3"] - kl_grad).norm() > 0.5 * kl_grad.norm()


def test_token_level_and_sequence_level_kl_give_the_same_reward():
    scores = torch.tensor([2.0, -1.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    seq, seq_penalty = rloo.kl_penalized_reward(scores, kl, mask, beta=0.5, token_level=False)
    tok, tok_penalty = rloo.kl_penalized_reward(scores, kl, mask, beta=0.5, token_level=True)
    torch.testing.assert_close(seq, torch.tensor([2.0 - 0.5 * 0.6, -1.0 - 0.5 * 0.4]))
    torch.testing.assert_close(tok, seq)
    torch.testing.assert_close(tok_penalty, seq_penalty)


# ----------------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------------
def test_sequence_loss_is_the_clipped_surrogate_by_hand_with_its_gradient():
    ratios = torch.tensor([1.5, 0.5, 0.9, 1.1, 1.25])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    clip, ones = types.SimpleNamespace(epsilon=0.2, epsilon_high=0.3), torch.ones(5, 1)  # one token a completion
    logprob_sum = ratios.log().requires_grad_()
    loss, log_ratio, _ = rloo.sequence_loss(logprob_sum[:, None], torch.zeros(5, 1), advantages[:, None], ones, clip)
    torch.testing.assert_close(log_ratio, ratios.log())  # the ratio the clip metrics see
    # A > 0, rho 1.5 > 1 + 0.3: clipped at 1.3; A < 0, rho 0.5 < 0.8: clipped at 0.8; inside: -A rho.
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.3, 0.8, -0.9, 1.1, -1.25]))
    low, high = logs.clipped_units(ratios, advantages, 0.2, 0.3)
    assert low.tolist() == [False, True, False, False, False] and high.tolist() == [True, False, False, False, False]
    loss.sum().backward()
    # d(-A rho)/d(log rho) = -A rho where unclipped; zero where the clipped branch is active.
    torch.testing.assert_close(logprob_sum.grad, torch.tensor([0.0, 0.0, -0.9, 1.1, -1.25]))


def test_on_policy_ratio_is_exactly_one_and_the_loss_is_reinforce():
    logprob_sum = torch.tensor([-3.0, -7.0], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    clip = types.SimpleNamespace(epsilon=0.2, epsilon_high=0.2)
    loss, _, _ = rloo.sequence_loss(
        logprob_sum[:, None], logprob_sum.detach()[:, None], advantages[:, None], torch.ones(2, 1), clip
    )
    assert torch.exp(logprob_sum - logprob_sum.detach()).tolist() == [1.0, 1.0]
    loss.sum().backward()
    torch.testing.assert_close(logprob_sum.grad, -advantages)  # the gradient of -A log pi


# ----------------------------------------------------------------------------------------------------------------
# The entropy bonus (--entropy_coef)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, bonus, token_gradients",
    [
        # the sequence loss: each completion's entropies summed, over the minibatch's 4 completions: 0.1 x 3.5 / 4
        ({"loss_type": "sequence"}, 0.0875, [[-0.025, -0.025], [-0.025, 0.0]]),
        # token-mean: over the minibatch's 5 tokens (2 of them in another micro-batch): 0.1 x 3.5 / 5
        ({"loss_type": "token"}, 0.07, [[-0.02, -0.02], [-0.02, 0.0]]),
        # each completion's mean, over the 4 completions: 0.1 x (1.5 + 0.5) / 4
        ({"loss_type": "token", "loss_aggregation": "seq-mean-token-mean"}, 0.05, [[-0.0125, -0.0125], [-0.025, 0.0]]),
    ],
)
def test_the_entropy_bonus_and_its_gradient_by_hand(options, bonus, token_gradients):
    """A micro-batch of 3 completions of a minibatch of 4 (5 tokens in the loss): 2 tokens with entropies 1 and 2, 1
    token with entropy 0.5, and one completion out of the loss (unscored). Advantages 0 and the sampling policy's
    log-probs: the loss is the bonus alone, -0.1 x the entropies aggregated as the loss is."""
    import tyro
    from rloo_utils.checks import check_args

    flags = [f"--{k}={v}" for k, v in options.items()]
    args = rloo.resolve_defaults(tyro.cli(rloo.Args, args=[*flags, "--entropy_coef", "0.1"], use_underscores=True))
    check_args(args)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    in_loss = torch.tensor([True, True, False])
    entropy = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 0.0], [4.0, 4.0, 4.0]], requires_grad=True)
    logprobs = torch.full((3, 3), -1.0) * mask
    loss, stats = rloo.policy_loss(
        args, logprobs, logprobs, torch.zeros(3, 3), mask, in_loss, 4, torch.tensor(5.0), entropy
    )
    assert loss.item() == pytest.approx(-bonus)
    assert stats.sums["entropy_bonus"].item() == pytest.approx(bonus)
    (gradient,) = torch.autograd.grad(loss, entropy)
    expected = torch.zeros(3, 3)
    expected[:2, :2] = torch.tensor(token_gradients)
    torch.testing.assert_close(gradient, expected)
    # no coefficient: no bonus, no statistic
    args.entropy_coef = 0.0
    loss, stats = rloo.policy_loss(args, logprobs, logprobs, torch.zeros(3, 3), mask, in_loss, 4, torch.tensor(5.0))
    assert loss.item() == 0.0 and "entropy_bonus" not in stats.sums


@pytest.mark.parametrize("fused", [False, True])
def test_the_entropy_s_gradient_through_the_output_layer_by_hand(fused):
    """Two words, logits (ln 3, 0): p = (3/4, 1/4), H = ln 4 - (3/4) ln 3 = 0.562335, and dH/dz = -p (log p + H) =
    (-0.75 x (ln 0.75 + 0.562335), -0.25 x (ln 0.25 + 0.562335)) = (-0.205990, 0.205990); by checkpointed chunks and
    by the fused function, whose backward writes this derivative itself."""
    layer = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(2))  # the logits are the hidden state
    hidden = torch.tensor([[math.log(3), 0.0]], requires_grad=True)
    logprobs, entropy = logprobs_through_output_layer(
        layer, lambda x: x, hidden, torch.tensor([0]), 1.0, with_entropy=True, fused=fused, entropy_grad=True
    )
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)
    (gradient,) = torch.autograd.grad(entropy.sum(), hidden)
    torch.testing.assert_close(gradient, torch.tensor([[-0.205990, 0.205990]]), atol=1e-6, rtol=0)
    # with the log-prob's: d log p_0 / dz = onehot(0) - p = (0.25, -0.25), plus the entropy's
    logprobs, entropy = logprobs_through_output_layer(
        layer, lambda x: x, hidden, torch.tensor([0]), 1.0, with_entropy=True, fused=fused, entropy_grad=True
    )
    (gradient,) = torch.autograd.grad((logprobs + 2 * entropy).sum(), hidden)
    torch.testing.assert_close(gradient, torch.tensor([[0.25 - 0.411980, -0.25 + 0.411980]]), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Log-probs, entropy, masks
# ----------------------------------------------------------------------------------------------------------------
def plain_logprobs_and_entropy(layer, transform, hidden, ids, temperature):
    """log softmax(transform(layer(hidden)) / T)[ids] and the entropy, from the whole (K, V) logits."""
    logprobs = torch.log_softmax(transform(layer(hidden)).float() / temperature, -1)
    return logprobs.gather(-1, ids[:, None]).squeeze(-1), -(logprobs.exp() * logprobs).sum(-1)


@pytest.mark.parametrize("chunk_elements", [2**24, 7, 3 * 7])  # one chunk; a chunk per position; 3 positions a chunk
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_logprobs_through_the_output_layer_by_hand_in_chunks(monkeypatch, chunk_elements, soft_cap):
    """The log-probs, entropies and gradients (of the hidden states and the output layer) made a chunk of positions at
    a time equal those of the whole (K, V) logits; a transform after the output layer (Gemma's soft cap) is applied."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 7, bias=False)
    transform = (lambda x: soft_cap * torch.tanh(x / soft_cap)) if soft_cap else (lambda x: x)
    hidden = torch.randn(8, 5, requires_grad=True)
    ids = torch.randint(7, (8,))
    weights = torch.randn(8)
    out, entropy = logprobs_through_output_layer(layer, transform, hidden, ids, 0.7, with_entropy=True)
    expected, expected_entropy = plain_logprobs_and_entropy(layer, transform, hidden, ids, 0.7)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(entropy, expected_entropy.detach())
    assert not entropy.requires_grad  # without entropy_grad the entropy is logged, not trained
    # The gradient, the chunks' logits made again in the backward pass, is the plain one, for both inputs.
    got = torch.autograd.grad((out * weights).sum(), [hidden, layer.weight])
    want = torch.autograd.grad((expected * weights).sum(), [hidden, layer.weight])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # By hand: a uniform distribution has entropy log V; a peaked one 0
    zero = torch.nn.Linear(5, 7, bias=False)
    torch.nn.init.zeros_(zero.weight)
    identity = lambda x: x  # noqa: E731
    _, uniform = logprobs_through_output_layer(zero, identity, torch.randn(2, 5), torch.tensor([0, 1]), 1.0, True)
    torch.testing.assert_close(uniform, torch.full((2,), math.log(7)))
    with torch.no_grad():
        zero.weight[3, 0] = 100.0
    one_hot = torch.tensor([[1.0, 0, 0, 0, 0]])
    _, peaked = logprobs_through_output_layer(zero, identity, one_hot, torch.tensor([3]), 1.0, True)
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)
    # No position: empty log-probs, and a backward that reaches nothing
    empty = logprobs_through_output_layer(layer, transform, hidden[:0], ids[:0], 1.0)
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_log_probs_keep_no_vocabulary_sized_tensor_for_the_backward_pass(monkeypatch):
    """What autograd saves for the backward pass of the log-probs: the (K, H) hidden states and the output layer's
    weight, never a (K, V) tensor of logits, bf16 or fp32 (with a 150k vocabulary and 8k tokens that is gigabytes); the
    gradient under bf16 autocast is the plain one up to bf16 rounding."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", 2 * 50)  # two positions per chunk
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(24, 16, requires_grad=True)
    ids = torch.randint(50, (24,))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        out = logprobs_through_output_layer(layer, lambda x: x, hidden, ids, 0.9)
    assert out.dtype == torch.float32
    assert all(50 not in shape or shape == (50, 16) for shape in saved), saved  # the weight (V, H); no chunk's (2, V)
    (grad,) = torch.autograd.grad(out.sum(), hidden)
    with torch.autocast("cpu", torch.bfloat16):
        expected, _ = plain_logprobs_and_entropy(layer, lambda x: x, hidden, ids, 0.9)
    (expected_grad,) = torch.autograd.grad(expected.sum(), hidden)
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(grad, expected_grad, atol=1e-2, rtol=1e-2)


def test_completion_mask_keeps_the_first_stop_token_and_nothing_after():
    eos, stop, pad = 2, 9, 0
    ids = torch.tensor([[5, 6, eos, pad, pad], [5, stop, 7, eos, pad], [5, 6, 7, 8, 4]])
    mask, ended = completion_mask_from(ids, [eos, stop], [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert ended.tolist() == [True, True, False]
    # --ignore_eos: EOS does not stop a completion, but one that holds an EOS has ended (old TRL's missing-EOS test)
    mask, ended = completion_mask_from(ids, [stop], [eos])
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert ended.tolist() == [True, True, False]
    mask, ended = completion_mask_from(ids, [], [eos])
    assert mask.all() and ended.tolist() == [True, True, False]


def test_end_tokens_are_every_eos_the_model_declares(tiny):
    tok = tiny["tokenizer"]  # eos <|im_end|>
    eos = tok.eos_token_id
    assert end_token_ids(tok, None, None, False) == ([eos], [eos])
    assert end_token_ids(tok, eos, None, False) == ([eos], [eos])
    assert end_token_ids(tok, [7, eos, 0], 9, False) == (
        sorted({0, 7, eos}),
        sorted({0, 7, eos, 9}),
    )  # Llama 3, Qwen
    assert end_token_ids(tok, [7], 9, True) == (sorted({7, eos}), [9])  # --ignore_eos: only --stop_token_id stops


def test_entropy_metric_only_counts_real_tokens(tiny):
    """The logged entropy is the token-weighted mean over the completion mask, not over padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    prompt_ids = torch.tensor([[5, 6, 7]])
    completion_ids = torch.tensor([[8, 9, 10, 11]])
    full = torch.ones(1, 4, dtype=torch.long)
    half = torch.tensor([[1, 1, 0, 0]])
    _, ent_full = rloo.completion_logprobs(
        model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, full, 1.0, True
    )
    _, ent_half = rloo.completion_logprobs(
        model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, half, 1.0, True
    )
    torch.testing.assert_close(ent_half[:, :2], ent_full[:, :2])
    assert (ent_half[:, 2:] == 0).all()  # masked columns carry no entropy


def test_completion_logprobs_match_a_plain_forward_and_ignore_left_padding(tiny):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    pad = tiny["tokenizer"].pad_token_id
    prompt = torch.tensor([[11, 12, 13, 14]])
    completion = torch.tensor([[20, 21, 22]])
    # Reference: one unpadded sequence, log softmax of logits / T at the positions that predict the completion.
    logits = model(torch.cat([prompt, completion], 1)).logits[:, 3:-1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)
    # The same prompt left-padded in a batch next to a longer one, the completion right-padded.
    prompt_ids = torch.tensor([[pad, pad, 11, 12, 13, 14], [1, 2, 3, 4, 5, 6]])
    prompt_mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    completion_ids = torch.tensor([[20, 21, 22, pad], [7, 8, 9, 10]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with torch.no_grad():
        out = rloo.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)
    torch.testing.assert_close(out[0, :3], expected[0].detach(), atol=1e-5, rtol=1e-5)


def test_reward_model_scores_read_the_last_real_token(tiny):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny["reward"], num_labels=1).eval()
    pad = tiny["tokenizer"].pad_token_id
    ids = torch.tensor([[pad, 11, 12, 13, pad, pad], [11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    scores = reward_model_scores(rm, ids, mask)
    with torch.no_grad():
        alone = rm.score(rm.model(torch.tensor([[11, 12, 13]])).last_hidden_state[:, -1]).squeeze()
    assert scores[0].item() == pytest.approx(alone.item(), abs=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Data and schedule
# ----------------------------------------------------------------------------------------------------------------
def test_tokenize_prompts_left_pads_and_left_truncates(tiny):
    tok = tiny["tokenizer"]
    long_text, short_text = "the movie was good and the plot was great", "the film"
    ids, mask, truncated, images = tokenize_prompts(tok, [long_text, short_text], 4, "cpu")
    assert images is None  # text prompts carry no image tensors
    full = tok(long_text, add_special_tokens=False)["input_ids"]
    assert truncated == 1 and ids.shape[1] == 4
    assert ids[0].tolist() == full[-4:]  # the end of the prompt is kept
    short = tok(short_text, add_special_tokens=False)["input_ids"]
    assert mask[1].tolist() == [0] * (4 - len(short)) + [1] * len(short)


def with_bos(tokenizer):
    """A copy of the tokenizer that adds its BOS to every text it encodes, as Llama's does."""
    from tokenizers import processors

    tokenizer = __import__("copy").deepcopy(tokenizer)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)]
    )
    return tokenizer


def test_plain_prompts_get_the_bos_and_chat_prompts_get_it_once(tiny):
    tok = with_bos(tiny["tokenizer"])  # BOS is <|im_start|>, which the chat template also opens every message with
    bos, text = tok.bos_token_id, "the movie was good"
    assert tok(text)["input_ids"][0] == bos
    ids, mask, _, _ = tokenize_prompts(tok, [text], 64, "cpu")
    assert ids[0].tolist() == [bos] + tok(text, add_special_tokens=False)["input_ids"]
    chat = [{"role": "user", "content": text}]
    ids, _, _, _ = tokenize_prompts(tok, [chat], 64, "cpu")
    templated = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ids[0].tolist() == tok(templated, add_special_tokens=False)["input_ids"] and ids[0, 1] != bos
    # Truncated from the left, a prompt keeps its BOS and its last tokens.
    ids, _, truncated, _ = tokenize_prompts(tok, ["the movie was good and the plot was great"], 4, "cpu")
    assert (
        truncated == 1
        and ids[0].tolist()
        == [bos] + tok("the movie was good and the plot was great", add_special_tokens=False)["input_ids"][-3:]
    )


def test_reward_model_inputs_in_its_own_tokens(tiny):
    """A reward model with a tokenizer of its own reads the decoded text: its chat template for conversations; for plain
    text its special tokens and its EOS after a completion that ended, where the policy's ids would have theirs."""
    tok = with_bos(tiny["tokenizer"])
    eos = tok.eos_token_id
    ids, mask = reward_model_inputs(tok, ["the movie", "the film"], [" was good", " was"], torch.tensor([True, False]))
    ended = tok("the movie was good")["input_ids"] + [eos]
    truncated = tok("the film was")["input_ids"]
    assert ids[0].tolist() == ended and ids[1, -len(truncated) :].tolist() == truncated
    assert mask.sum(1).tolist() == [len(ended), len(truncated)]  # left-padded
    chat = [{"role": "user", "content": "the movie"}]
    ids, _ = reward_model_inputs(tok, [chat], ["was good"], torch.tensor([True]))
    text = tok.apply_chat_template(chat + [{"role": "assistant", "content": "was good"}], tokenize=False)
    assert ids[0].tolist() == tok(text, add_special_tokens=False)["input_ids"]


def test_dataset_folder_gives_one_split_per_file(tmp_path):
    from conftest import write_jsonl

    write_jsonl(str(tmp_path / "descriptiveness.jsonl"), [{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}])
    write_jsonl(str(tmp_path / "test.jsonl"), [{"prompt": "c", "x": 3}])
    assert load_prompt_dataset(str(tmp_path), "descriptiveness")["prompt"] == ["a", "b"]
    assert load_prompt_dataset(str(tmp_path), "test")["x"] == [3]
    assert load_prompt_dataset(str(tmp_path), "validation") is None


def test_lr_schedules_after_a_warmup_of_steps_or_of_a_fraction_of_them():
    def rates(kind, steps, warmup_steps=2, **kwargs):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        args = rloo.Args(lr_scheduler_type=kind, warmup_steps=warmup_steps, lr_scheduler_kwargs=kwargs or None)
        scheduler = args.lr_scheduler(optimizer, total_steps=6)
        rates = []
        for _ in range(steps):
            rates.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return rates

    assert rates("linear", 7) == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert rates("constant", 4) == [0.0, 0.5, 1.0, 1.0]
    # half a cosine from the peak to 0 after the warm-up: 1 at step 2, 0.5 half-way (step 4), 0 at the end
    cosine = rates("cosine", 7)
    assert cosine[:3] == [0.0, 0.5, 1.0] and cosine[4] == pytest.approx(0.5) and cosine[6] == pytest.approx(0.0)
    # the same curve squeezed into [min_lr_rate, 1]
    floor = rates("cosine_with_min_lr", 7, min_lr_rate=0.1)
    assert floor[2:] == pytest.approx([0.1 + 0.9 * c for c in cosine[2:]])
    # below 1, --warmup_steps is a fraction of all optimizer steps, rounded up as transformers does: ceil(0.25 * 6) = 2
    assert rates("linear", 7, warmup_steps=0.25) == rates("linear", 7, warmup_steps=2)
    assert rates("linear", 3, warmup_steps=0.5) == [0.0, 1 / 3, 2 / 3]


def test_batch_semantics_follow_old_trl():
    sizes = dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2, total_episodes=100)
    assert batch_sizes(**sizes) == (24, 12, 4)
    assert batch_sizes(**sizes, world_size=2) == (48, 24, 2)  # the per-device sizes on each of 2 processes
