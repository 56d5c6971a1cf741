"""Vision-language prompts (TRL's `image` / `images` columns): a tiny LLaVA learns a task it can only solve by looking,
the image tensors reach every forward as they would alone, image tokens are never sampled, Qwen2-VL's own positions
(mrope) hold under left padding, two processes train a VLM, vLLM gets the images in its own input format, and bad
input is refused in one line."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (
    COLOURS,
    VLM_CHAT_TEMPLATE,
    check_learned,
    check_one_line_error,
    engine_options_of,
    keywords_of,
    read_metrics,
    run_env,
    run_rloo,
    word_tokenizer,
    write_jsonl,
)

import rloo
from rloo_utils.data import left_pad, with_image_placeholders
from rloo_utils.lora import add_adapter
from rloo_utils.models import load_tokenizers
from rloo_utils.generation import generation_configs, tokenize_prompts
from rloo_utils.scoring import reward_model_inputs
from rloo_utils.vision import builds_own_positions, image_prompt_rows, image_token_ids, images_batch, vision_inputs
from rloo_utils.vllm_sampling import sampling_options
from rloo_utils.vllm_server import generate_request, prompt_runs

VLM_ARGS = (
    "--num_generations",
    4,
    "--per_device_train_batch_size",
    32,
    "--gradient_accumulation_steps",
    1,
    "--max_completion_length",
    3,
    "--learning_rate",
    3e-3,
    "--beta",
    0.0,
    "--num_sample_generations",
    0,
)


def vlm_run(tiny_vlm, tmp_path, *extra, script="rloo.py", episodes=64):
    return run_rloo(
        "--model_name_or_path",
        tiny_vlm["policy"],
        "--dataset_name",
        tiny_vlm["data"],
        "--reward_funcs",
        tiny_vlm["reward"],
        "--total_episodes",
        episodes,
        *VLM_ARGS,
        *extra,
        cwd=tmp_path,
        script=script,
    )


def colour_images(n: int, sizes=((16, 16), (24, 16), (20, 20))):
    from PIL import Image

    return [Image.new("RGB", sizes[i % len(sizes)], list(COLOURS.values())[i % 3]) for i in range(n)]


@pytest.mark.slow
@pytest.mark.learning
def test_a_tiny_vlm_learns_to_name_the_colour_it_sees(tiny_vlm, tmp_path, learning_seed, request):
    """The reward function gets the images (the dataset's `image` column, as TRL passes columns) and pays 1 for the
    colour's name; the colours are balanced, so a policy blind to the image earns at most 1/3 on average."""
    proc = vlm_run(
        tiny_vlm,
        tmp_path,
        "--total_episodes",
        2560,
        "--num_sample_generations",
        2,
        "--run_name",
        "colours",
        "--output_dir",
        tmp_path / "model",
        "--seed",
        learning_seed,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [row["rewards/colour_named/mean"] for row in read_metrics(tmp_path)]
    assert len(rewards) == 80
    check_learned(request, rewards, gain=0.15, window=10, above=0.45)  # blind to the image: <= 1/3 on average
    # the trained model is a VLM folder transformers loads, processor included, and it still names colours
    check = (
        "import sys, torch; from transformers import AutoModelForImageTextToText, AutoProcessor; from PIL import Image\n"
        "model = AutoModelForImageTextToText.from_pretrained(sys.argv[1]); processor = AutoProcessor.from_pretrained(sys.argv[1])\n"
        "text = processor.apply_chat_template([{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', "
        "'text': 'what colour is this image'}]}], add_generation_prompt=True, tokenize=False)\n"
        "print(type(model).__name__, type(processor).__name__, processor.image_processor is not None)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=300,
    )
    assert loaded.stdout.split() == ["LlavaForConditionalGeneration", "LlavaProcessor", "True"], loaded.stderr[-2000:]
    samples = [json.loads(line) for line in open(tmp_path / "runs" / "colours" / "samples.jsonl")]
    assert samples and all(s["prompt"] == "what colour is this image" for s in samples)


@pytest.mark.slow
def test_a_vlm_trains_on_two_processes_and_resumes(tiny_vlm, tmp_path):
    """rloo_multigpu.py: the vision tower sharded with the decoder layers; each process feeds its own rows' images to
    generate (synced) and to the update; a checkpoint of a VLM resumes."""
    args = [
        "--model_name_or_path",
        tiny_vlm["policy"],
        "--dataset_name",
        tiny_vlm["data"],
        "--reward_funcs",
        tiny_vlm["reward"],
        "--total_episodes",
        128,
        "--num_generations",
        4,
        "--per_device_train_batch_size",
        8,
        "--gradient_accumulation_steps",
        2,
        "--max_completion_length",
        3,
        "--learning_rate",
        3e-3,
        "--beta",
        0.05,
        "--num_sample_generations",
        1,
        "--num_sample_prompts",
        2,
        "--save_steps",
        2,
        "--run_name",
        "two",
    ]
    from test_multigpu import torchrun as torchrun_of

    torchrun = torchrun_of(2)  # --standalone: a free port of its own, never the fixed 29500 another test may hold
    proc = subprocess.run(
        [*torchrun, *map(str, args), "--output_dir", str(tmp_path / "model")],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 4 and rows[0]["objective/kl"] == 0.0  # the sharded reference equals the policy before training
    assert os.path.exists(tmp_path / "model" / "processor_config.json")
    shutil.rmtree(tmp_path / "runs" / "two" / "checkpoints" / "checkpoint-4")
    resumed = subprocess.run(
        [*torchrun, *map(str, args), "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest"],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = read_metrics(tmp_path)
    assert [r["episode"] for r in again] == [32, 64, 96, 128]
    for before, after in zip(rows[2:], again[2:]):  # updates 3 and 4 again, from the checkpoint of update 2: the same
        assert after["reward"] == before["reward"] and after["objective/kl"] == pytest.approx(
            before["objective/kl"], abs=1e-6
        )


def llava_batch(tiny_vlm, images, texts):
    """Left-padded prompt ids and per-row image tensors, as the scripts build them."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm["policy"] if isinstance(tiny_vlm, dict) else tiny_vlm)
    prompts = [[{"role": "user", "content": text}] for text in texts]
    return processor, tokenize_prompts(processor.tokenizer, prompts, 64, "cpu", processor, images)


def logprobs_alone_and_together(model, prompt_ids, prompt_mask, image_rows, completion_ids):
    completion_mask = torch.ones_like(completion_ids)
    with torch.no_grad():
        together = rloo.completion_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            1.0,
            images=images_batch(image_rows, slice(0, None), "cpu", model.dtype),
        )
        alone = torch.cat(
            [
                rloo.completion_logprobs(
                    model,
                    prompt_ids[i : i + 1, -int(prompt_mask[i].sum()) :],
                    prompt_mask[i : i + 1, -int(prompt_mask[i].sum()) :],
                    completion_ids[i : i + 1],
                    completion_mask[i : i + 1],
                    1.0,
                    images=images_batch(image_rows, slice(i, i + 1), "cpu", model.dtype),
                )
                for i in range(len(prompt_ids))
            ]
        )
    return together, alone


def build_tiny_llava_next(path: str) -> str:
    """A tiny LLaVA-NeXT: each image is cut into a grid of 16x16 tiles chosen by its aspect ratio, plus a base tile, so
    images of other shapes have other numbers of patches (the processor pads them per batch; the scripts per row)."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
    tokenizer = word_tokenizer(
        list(COLOURS) + "what colour is this image the a it user assistant".split(),
        special,
        VLM_CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<image>"},
    )
    pinpoints = [[16, 32], [32, 16], [32, 32]]
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
            projection_dim=32,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            eos_token_id=2,
            pad_token_id=0,
        ),
        image_token_id=3,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlavaNextForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)
    LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": 16}, image_grid_pinpoints=pinpoints, crop_size={"height": 16, "width": 16}
        ),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        image_token="<image>",
        chat_template=VLM_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    ).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_llava_images_reach_the_log_prob_forward_as_they_would_alone(family, tiny_vlm, tmp_path):
    """A left-padded batch of prompts with their images gives each row the log-probs it has unpadded and alone: the
    rows' pixels are concatenated in row order (LLaVA-NeXT's padded to the most patches: 3 for a square or 2:1 image,
    5 for a larger square), and the positions count real tokens."""
    from transformers import AutoModelForImageTextToText

    path = tiny_vlm["policy"] if family == "llava" else build_tiny_llava_next(str(tmp_path / "llava_next"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    images = colour_images(3, sizes=((16, 16), (40, 16), (32, 32)))
    _, (prompt_ids, prompt_mask, truncated, image_rows) = llava_batch(
        path, images, ["what colour is this image", "what colour", "colour is it the red a blue"]
    )
    assert truncated == 0 and len(image_rows) == 3
    if family == "llava":
        assert image_rows[0]["pixel_values"].shape == (1, 3, 16, 16)
        assert (prompt_ids == 3).sum(1).tolist() == [4, 4, 4]  # each <image> expanded into its (16/8)^2 patch tokens
    else:
        assert [r["pixel_values"].shape[1] for r in image_rows] == [3, 3, 5]
        assert (prompt_ids == 3).sum(1).tolist() == [10, 14, 24]  # by the image's size and shape
    assert len(set(prompt_mask.sum(1).tolist())) == 3  # three lengths: left padding in two rows
    completion_ids = torch.tensor([[4, 5, 2], [6, 4, 2], [5, 5, 2]])
    together, alone = logprobs_alone_and_together(model, prompt_ids, prompt_mask, image_rows, completion_ids)
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    # and the images matter: the same shapes in other colours give other log-probs
    from PIL import Image

    recoloured = [Image.new("RGB", image.size, list(COLOURS.values())[(i + 1) % 3]) for i, image in enumerate(images)]
    other_rows = llava_batch(
        path, recoloured, ["what colour is this image", "what colour", "colour is it the red a blue"]
    )[1][3]
    other, _ = logprobs_alone_and_together(model, prompt_ids, prompt_mask, other_rows, completion_ids)
    assert (other - together).abs().max() > 1e-4


def test_adjacent_copies_of_a_prompt_share_their_image_tensors(tiny_vlm):
    """A group's G rows repeat one prompt: encoded once, the same tensors (no G-fold copy of the pixels)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm["policy"])
    prompt, images = [{"role": "user", "content": "what colour"}], colour_images(2)
    rows, tensors = image_prompt_rows(processor, [prompt] * 3 + [list(prompt)], [images[0]] * 3 + [images[1]], 64)
    assert tensors[0] is tensors[1] is tensors[2] and tensors[3] is not tensors[0]
    assert rows[0] == rows[3] and not torch.equal(tensors[0]["pixel_values"], tensors[3]["pixel_values"])


def test_image_tokens_are_never_sampled(tiny_vlm, tmp_path):
    """A policy whose favourite next token is <image> (its output embedding made huge) still never samples it: the
    generation configs suppress the ids the config names for images; vLLM's options bias them to -100."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm["policy"], dtype=torch.float32)
    image_id = model.config.image_token_id
    assert image_token_ids(model.config) == [image_id]
    with torch.no_grad():
        model.get_output_embeddings().weight[image_id] *= 1000  # tied: also its input embedding, harmless here
    _, (prompt_ids, prompt_mask, _, image_rows) = llava_batch(
        tiny_vlm, colour_images(2), ["what colour", "what colour"]
    )
    pixels = images_batch(image_rows, slice(0, None), "cpu", model.dtype)
    args = rloo.Args(max_completion_length=6, temperature=1.0)
    for never_sampled, expect_image in (([], True), (image_token_ids(model.config), False)):
        sampling, greedy, _ = generation_configs(
            [2], 0, never_sampled, **keywords_of(generation_configs, args, filters=args.filters())
        )
        for config in (sampling, greedy):
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **pixels)
            assert bool((out[:, prompt_ids.shape[1] :] == image_id).any()) == expect_image
    options = sampling_options([2], False, [image_id], **keywords_of(sampling_options, args))
    assert options["logit_bias"] == {image_id: -100.0}
    from vllm import SamplingParams

    assert SamplingParams(**options).logit_bias == {image_id: -100.0}  # the real vLLM takes them as they are


def build_tiny_qwen2_vl(path: str, family: str = "qwen2_vl"):
    """A tiny Qwen2-VL (its 3-axis mrope reads the image grid) and its image processor. Qwen2-VL's processor needs
    torchvision (its video processor), which has no CPU build here: the prompt ids are expanded by hand, each image's
    <|image_pad|> repeated grid_t * grid_h * grid_w / merge_size^2 times, as the processor does."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    template = VLM_CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    tokenizer = word_tokenizer(list(COLOURS) + "what colour is this image user assistant".split(), special, template)
    ids = {t: special.index(t) for t in special}
    config_class, model_class = (
        (Qwen2VLConfig, Qwen2VLForConditionalGeneration)
        if family == "qwen2_vl"
        else (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)
    )
    vision = (
        dict(
            depth=1,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_chans=3,
        )
        if family == "qwen2_vl"
        # Qwen2.5-VL: windowed attention
        else dict(
            depth=2,
            hidden_size=32,
            out_hidden_size=64,
            intermediate_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
            in_channels=3,
        )
    )
    config = config_class(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return path, tokenizer, image_processor


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_builds_its_own_positions_from_the_image_grid(family, tmp_path):
    """Qwen2-VL's (and Qwen2.5-VL's) rope has 3 axes laid out over each image's patch grid: the scripts give it no position_ids (it
    builds them from the mask and image_grid_thw, with mm_token_type_ids marking image tokens), and concatenate the
    rows' patches in row order (images of 1 and 4 merged patches). A left-padded batch then gives each row its
    log-probs alone, in bf16 as loaded from a hub-like checkpoint; generation never samples an image token."""
    from transformers import AutoModelForImageTextToText

    path, tokenizer, image_processor = build_tiny_qwen2_vl(str(tmp_path / family), family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype="auto")
    assert model.dtype == torch.bfloat16 and builds_own_positions(model)
    images = colour_images(3, sizes=((28, 28), (56, 56), (56, 28)))
    rows, image_rows = [], []
    for text, image in zip(["what colour is this image", "what colour", "colour red blue is it"], images):
        encoded = image_processor(images=[image], return_tensors="pt")
        patches = int(encoded["image_grid_thw"].prod()) // 4
        prompt = tokenizer.apply_chat_template(
            with_image_placeholders([{"role": "user", "content": text}], 1), tokenize=False, add_generation_prompt=True
        )
        rows.append(
            tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * patches), add_special_tokens=False)["input_ids"]
        )
        image_rows.append(dict(encoded))
    assert [int(r["image_grid_thw"].prod()) // 4 for r in image_rows] == [1, 4, 2]
    prompt_ids, prompt_mask = left_pad(rows, tokenizer.pad_token_id)
    completion_ids = torch.tensor([[7, 8, 2], [9, 7, 2], [8, 8, 2]])
    together, alone = logprobs_alone_and_together(model, prompt_ids, prompt_mask, image_rows, completion_ids)
    torch.testing.assert_close(together, alone, rtol=0, atol=0.02)  # bf16 weights, fp32 log-softmax
    # with LoRA adapters (--use_peft; B = 0: the same model) it still builds its own positions
    adapted = add_adapter(
        model,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target_modules=["q_proj", "v_proj"],
        lora_modules_to_save=None,
        use_dora=False,
        seed=1,
        model_path=path,
    )
    assert builds_own_positions(adapted)
    torch.testing.assert_close(
        logprobs_alone_and_together(adapted, prompt_ids, prompt_mask, image_rows, completion_ids)[0],
        together,
        rtol=0,
        atol=0,
    )
    args = rloo.Args(max_completion_length=4, temperature=1.0)
    sampling, _, _ = generation_configs(
        [2], 0, image_token_ids(model.config), **keywords_of(generation_configs, args, filters=args.filters())
    )
    pixels = images_batch(image_rows, slice(0, None), "cpu", model.dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight[model.config.image_token_id] *= 100
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=sampling,
            **vision_inputs(model, prompt_ids, pixels),
        )
    assert not torch.isin(out[:, prompt_ids.shape[1] :], torch.tensor(image_token_ids(model.config))).any()


def test_vllm_gets_the_images_in_its_own_input_format(tiny_vlm, monkeypatch):
    """rloo_vllm.py's colocated engine: each prompt as its token ids (image tokens expanded already) with its images
    as multi_modal_data, which the real vLLM's multi-modal parser accepts; the engine's folder holds the processor and
    vLLM keeps its tokenizer for it (EngineArgs built as the script builds them)."""
    import rloo_vllm
    from rloo_utils.vllm_colocated import ColocatedVLLM
    from vllm import EngineArgs
    from vllm.multimodal.parse import MultiModalDataParser

    class Recorder:  # the vllm.LLM's generate: what the engine would be handed
        def generate(self, inputs, params, use_tqdm):
            self.inputs = inputs
            return []

    engine = object.__new__(ColocatedVLLM)
    engine.llm = Recorder()
    images = colour_images(2)
    engine.generate([[1, 3, 3, 3, 3, 5], [1, 3, 3, 3, 3, 6]], {"max_tokens": 2}, [7, 8], [images[0], [images[1]]])
    first, second = engine.llm.inputs
    assert first["prompt_token_ids"] == [1, 3, 3, 3, 3, 5] and len(first["multi_modal_data"]["image"]) == 1
    parsed = MultiModalDataParser().parse_mm_data(second["multi_modal_data"])
    assert parsed.get_count("image") == 1
    # A real folder (config and processor, as the engine's): with HF_HUB_OFFLINE=1 EngineArgs resolves the model as a
    # local path or a cached hub id, and a made-up path is neither
    options = engine_options_of(rloo_vllm.Args(), tiny_vlm["policy"], torch.device("cpu"), multimodal=True)
    assert options["skip_tokenizer_init"] is False and EngineArgs(**options).skip_tokenizer_init is False


def test_a_vllm_server_gets_the_images_beside_the_token_ids(tiny_vlm):
    """rloo_vllm.py --vllm_mode server: an image prompt goes to vLLM's tokens-in route (vllm serve --enable-scale-out)
    as its token ids with its images as PNG data URLs; the body is one the real vLLM's request model accepts as it
    arrives over HTTP (n, seed, the image tokens' bias), and vLLM's media connector reads back the very pixels. (That
    route's sampling is held equal to /v1/completions' on a real server in tests/test_vllm.py.)"""
    import rloo_vllm
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.multimodal.media import MediaConnector

    image = colour_images(2, sizes=((20, 16),))[1]
    options = sampling_options(
        [2], False, [3], **keywords_of(sampling_options, rloo_vllm.Args(max_completion_length=3))
    )
    body = generate_request([1, 3, 3, 3, 3, 5], image, options, 7, 4)
    request = GenerateRequest.model_validate(json.loads(json.dumps(body)))
    params = request.sampling_params
    assert (request.token_ids, params.n, params.seed, params.logit_bias, params.logprobs) == (
        [1, 3, 3, 3, 3, 5],
        4,
        7,
        {3: -100.0},
        0,
    )
    decoded = MediaConnector().fetch_image(request.content_parts[0]["url"])
    assert decoded.size == (20, 16) and decoded.getpixel((5, 5)) == image.getpixel((5, 5))
    assert prompt_runs([[1], [1], [1], [1]], None, [image, image, "other", "other"]) == [(0, 2), (2, 4)]


def bad_vlm_data(tmp_path, rows, files=None):
    for name, content in (files or {}).items():
        with open(tmp_path / name, "wb") as f:
            f.write(content)
    return write_jsonl(str(tmp_path / "bad" / "train.jsonl"), rows)


CHAT = [{"role": "user", "content": "what colour is this image"}]


@pytest.mark.parametrize(
    "case",
    [
        "text model",
        "missing file",
        "a folder",
        "not an image",
        "string prompts",
        "both columns",
        "placeholders",
        "no image",
        "url",
        "no image processor",
        "too long",
    ],
)
@pytest.mark.slow
def test_bad_image_input_is_one_line(case, tiny_vlm, tiny, tmp_path):
    good = os.path.join(os.path.dirname(tiny_vlm["data"]), "images", "0.png")
    extra, needles = [], []
    data = tiny_vlm["data"]
    if case == "text model":
        extra, needles = (
            ["--model_name_or_path", tiny["policy"]],
            ["'image' column", "text-only model", "vision_config"],
        )
    elif case == "missing file":
        data = bad_vlm_data(tmp_path, [{"prompt": CHAT, "image": "nowhere.png"}])
        needles = ["nowhere.png (row 0) does not exist"]
    elif case == "a folder":  # not "does not exist": it does, as a folder
        os.makedirs(tmp_path / "bad" / "pictures")
        data = bad_vlm_data(tmp_path, [{"prompt": CHAT, "image": "pictures"}])
        needles = ["pictures (row 0) is a folder, not an image file"]
    elif case == "not an image":
        os.makedirs(tmp_path / "bad")
        data = bad_vlm_data(
            tmp_path,
            [{"prompt": CHAT, "image": good}, {"prompt": CHAT, "image": "junk.png"}],
            {"bad/junk.png": b"not a png at all"},
        )
        needles = ["junk.png (row 1) is not a readable image"]
    elif case == "string prompts":
        data = bad_vlm_data(tmp_path, [{"prompt": "what colour", "image": good}])
        needles = ["plain strings", "chat"]
    elif case == "both columns":
        data = bad_vlm_data(tmp_path, [{"prompt": CHAT, "image": good, "images": [good]}])
        needles = ["both an 'image' and an 'images' column"]
    elif case == "placeholders":
        two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what"}]}]
        data = bad_vlm_data(tmp_path, [{"prompt": two, "images": [good]}])
        needles = ["prompt 0 holds 2 image placeholders for 1 images"]
    elif case == "no image":
        data = bad_vlm_data(tmp_path, [{"prompt": CHAT, "images": [good]}, {"prompt": CHAT, "images": []}])
        needles = ["row 1 has no image"]
    elif case == "url":
        data = bad_vlm_data(tmp_path, [{"prompt": CHAT, "image": "https://example.com/cat.png"}])
        needles = ["not a file", "download the images first"]
    elif case == "no image processor":
        stripped = tmp_path / "llava_without_processor"
        shutil.copytree(tiny_vlm["policy"], stripped)
        os.remove(stripped / "processor_config.json")
        extra, needles = ["--model_name_or_path", stripped], ["has no image processor"]
    elif case == "too long":
        extra, needles = ["--max_prompt_length", 8], ["over --max_prompt_length 8", "raise --max_prompt_length"]
    proc = vlm_run(tiny_vlm, tmp_path, "--dataset_name", data, *extra)
    check_one_line_error(proc, *needles)


@pytest.mark.slow
def test_a_text_reward_model_scores_the_text_of_image_prompts(tiny_vlm, tiny, tmp_path):
    """A reward model reads text, as in TRL: beside a VLM it scores the prompt's text parts and the completion through
    its own tokenizer, with no image token; the reward function still gets the images."""
    proc = vlm_run(
        tiny_vlm, tmp_path, "--reward_model_path", tiny["reward"], "--total_episodes", 64, "--run_name", "rm"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(f"rewards/{name}/mean" in rows[0] for name in ("reward", "colour_named"))
    args = rloo.Args(model_name_or_path=tiny_vlm["policy"], reward_model_path=tiny["reward"])
    tokenizer = load_tokenizers([{"role": "user", "content": "hi"}], "image", **keywords_of(load_tokenizers, args))[1]
    ids, _ = reward_model_inputs(
        tokenizer,
        [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}]],
        ["red"],
        torch.tensor([True]),
    )
    texts = tokenizer.decode(ids[0])
    assert "what colour" in texts and "red" in texts and "image" not in texts
