"""Each formula of rloo.py against values computed by hand."""

import math

import pytest
import torch

import rloo


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
        group = grouped[i // 4 * 4: i // 4 * 4 + 4]
        others = torch.cat([group[: i % 4], group[i % 4 + 1:]])
        assert advantages[i].item() == pytest.approx(grouped[i].item() - others.mean().item())
    torch.testing.assert_close(advantages.view(3, 4), (grouped.view(3, 4) - grouped.view(3, 4).mean(1, keepdim=True)) * 4 / 3)


def test_rloo_advantages_with_none_rewards_ignore_the_unscorable_sibling():
    rewards = torch.tensor([1.0, math.nan, 3.0, 5.0,   # one completion not scorable
                            2.0, math.nan, math.nan, math.nan,  # no scorable sibling: no baseline, no signal
                            4.0, 6.0, 4.0, 6.0])
    advantages = rloo.rloo_advantages(rewards, num_generations=4)
    expected = [1 - (3 + 5) / 2, 0.0, 3 - (1 + 5) / 2, 5 - (1 + 3) / 2,
                0.0, 0.0, 0.0, 0.0,
                4 - 16 / 3, 6 - 14 / 3, 4 - 16 / 3, 6 - 14 / 3]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    # The old TRL bug: None collapsed to 0 would have given the first completion 1 - (0 + 3 + 5) / 3.
    assert advantages[0].item() != pytest.approx(1 - 8 / 3)


def test_normalize_advantages_only_over_rows_that_train():
    advantages = torch.tensor([1.0, -1.0, 3.0, 0.0])
    valid = torch.tensor([True, True, True, False])
    out = rloo.normalize_advantages(advantages, valid)
    a = torch.tensor([1.0, -1.0, 3.0])
    torch.testing.assert_close(out[:3], (a - 1.0) / (a.std() + 1e-4))
    assert out[3] == 0


# ----------------------------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------------------------
def test_weighted_reward_is_nan_aware():
    per_func = torch.tensor([[1.0, 2.0], [math.nan, 4.0], [math.nan, math.nan]])
    out = rloo.weighted_reward(per_func, torch.tensor([0.5, 2.0]))
    assert out[0].item() == pytest.approx(0.5 + 4.0)
    assert out[1].item() == pytest.approx(8.0)
    assert out[2].isnan()


def test_whiten_nan_keeps_nan_rows_and_uses_the_others():
    x = torch.tensor([1.0, 2.0, math.nan, 3.0])
    out = rloo.whiten_nan(x, eps=0.0)
    torch.testing.assert_close(out[[0, 1, 3]], torch.tensor([-1.0, 0.0, 1.0]))
    assert out[2].isnan()


def test_call_reward_func_turns_none_into_nan_and_checks_values():
    out = rloo.call_reward_func(lambda completions, **kw: [1, None, 2.5], "f", 3, completions=["a", "b", "c"])
    assert out[0] == 1 and out[1].isnan() and out[2] == 2.5
    with pytest.raises(rloo.UsageError, match="reward function f returned nan at index 0"):
        rloo.call_reward_func(lambda **kw: [math.nan], "f", 1)
    with pytest.raises(rloo.UsageError, match="returned 'x'"):
        rloo.call_reward_func(lambda **kw: ["x"], "f", 1)
    with pytest.raises(rloo.UsageError, match="list of 2 floats"):
        rloo.call_reward_func(lambda **kw: [1.0], "f", 2)
    with pytest.raises(rloo.UsageError, match="f raised ZeroDivisionError"):
        rloo.call_reward_func(lambda **kw: [1 / 0], "f", 1)


def test_vader_sentiment_reads_plain_and_conversational_completions():
    plain = rloo.vader_sentiment(["What a wonderful, joyful film.", "A dreadful, boring mess."])
    chat = rloo.vader_sentiment([[{"role": "assistant", "content": "What a wonderful, joyful film."}]])
    assert plain[0] > 0.5 and plain[1] < -0.5
    assert chat[0] == plain[0]


def test_load_reward_func_by_name_module_and_file(tmp_path):
    assert rloo.load_reward_func("vader_sentiment") is rloo.vader_sentiment
    assert rloo.load_reward_func("math:sqrt")(4) == 2
    file = tmp_path / "my_rewards.py"
    file.write_text("def shout(completions, **kw):\n    return [float(c.count('!')) for c in completions]\n")
    assert rloo.load_reward_func(f"{file}:shout")(completions=["a!!"]) == [2.0]
    with pytest.raises(rloo.UsageError, match="unknown reward function 'nope'"):
        rloo.load_reward_func("nope")
    with pytest.raises(rloo.UsageError, match="has no function 'missing'"):
        rloo.load_reward_func(f"{file}:missing")


# ----------------------------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(rloo.per_token_kl(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    d = torch.tensor([[0.5, -1.0]])
    torch.testing.assert_close(rloo.per_token_kl(logp, ref, "k3"), torch.exp(-d) + d - 1)
    assert (rloo.per_token_kl(logp, ref, "k3") >= 0).all()


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
def test_clipped_surrogate_by_hand_and_its_gradient():
    ratios = torch.tensor([1.5, 0.5, 0.9, 1.1, 1.25])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    logprob_sum = ratios.log().requires_grad_()
    loss = rloo.clipped_surrogate_loss(logprob_sum, torch.zeros(5), advantages, 0.2, 0.3)
    # A > 0, rho 1.5 > 1 + 0.3: clipped at 1.3; A < 0, rho 0.5 < 0.8: clipped at 0.8; inside: -A rho.
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.3, 0.8, -0.9, 1.1, -1.25]))
    low, high = rloo.clipped_units(ratios, advantages, 0.2, 0.3)
    assert low.tolist() == [False, True, False, False, False] and high.tolist() == [True, False, False, False, False]
    loss.sum().backward()
    # d(-A rho)/d(log rho) = -A rho where unclipped; zero where the clipped branch is active.
    torch.testing.assert_close(logprob_sum.grad, torch.tensor([0.0, 0.0, -0.9, 1.1, -1.25]))


