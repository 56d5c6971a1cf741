"""The GPU paths, checked on a CPU: the one-row layout hands an attention function each packed sequence's bounds
(flash attention's cu_seq_lens / max_length kwargs), vLLM gets the policy's weights in its own dtype, and a push
synchronises the stream before it and empties the CUDA cache after it."""

import copy
import types

import pytest
import torch
from rich.console import Console
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from test_padding_free import ragged_batch, tiny_model

from rloo_utils.lora import adapter_layers, merged_weight, merged_weights, plain_state_dict  # noqa: E402
from rloo_utils.packing import (  # noqa: E402
    PACKED_ROWS,
    chunked_completion_logprobs,
    pack_sequences,
    packing_layout,
    varlen_kwargs,
)
from rloo_utils.vllm_server import VLLMServer  # noqa: E402
from rloo_utils.processes import whole  # noqa: E402
from rloo_utils.weight_transfer import nccl_sender_parts, weight_push, weights_for_vllm  # noqa: E402
from rloo_utils.scoring import reward_model_scores

VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
CALLS = []  # what varlen_recorder saw, one dict per layer call


def varlen_recorder(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A varlen attention as flash attention's: causal SDPA on each sequence of a packed row, split at cu_seq_lens_q
    (without it, where the position ids restart at 0, as transformers falls back to). No "flash" in the registered
    name: transformers would look for a hub kernel."""
    CALLS.append({name: kwargs.get(name) for name in VARLEN} | {"attention_mask": attention_mask})
    assert attention_mask is None  # a name no mask interface knows: no mask built
    if kwargs.get("cu_seq_lens_q") is not None:
        assert query.shape[0] == 1
        bounds = kwargs["cu_seq_lens_q"].tolist()
    elif query.shape[0] == 1 and kwargs.get("position_ids") is not None:
        starts = (kwargs["position_ids"][0] == 0).nonzero().flatten().tolist()
        bounds = sorted({0, *starts, query.shape[2]})
    else:
        bounds = [0, query.shape[2]]
    pieces = [
        sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, scaling=scaling, dropout=dropout
        )[0]
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(pieces, dim=1), None  # (B, L, H, D)


AttentionInterface.register("varlen_recorder", varlen_recorder)


# ---- 1. The one-row layout's varlen kwargs ---------------------------------------------------------------------------
def test_varlen_kwargs_are_the_bounds_of_pack_sequences_one_row():
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch()
    mask = torch.cat([prompt_mask, completion_mask], 1)  # lengths 16, 4, 5, 5, 13, 11
    mask[2] = 0  # an empty row takes no place in the row
    kwargs = varlen_kwargs(mask, "one_row")
    assert set(kwargs) == set(VARLEN)
    expected = torch.tensor([0, 16, 29, 40, 45, 49], dtype=torch.int32)  # longest first
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert kwargs[name].dtype == torch.int32 and kwargs[name].device == mask.device
        assert torch.equal(kwargs[name], expected)
    for name in ("max_length_q", "max_length_k"):
        assert type(kwargs[name]) is int and kwargs[name] == 16
    # the bounds are where pack_sequences' one row starts each sequence (its position ids restart at 0)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    _, positions, _ = pack_sequences(ids, mask, "one_row")
    assert positions.shape == (1, 49)
    assert (positions[0] == 0).nonzero().flatten().tolist() == expected[:-1].tolist()
    assert varlen_kwargs(mask, "rows") == {}


def test_one_row_forwards_hand_the_attention_each_sequences_bounds():
    """In every script: a varlen attention gets cu_seq_lens / max_length in every layer, and the packed log-probs are
    the padded forward's; packing_layout picks the one-row layout for it (it is not in PACKED_ROWS)."""
    model = tiny_model("llama", "varlen_recorder")
    assert model.config._attn_implementation == "varlen_recorder"
    assert "varlen_recorder" not in PACKED_ROWS
    CALLS.clear()
    assert packing_layout(model, True, False, Console(quiet=True), "policy") == "one_row"
    assert CALLS  # the probe ran through it

    batch, real = ragged_batch(), ragged_batch()[3].bool()
    CALLS.clear()
    with torch.no_grad():
        packed = chunked_completion_logprobs(model, *batch, temperature=1.0, packing="one_row")
    assert len(CALLS) == model.config.num_hidden_layers
    expected = torch.tensor([0, 16, 29, 40, 45, 50, 54], dtype=torch.int32)
    for call in CALLS:
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            assert call[name] is not None and call[name].dtype == torch.int32
            assert torch.equal(call[name], expected)
        for name in ("max_length_q", "max_length_k"):
            assert type(call[name]) is int and call[name] == 16

    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        padded = chunked_completion_logprobs(model, *batch, temperature=1.0, packing=None)
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-5)
    assert (packed[~real] == 0).all()


