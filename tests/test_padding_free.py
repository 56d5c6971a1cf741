"""Padding-free forwards (--padding_free): the real tokens of a micro-batch packed into rows give the padded path's
log-probs, entropies, gradients, reward-model scores and, run end to end, every metric; where packed sequences would
see each other the scripts fall back to padded forwards, and say so."""

import contextlib
import functools
import inspect
import json
import os

import pytest
import torch
from rich.console import Console

from conftest import run_rloo
from test_multigpu import run_torchrun

import rloo  # noqa: E402  (each_script swaps in each script in turn)
from rloo_utils.errors import UsageError  # noqa: E402
import rloo_utils.packing as packing_module  # noqa: E402
from rloo_utils.packing import (  # noqa: E402
    check_output_layer,
    chunked_completion_logprobs,
    pack_sequences,
    packing_layout,
)
from rloo_utils.scoring import reward_model_scores


def tiny_model(family: str, attention: str):
    """A 2-layer model of `family` with random weights, eval mode, the given attention implementation."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2)
    model = {
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(intermediate_size=128, num_key_value_heads=1, **common)
        ),
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
        ),
        "mixtral": lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(  # routed per token
                intermediate_size=128, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common
            )
        ),
        "gemma2": lambda: transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(  # a logit cap after the output layer
                intermediate_size=128, num_key_value_heads=2, head_dim=32, final_logit_softcapping=5.0, **common
            )
        ),
        "cohere": lambda: transformers.CohereForCausalLM(
            transformers.CohereConfig(  # logits times logit_scale
                intermediate_size=128, num_key_value_heads=1, logit_scale=0.25, **common
            )
        ),
        "granite": lambda: transformers.GraniteForCausalLM(
            transformers.GraniteConfig(  # logits / logits_scaling
                intermediate_size=128, num_key_value_heads=1, logits_scaling=4.0, **common
            )
        ),
        "opt": lambda: transformers.OPTForCausalLM(
            transformers.OPTConfig(  # its mask ignores the position ids
                vocab_size=300,
                hidden_size=64,
                ffn_dim=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                word_embed_proj_dim=64,
            )
        ),
    }[family]()
    model.config._attn_implementation = attention
    return model.eval()


def ragged_batch():
    """Left-padded prompts and right-padded completions of spread lengths, one completion empty: (B, P), (B, C)."""
    g = torch.Generator().manual_seed(1)
    B, P, C = 6, 7, 9
    prompt_lengths, completion_lengths = torch.tensor([7, 3, 1, 5, 7, 2]), torch.tensor([9, 1, 4, 0, 6, 9])
    prompt_mask = (torch.arange(P)[None] >= P - prompt_lengths[:, None]).long()
    completion_mask = (torch.arange(C)[None] < completion_lengths[:, None]).long()
    return (
        torch.randint(3, 300, (B, P), generator=g),
        prompt_mask,
        torch.randint(3, 300, (B, C), generator=g),
        completion_mask,
    )


def test_pack_sequences_packs_real_tokens_with_positions_restarting():
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch()
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    lengths = mask.sum(1)  # 16, 4, 5, 5, 13, 11
    for layout, rows, length in [("rows", 4, 16), ("one_row", 1, 54)]:
        packed, positions, index = pack_sequences(ids, mask, layout)
        assert packed.shape == positions.shape == (rows, length)
        real = mask.bool()
        assert torch.equal(packed.flatten()[index[real]], ids[real])  # every real token, where index says
        assert len(set(index[real].tolist())) == int(lengths.sum())  # each in a place of its own
        starts = index[torch.arange(len(ids)), mask.argmax(1)]  # each sequence's first token, in one row with its last
        ends = starts + lengths - 1
        assert torch.equal(starts // length, ends // length)
        for start, n in zip(starts.tolist(), lengths.tolist()):  # its positions count 0, 1, ... from its first token
            assert positions.flatten()[start : start + n].tolist() == list(range(n))


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "gemma2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_padding_free_logprobs_entropies_and_gradients_are_the_definitions(each_script, family, attention):
    """In every script: chunked_completion_logprobs (--padding_free, the default), packed in both layouts or padded,
    gives what the script's plain completion_logprobs defines: the log-probs, entropies and (the vLLM scripts') log-probs
    on a sampler's support of the real completion tokens, and the gradient of a loss on them, to float rounding; padding
    is 0."""
    model = tiny_model(family, attention)
    assert packing_layout(model, True, False, Console(quiet=True), "policy") == "rows"
    batch = ragged_batch()
    real = batch[3].bool()
    top_5 = lambda logits: logits >= logits.topk(5).values[..., -1:]  # noqa: E731  (a sampler's support, as top-k)
    with_support = "support" in inspect.signature(rloo.completion_logprobs).parameters  # the vLLM scripts'

    def forward(logprobs_of):
        model.zero_grad()
        values = logprobs_of(model, *batch, 0.7, with_entropy=True, **({"support": top_5} if with_support else {}))
        (values[0] * real).sum().backward()
        return *values, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    *definition, definition_grads = forward(rloo.completion_logprobs)
    assert len(definition) == (3 if with_support else 2)
    if with_support:
        assert not torch.allclose(definition[0][real], definition[2][real])  # the support matters here
    for packing in [None, "rows", "one_row"]:
        *values, grads = forward(functools.partial(chunked_completion_logprobs, packing=packing))
        for value, expected in zip(values, definition):
            torch.testing.assert_close(value[real], expected[real], rtol=1e-5, atol=1e-5)
            assert (value[~real] == 0).all() and (expected[~real] == 0).all()
        assert len(grads) == len(definition_grads)
        for grad, expected in zip(grads, definition_grads):
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "cohere", "granite"])
def test_logprobs_entropies_and_gradients_are_those_of_the_whole_logits(family, monkeypatch):
    """Padded and both packed layouts: the log-probs, entropies and gradients made from the output
    layer's inputs a few positions at a time equal those of each row's whole (T, V) logits as the model returns them
    (after Gemma's soft cap, Cohere's logit_scale, Granite's logits_scaling), one unpadded forward per row."""
    monkeypatch.setattr(packing_module, "LOGIT_CHUNK_ELEMENTS", 3 * 300)  # 3 positions a chunk
    model = tiny_model(family, "sdpa")
    check_output_layer(model, contextlib.nullcontext, "policy")
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch = ragged_batch()
    real = completion_mask.bool()
    model.zero_grad()
    expected_logprobs, expected_entropy = torch.zeros(real.shape), torch.zeros(real.shape)
    for row in range(len(prompt_ids)):
        prompt, completion = prompt_ids[row][prompt_mask[row].bool()], completion_ids[row][real[row]]
        logits = model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1]  # (c, V), whole
        logp = torch.log_softmax(logits.float() / 0.7, -1)
        picked = logp.gather(-1, completion[:, None]).squeeze(-1)
        picked.sum().backward()
        expected_logprobs[row, real[row]] = picked.detach()
        expected_entropy[row, real[row]] = -(logp.exp() * logp).sum(-1).detach()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    for packing in [None, "rows", "one_row"]:
        model.zero_grad()
        logprobs, entropy = chunked_completion_logprobs(model, *batch, 0.7, with_entropy=True, packing=packing)
        (logprobs * real).sum().backward()
        torch.testing.assert_close(logprobs, expected_logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=1e-5)
        for param, expected in zip(model.parameters(), expected_grads):
            torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-5)


