"""Our own decoding loop (rloo_utils/decoding.py, --decoding_loop own) gives what HF generate gives with a static cache:
greedy completions token for token, a row that ends early padded after its stop token, as many columns as HF's;
sampled tokens drawn from the distribution that transformers' logits processors leave (temperature, top_k, top_p,
min_p, suppress_tokens), the same draws from the same seed; and `covers` sends every other config or call to HF
generate."""

import copy

import pytest
import torch

import rloo
from conftest import keywords_of


from rloo_utils import decoding
from rloo_utils.data import left_pad
from rloo_utils.generation import generation_configs, static_cache_inputs
from rloo_utils.rollouts import completion_mask_from


def policy_and_configs(tiny, max_completion_length: int = 12, **sampling):
    """The tiny policy, its tokenizer and the run's static-cache configs (sampling, greedy) as generation_configs makes
    them; `sampling`: options other than the defaults (temperature 1, no filter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    args = rloo.Args(max_completion_length=max_completion_length, **{"temperature": 1.0, **sampling})
    eos = tokenizer.eos_token_id
    sampling_config, greedy, _ = generation_configs(
        [eos],
        tokenizer.pad_token_id,
        None,
        static=True,
        **keywords_of(generation_configs, args, filters=args.filters()),
    )
    return policy, tokenizer, sampling_config, greedy


def prompts(tokenizer, lengths: list[int], seed: int = 0):
    """Left-padded (b, P) prompts of random ids, of these lengths."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(10, len(tokenizer) - 1, (n,), generator=generator).tolist() for n in lengths]
    return left_pad(rows, tokenizer.pad_token_id)


def both(policy, config, ids, mask, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """HF generate's and our loop's output for the same inputs, as a Sampler passes them (static_cache_inputs)."""
    inputs = static_cache_inputs(ids, mask, config, rows)
    assert decoding.covers(policy, generation_config=config, **inputs)
    with torch.no_grad():
        return policy.generate(**inputs, generation_config=config), decoding.generate(
            policy, **inputs, generation_config=config
        )


@pytest.mark.slow  # HF generate's compiled step and ours, each traced and built by inductor (~30 s on 2 cores, cold)
def test_greedy_completions_are_hf_generate_s_and_rows_that_end_get_pads(tiny, monkeypatch):
    policy, tokenizer, _, greedy = policy_and_configs(tiny)
    ids, mask = prompts(tokenizer, [5, 9, 2, 7, 3, 6, 4])  # 7 rows, topped up to 8; no row ends: 12 tokens each
    expected, got = both(policy, greedy, ids, mask)
    assert got.shape == expected.shape == (8, ids.shape[1] + 12)
    assert torch.equal(got, expected)

    # Stop tokens that the rows reach at different steps: each row's 4th greedy token (a row may meet it earlier),
    # and a pad token that none of them writes, so that the pads after a row's end are seen. Every row ends by the 4th
    # step, so the loop stops at its first read of the rows (CHECK_EVERY 3: after step 3 some row may go on, after 6
    # none) and returns as many columns as HF generate, which stops after the step in which the last row ended.
    monkeypatch.setattr(decoding, "CHECK_EVERY", 3)
    completions = expected[:7, ids.shape[1] :]
    greedy.eos_token_id = sorted(set(completions[:, 3].tolist()))
    greedy.pad_token_id = next(t for t in range(len(tokenizer)) if t not in completions and t not in ids)
    expected, got = both(policy, greedy, ids, mask)
    assert torch.equal(got, expected)
    assert got.shape[1] - ids.shape[1] <= 4
    completion_mask, ended = completion_mask_from(got[:, ids.shape[1] :], greedy.eos_token_id, greedy.eos_token_id)
    assert ended.all()
    assert ((got[:, ids.shape[1] :] == greedy.pad_token_id) == ~completion_mask.bool()).all()  # pads after the end
    assert (completion_mask.sum(1) < got.shape[1] - ids.shape[1]).any()  # some row ended before the last column


def sharpened(policy):
    """The tiny policy with its (tied) embeddings and output layer scaled by 1.5: the tiny model's near-uniform
    distribution peaked (its most likely token 0.03, 0.3 after the filters), so that frequencies differ."""
    with torch.no_grad():
        policy.lm_head.weight.mul_(1.5)
    return policy


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of counts (V,) under probabilities (V,) (Pearson's chi-square; the tokens expected fewer than 5 times
    pooled into one cell)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    degrees = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2), statistic / 2))


def processed_probs(logits: torch.Tensor, config) -> torch.Tensor:
    """(V,) the probabilities transformers' own logits processors leave of (V,) logits for a sampling config (the
    reference, not our code)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = [SuppressTokensLogitsProcessor(config.suppress_tokens)] if config.suppress_tokens else []
    processors += [TemperatureLogitsWarper(config.temperature), TopKLogitsWarper(config.top_k)]
    processors += [TopPLogitsWarper(config.top_p), MinPLogitsWarper(config.min_p)]
    scores = logits[None].float()
    for processor in processors:
        scores = processor(None, scores)
    return scores.softmax(-1)[0]


FILTERS = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02)


def test_sampled_tokens_follow_the_distribution_the_processors_leave(tiny):
    """next_tokens as the loop's first step runs it (not compiled): 20,000 draws from one row's logits, against the
    probabilities transformers' processors leave; no token they remove is drawn."""
    policy, tokenizer, sampling, _ = policy_and_configs(tiny, **FILTERS)
    sampling.suppress_tokens = [7, 8]
    policy = sharpened(policy)
    ids, mask = prompts(tokenizer, [6])
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask).logits[0, -1]
    probs = processed_probs(logits, sampling)
    assert 5 < int((probs > 0).sum()) <= 40  # the filters cut the vocabulary to a few dozen tokens
    torch.manual_seed(0)
    config = decoding.effective_config(policy, sampling)
    drawn = decoding.next_tokens(logits[None].expand(20_000, -1).float(), decoding.Choice.of(config, "cpu"))
    counts = torch.bincount(drawn, minlength=len(probs))
    assert (counts[probs == 0] == 0).all()
    assert chi_square_p_value(counts, probs) > 1e-3
    hot = copy.deepcopy(sampling)  # the control: the same draws, against the distribution at temperature 1
    hot.temperature = 1.0
    assert chi_square_p_value(counts, processed_probs(logits, hot)) < 1e-6