def test_one_row_reward_model_scores_hand_the_backbone_the_bounds():
    import transformers

    torch.manual_seed(0)
    reward_model = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_labels=1,
        )
    ).eval()
    torch.nn.init.normal_(reward_model.score.weight)
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch()
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    reward_model.config._attn_implementation = "sdpa"
    padded = reward_model_scores(reward_model, ids, mask)
    reward_model.config._attn_implementation = "varlen_recorder"
    CALLS.clear()
    packed = reward_model_scores(reward_model, ids, mask, "one_row")
    assert len(CALLS) == 2 and all(
        torch.equal(call["cu_seq_lens_q"], varlen_kwargs(mask, "one_row")["cu_seq_lens_q"]) for call in CALLS
    )
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


# ---- 2. vLLM gets the weights in its own dtype -----------------------------------------------------------------------
def llama_with_an_integer_buffer():
    model = tiny_model("llama", "sdpa")
    model.register_buffer("step_count", torch.tensor([3, 7], dtype=torch.int64))  # persistent: in state_dict
    return model


def lora_policy():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    policy = get_peft_model(tiny_model("llama", "sdpa"), config)
    torch.manual_seed(2)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(std=0.5)  # a trained adapter: the merge changes the weights
    return policy


def test_merged_weights_in_bf16_are_the_fp32_weights_cast():
    model = llama_with_an_integer_buffer()
    state = model.state_dict()
    pushed = dict(merged_weights(model, dtype=torch.bfloat16))
    assert list(pushed) == list(state)
    for name, tensor in pushed.items():
        if state[name].is_floating_point():
            assert state[name].dtype == torch.float32 and tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
        else:
            assert tensor.dtype == torch.int64 and torch.equal(tensor, state[name]), name
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the trained weights stay as they are
    assert all(t.dtype == state[k].dtype for k, t in merged_weights(model))  # no dtype: as trained


def test_merged_lora_weights_in_bf16_are_the_fp32_merge_cast():
    policy = lora_policy()
    layers = adapter_layers(policy)
    assert len(layers) == 4  # q_proj and v_proj of 2 layers
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    plain = plain_state_dict(policy)
    pushed = dict(merged_weights(policy, dtype=torch.bfloat16))
    assert list(pushed) == list(plain) and not any("lora_" in name for name in pushed)
    merged_by_peft = copy.deepcopy(policy).merge_and_unload().state_dict()
    for name, tensor in pushed.items():
        assert tensor.dtype == torch.bfloat16, name
        if name in layers:
            fp32 = merged_weight(layers[name], plain[name])
            assert fp32.dtype == torch.float32
            assert not torch.equal(fp32, plain[name])  # the adapter is in it
            assert torch.equal(tensor, fp32.to(torch.bfloat16)), name
        else:
            assert torch.equal(tensor, plain[name].to(torch.bfloat16)), name
        torch.testing.assert_close(tensor, merged_by_peft[name].to(torch.bfloat16))  # as peft merges it, to bf16
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # the trained copy unchanged