def test_a_model_that_changes_its_logits_otherwise_is_refused_in_one_line():
    """A model whose returned logits are not its output layer's (with a known transform) cannot get its log-probs from
    the output layer's inputs: check_output_layer refuses it before any training."""
    import transformers

    class Shifted(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2 + 1
            return out

    model = tiny_model("llama", "sdpa")
    shifted = Shifted(model.config).eval()
    with pytest.raises(UsageError, match="Shifted changes its logits after its output layer"):
        check_output_layer(shifted, contextlib.nullcontext, "policy")
    check_output_layer(model, contextlib.nullcontext, "policy")


def test_packed_reward_model_scores_are_the_padded_ones(each_script, tiny):
    from transformers import AutoModelForSequenceClassification

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny["reward"]).eval()
    torch.nn.init.normal_(reward_model.score.weight)  # a head that reads the hidden state: scores far apart
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch()
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    padded = reward_model_scores(reward_model, ids, mask)
    assert padded.std() > 0.1
    layout = packing_layout(reward_model.model, True, False, Console(quiet=True), "reward model")
    for packing in [layout, "one_row"]:
        torch.testing.assert_close(reward_model_scores(reward_model, ids, mask, packing), padded, rtol=1e-5, atol=1e-5)


def test_a_model_whose_packed_sequences_see_each_other_gets_padded_forwards():
    """OPT's mask reads the attention mask alone, not the position ids: packed, its sequences would attend across
    (the probe finds it, and the log-probs would differ); image prompts are never packed."""
    console = Console(record=True, width=200)
    opt = tiny_model("opt", "sdpa")
    assert packing_layout(opt, True, False, console, "policy") is None
    assert (
        "policy: padded forwards, not padding-free: with attention 'sdpa', OPTForCausalLM lets packed sequences "
        "see each other" in console.export_text()
    )
    batch, real = ragged_batch(), ragged_batch()[3].bool()
    padded = chunked_completion_logprobs(opt, *batch, 1.0)
    assert not torch.allclose(
        chunked_completion_logprobs(opt, *batch, 1.0, packing="rows")[real], padded[real], atol=1e-3
    )
    llama = tiny_model("llama", "sdpa")
    assert packing_layout(llama, True, True, console, "policy") is None
    assert "policy: padded forwards, not padding-free: image prompts are not packed" in console.export_text()
    assert packing_layout(llama, False, False, console, "policy") is None  # --no_padding_free


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "rloo_vllm.py", "rloo_multigpu.py"])
def test_every_metric_of_a_run_is_the_same_padded_and_padding_free(script, tiny, prompts_file, tmp_path):
    """4 updates of 2 epochs x 2 minibatches with a reward model and the KL: every logged metric but the wall-clock
    ones equal to float rounding, padded (--no_padding_free) or padding-free (the default)."""
    options = [
        "--model_name_or_path",
        tiny["policy"],
        "--reward_model_path",
        tiny["reward"],
        "--dataset_name",
        prompts_file,
        "--num_generations",
        4,
        "--per_device_train_batch_size",
        4,
        "--num_mini_batches",
        2,
        "--num_ppo_epochs",
        2,
        "--total_episodes",
        32,
        "--max_completion_length",
        12,
        "--beta",
        0.1,
        "--num_sample_generations",
        0,
    ]
    metrics = {}
    for path in ["--padding_free", "--no_padding_free"]:
        cwd = tmp_path / path.strip("-")
        cwd.mkdir()
        if script == "rloo_multigpu.py":  # 2 processes of 8 rows each
            proc = run_torchrun(2, *options, "--per_device_train_batch_size", 2, path, cwd=cwd)
        else:
            proc = run_rloo(*options, path, cwd=cwd, script=script)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "padded forwards" not in proc.stdout
        (run,) = os.listdir(cwd / "runs")
        with open(cwd / "runs" / run / "metrics.jsonl") as f:
            metrics[path] = [json.loads(line) for line in f]
    wall_clock = lambda k: k in ("eps", "step_time") or k.startswith(("perf/", "time/"))  # noqa: E731
    assert len(metrics["--padding_free"]) == len(metrics["--no_padding_free"]) == 4  # 8 completions an update
    for packed, padded in zip(metrics["--padding_free"], metrics["--no_padding_free"]):
        assert packed.keys() == padded.keys()
        for key in packed:
            if not wall_clock(key):
                assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-5, nan_ok=True), key