def test_on_policy_ratio_is_exactly_one_and_the_loss_is_reinforce():
    logprob_sum = torch.tensor([-3.0, -7.0], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    loss = rloo.clipped_surrogate_loss(logprob_sum, logprob_sum.detach(), advantages, 0.2, 0.2)
    assert torch.exp(logprob_sum - logprob_sum.detach()).tolist() == [1.0, 1.0]
    loss.sum().backward()
    torch.testing.assert_close(logprob_sum.grad, -advantages)  # the gradient of -A log pi


# ----------------------------------------------------------------------------------------------------------------
# Log-probs, entropy, masks
# ----------------------------------------------------------------------------------------------------------------
def test_selective_log_softmax_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    ids = torch.randint(7, (2, 3))
    torch.testing.assert_close(rloo.selective_log_softmax(logits, ids),
                               torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1))
    uniform = torch.zeros(1, 2, 7)
    torch.testing.assert_close(rloo.entropy_from_logits(uniform), torch.full((1, 2), math.log(7)))
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert rloo.entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_completion_mask_keeps_the_first_stop_token_and_nothing_after():
    eos, stop, pad = 2, 9, 0
    ids = torch.tensor([[5, 6, eos, pad, pad], [5, stop, 7, eos, pad], [5, 6, 7, 8, 4]])
    mask, stopped = rloo.completion_mask_from(ids, [eos, stop])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert stopped.tolist() == [True, True, False]


def test_entropy_metric_only_counts_real_tokens(tiny):
    """The logged entropy is the token-weighted mean over the completion mask, not over padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    prompt_ids = torch.tensor([[5, 6, 7]])
    completion_ids = torch.tensor([[8, 9, 10, 11]])
    full = torch.ones(1, 4, dtype=torch.long)
    half = torch.tensor([[1, 1, 0, 0]])
    _, ent_full = rloo.completion_logprobs(model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, full, 1.0, True)
    _, ent_half = rloo.completion_logprobs(model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, half, 1.0, True)
    torch.testing.assert_close(ent_half[:, :2], ent_full[:, :2])
    assert (ent_half[:, 2:] == 0).all()  # masked columns are cut before the forward, so they carry no entropy


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
    scores = rloo.reward_model_scores(rm, ids, mask)
    with torch.no_grad():
        alone = rm.score(rm.model(torch.tensor([[11, 12, 13]])).last_hidden_state[:, -1]).squeeze()
    assert scores[0].item() == pytest.approx(alone.item(), abs=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Data and schedule
# ----------------------------------------------------------------------------------------------------------------
def test_tokenize_prompts_left_pads_and_left_truncates(tiny):
    tok = tiny["tokenizer"]
    long_text, short_text = "the movie was good and the plot was great", "the film"
    ids, mask, truncated = rloo.tokenize_prompts(tok, [long_text, short_text], 4, "cpu")
    full = tok(long_text, add_special_tokens=False)["input_ids"]
    assert truncated == 1 and ids.shape[1] == 4
    assert ids[0].tolist() == full[-4:]  # the end of the prompt is kept
    short = tok(short_text, add_special_tokens=False)["input_ids"]
    assert mask[1].tolist() == [0] * (4 - len(short)) + [1] * len(short)


def test_dataset_folder_gives_one_split_per_file(tmp_path):
    from conftest import write_jsonl

    write_jsonl(str(tmp_path / "descriptiveness.jsonl"), [{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}])
    write_jsonl(str(tmp_path / "test.jsonl"), [{"prompt": "c", "x": 3}])
    assert rloo.load_prompt_dataset(str(tmp_path), "descriptiveness")["prompt"] == ["a", "b"]
    assert rloo.load_prompt_dataset(str(tmp_path), "test")["x"] == [3]
    assert rloo.load_prompt_dataset(str(tmp_path), "validation") is None


def test_lr_schedule_warmup_then_linear_or_constant():
    linear = rloo.linear_or_constant_schedule("linear", warmup_steps=2, total_steps=6)
    constant = rloo.linear_or_constant_schedule("constant", warmup_steps=2, total_steps=6)
    assert [linear(s) for s in range(7)] == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert [constant(s) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]


def test_batch_semantics_follow_old_trl():
    args = rloo.Args(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2, total_episodes=100)
    assert rloo.batch_sizes(args) == (24, 12, 4)