@pytest.mark.parametrize("gather", [lambda t: t, whole], ids=["one_process", "gathered_shards"])
@pytest.mark.parametrize("peft", [False, True])
def test_weights_for_vllm_yields_the_engines_dtype(gather, peft):
    policy = lora_policy() if peft else llama_with_an_integer_buffer()
    items = list(weights_for_vllm(policy, torch.bfloat16, gather).items())
    assert items and all(t.dtype == (torch.bfloat16 if t.is_floating_point() else torch.int64) for _, t in items)
    assert dict(items).keys() == plain_state_dict(policy).keys()
    assert all(
        t.dtype == torch.float32 for _, t in weights_for_vllm(policy, None, gather).items() if t.is_floating_point()
    )


def test_nccl_weight_source_reports_the_push_dtype():
    """The NCCL sender's metadata (what the server's workers allocate to receive) is in the dtype of the tensors that
    follow. Building the parts connects nowhere (the HTTP client only keeps the url; a UDP connect sends nothing)."""
    model = llama_with_an_integer_buffer()
    for dtype in (torch.bfloat16, None):
        init_info, client, source = nccl_sender_parts("http://127.0.0.1:1", 1.0, 1, model, dtype)
        assert init_info.rank == 0 and init_info.world_size == 2
        meta = source.metadata()
        state = model.state_dict()
        assert [m.name for m in meta] == list(state)
        for m in meta:
            assert m.shape == tuple(state[m.name].shape)
            wanted = (dtype or state[m.name].dtype) if state[m.name].is_floating_point() else torch.int64
            assert m.dtype == wanted, m
        source.weights = merged_weights(model, dtype=dtype)
        sent = list(source)
        assert [(k, v.dtype, tuple(v.shape)) for k, v in sent] == [(m.name, m.dtype, m.shape) for m in meta]


# ---- 3. A push: the stream synchronised before, the CUDA cache emptied after ----------------------------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as on a GPU: the events of current_stream().synchronize() and empty_cache() in `events`."""
    events = []
    stream = types.SimpleNamespace(synchronize=lambda: events.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    return events


def test_weight_push_is_a_no_op_without_cuda(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with weight_push():
        fake_cuda.append("body")
    assert fake_cuda == ["body"]


def test_weight_push_synchronises_before_and_empties_the_cache_after(fake_cuda):
    with weight_push():
        fake_cuda.append("body")
    assert fake_cuda == ["synchronize", "body", "empty_cache"]
    fake_cuda.clear()
    with pytest.raises(ValueError, match="half-way"):
        with weight_push():
            fake_cuda.append("body")
            raise ValueError("a push failed half-way")
    assert fake_cuda == ["synchronize", "body", "empty_cache"]


def test_the_pushes_go_through_weight_push(fake_cuda):
    """The colocated engine's reload and the server's send both run inside weight_push."""
    from rloo_utils.vllm_colocated import ColocatedVLLM

    policy = llama_with_an_integer_buffer()

    def reload(method, kwargs):
        fake_cuda.append(method)
        assert all(t.dtype in (torch.bfloat16, torch.int64) for _, t in kwargs["weights_iterator"])

    llm = types.SimpleNamespace(collective_rpc=reload, reset_prefix_cache=lambda: fake_cuda.append("reset"))
    colocated = types.SimpleNamespace(sleep_mode=False, llm=llm, adapter=False)
    ColocatedVLLM.push_weights(colocated, policy, weights_for_vllm(policy, torch.bfloat16))
    assert fake_cuda == ["synchronize", "reload_weights", "empty_cache", "reset"]

    fake_cuda.clear()

    def send_weights(policy, weights):
        fake_cuda.append("send")
        next(weights)
        raise RuntimeError("the server went away")

    server = types.SimpleNamespace(send_weights=send_weights, adapter=False)
    with pytest.raises(RuntimeError, match="went away"):
        VLLMServer.push_weights(server, policy, weights_for_vllm(policy, torch.bfloat16))
    assert fake_cuda == ["synchronize", "send", "empty_cache"]