@pytest.mark.slow  # the compiled step with every filter, traced and built (~20 s on 2 cores, cold)
def test_the_compiled_step_samples_the_processors_distribution_and_the_same_seed_gives_the_same_tokens(tiny):
    """4,096 rows of one prompt, 2 tokens each: the second token is the compiled step's draw. Among the rows whose first
    token is the most frequent, its frequencies against the processed probabilities after prompt + that token. The
    same seed draws the same tokens again; another seed others."""
    policy, tokenizer, sampling, _ = policy_and_configs(tiny, max_completion_length=2, **FILTERS)
    policy = sharpened(policy)
    ids, mask = prompts(tokenizer, [6])
    ids, mask = ids.expand(4096, -1), mask.expand(4096, -1)
    inputs = static_cache_inputs(ids, mask, sampling, 4096)
    torch.manual_seed(1)
    out = decoding.generate(policy, **inputs, generation_config=sampling)
    assert out.shape == (4096, 8)
    first = out[:, 6].mode().values
    assert first != tokenizer.eos_token_id
    second = out[out[:, 6] == first, 7]
    assert len(second) > 400
    with torch.no_grad():
        logits = policy(input_ids=torch.cat([ids[:1], first.view(1, 1)], 1)).logits[0, -1]
    probs = processed_probs(logits, sampling)
    counts = torch.bincount(second, minlength=len(probs))
    assert (counts[probs == 0] == 0).all()
    assert chi_square_p_value(counts, probs) > 1e-3

    torch.manual_seed(1)
    assert torch.equal(decoding.generate(policy, **inputs, generation_config=sampling), out)
    torch.manual_seed(2)
    assert not torch.equal(decoding.generate(policy, **inputs, generation_config=sampling), out)


def test_covers_what_the_loop_runs_and_sends_the_rest_to_hf_generate(tiny):
    policy, tokenizer, sampling, greedy = policy_and_configs(tiny, **FILTERS)
    ids, mask = prompts(tokenizer, [3, 5])
    inputs = static_cache_inputs(ids, mask, sampling, 2)
    assert decoding.covers(policy, sampling, **inputs) and decoding.covers(policy, greedy, **inputs)
    assert decoding.covers(policy, sampling, **inputs, past_key_values=None, synced_gpus=False)  # as Samplers pass
    for name, value in [("repetition_penalty", 1.1), ("no_repeat_ngram_size", 2), ("cache_implementation", None)]:
        config = copy.deepcopy(sampling)
        setattr(config, name, value)
        assert not decoding.covers(policy, config, **inputs), name
    for name, value in [("synced_gpus", True), ("past_key_values", object()), ("pixel_values", torch.ones(2, 3))]:
        assert not decoding.covers(policy, sampling, **inputs, **{name: value}), name
    # The model's generation config fills what the run's config leaves unset, as in generate
    policy.generation_config.no_repeat_ngram_size = 3
    assert decoding.uncovered(policy, sampling, **inputs) == "no_repeat_ngram_size 3"
    policy.generation_config.no_repeat_ngram_size = None
    policy.generation_config.repetition_penalty = 1.3  # the run's config says 1.0: that one holds
    assert decoding.covers(policy, sampling, **inputs)


FELL_BACK = "--decoding_loop own: HF generate's loop decodes "


@pytest.mark.parametrize(
    "option, static, config_change, expected, said",
    [
        ("auto", True, None, False, ""),  # auto: HF generate's loop until a GPU has measured ours
        ("generate", True, None, False, ""),
        ("own", True, None, True, ""),
        ("own", False, None, False, FELL_BACK + "(HF generate keeps a dynamic cache here"),
        ("own", True, ("repetition_penalty", 1.2), False, FELL_BACK + "(repetition_penalty 1.2)"),
    ],
)
def test_which_runs_decode_with_the_own_loop(tiny, option, static, config_change, expected, said):
    from rich.console import Console

    policy, _, sampling, greedy = policy_and_configs(tiny)
    if config_change:
        setattr(sampling, *config_change)
    console = Console(record=True, width=300)
    assert decoding.use_own_loop(option, static, policy, [sampling, greedy], console) is expected
    assert console.export_text().startswith(said) and (said or console.export_text() == "")


def test_generated_length_is_where_hf_generate_stops():
    stop = torch.tensor([9])
    assert decoding.generated_length(torch.tensor([[1, 9, 0, 0], [2, 3, 9, 0]]), stop) == 3  # the last row's end
    assert decoding.generated_length(torch.tensor([[1, 9, 0, 0], [2, 3, 4, 5]]), stop) == 4  # a row went on
    assert decoding.generated_length(torch.tensor([[9, 9], [9, 0]]), stop) == 1