def test_the_probe_runs_as_training_does_and_catches_an_output_layer_the_hook_cannot_pick_from():
    """The probe's forwards run under the autocast it is given (flash attention takes no fp32); a model that makes
    its logits without calling its output layer (the pre-hook never fires: all 16 positions come back) is padded."""
    import torch.nn.functional as F
    import transformers

    llama = tiny_model("llama", "sdpa")
    seen = []
    llama.model.register_forward_hook(lambda module, args, out: seen.append(torch.is_autocast_enabled("cpu")))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    assert packing_layout(llama, True, False, Console(quiet=True), "policy", bf16) == "rows"
    assert seen == [True, True, True]

    class LogitsByHand(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            hidden = self.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
            return transformers.modeling_outputs.CausalLMOutputWithPast(logits=F.linear(hidden, self.lm_head.weight))

    console = Console(record=True, width=200)
    by_hand = LogitsByHand(llama.config).eval()
    assert packing_layout(by_hand, True, False, console, "policy") is None
    assert (
        "LogitsByHand fails the packing probe (AssertionError: its output layer was not given the positions picked)"
    ) in console.export_text()
    with pytest.raises(UsageError, match="LogitsByHand makes its logits without calling its output layer"):
        check_output_layer(by_hand, contextlib.nullcontext, "policy")  # which every script runs at start
