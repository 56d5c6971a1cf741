"""Win rate of a model's completions against a dataset's reference completions, judged by an LLM behind an
OpenAI-compatible endpoint (a local `vllm serve`, or a hosted API), as the seed's TL;DR evaluation.

    python benchmark/judge.py --model_name_or_path runs/<run_name>/model --dataset_name trl-lib/tldr \
        --dataset_split test --judge_base_url https://api.openai.com/v1 --judge_model gpt-4o-mini --num_examples 1000
    python benchmark/judge.py --model_name_or_path runs/<run_name>/model --dataset_name data/tldr \
        --judge_base_url http://127.0.0.1:8000/v1 --judge_model Qwen/Qwen2.5-7B-Instruct --judge_choice

The model completes the first --num_examples prompts of the split (vLLM, or HF generate with --generator hf; greedy
unless --temperature is set). For each prompt the judge sees the prompt and the two completions, the model's first or
second by a coin flip (seeded), and answers which is better: "0" or "1". The win rate is the fraction of judged pairs
the model's completion wins, with a 95% Wilson interval; an answer that is neither 0 nor 1 is counted apart and left
out. --judge_choice constrains the answer to 0 or 1 (vLLM's structured outputs: a vLLM server only). --output keeps
every pair, the judge's answer and the verdict as JSON lines. The API key is --judge_api_key or OPENAI_API_KEY.
"""

import argparse
import concurrent.futures
import json
import math
import os
import random
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SYSTEM_PROMPT = (
    "You compare two responses to the same prompt. The better response is the one a careful reader would "
    "prefer: it does what the prompt asks, it is accurate and faithful to the prompt, and it is clear and "
    "concise. Answer with the number of the better response, 0 or 1, and nothing else."
)
USER_PROMPT = (
    "## Prompt\n{prompt}\n\n## Response 0\n{first}\n\n## Response 1\n{second}\n\nWhich response is better, 0 or 1?"
)


class JudgeError(Exception):
    pass


def as_text(value) -> str:
    """A prompt or completion as the judge reads it: a string, or chat messages as `role: content` lines."""
    if isinstance(value, str):
        return value
    return "\n".join(f"{m['role']}: {m['content']}" for m in value)


def reference_text(value) -> str:
    """The reference completion: a string, or the content of the last message of a conversation."""
    return value if isinstance(value, str) else value[-1]["content"]


def generate_hf(
    model_path: str,
    prompts: list,
    max_new_tokens: int,
    temperature: float,
    max_prompt_length: int,
    batch_size: int,
    seed: int,
) -> list[str]:
    """The model's completion of each prompt with HF generate, batch by batch (left-padded), stopping at its EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rloo_utils.models import from_pretrained
    from rloo_utils.generation import end_token_ids, tokenize_prompts
    from rloo_utils.rollouts import completion_mask_from

    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = from_pretrained(AutoTokenizer, model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = from_pretrained(AutoModelForCausalLM, model_path).to(device).eval()
    _, stop_ids = end_token_ids(tokenizer, model.generation_config.eos_token_id, None, False)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, **sampling
    )
    texts = []
    for i in range(0, len(prompts), batch_size):
        ids, mask, _, _ = tokenize_prompts(tokenizer, prompts[i : i + batch_size], max_prompt_length, device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
        completion_mask, _ = completion_mask_from(out, stop_ids, stop_ids)
        texts += tokenizer.batch_decode(
            out * completion_mask + tokenizer.pad_token_id * (1 - completion_mask), skip_special_tokens=True
        )
    return texts


def vllm_environment() -> bool:
    """Set vLLM's CPU backend up when there is no GPU (a bounded KV cache, torch's threads left as they are), before
    vLLM is imported; returns whether it runs on the CPU."""
    import torch

    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return cpu


def check_vllm() -> None:
    """--generator vllm (the default): vLLM imports here, checked before the model loads."""
    vllm_environment()
    try:
        import vllm  # noqa: F401
    except (ImportError, OSError) as e:  # not installed, or a build that does not match this machine (its libraries)
        raise JudgeError(
            f"--generator vllm (the default) needs vLLM, which cannot be imported here ({e}): install it "
            "(pip install vllm), or give --generator hf (transformers' generate)"
        ) from None


def check_model_folder(path: str, generator: str) -> None:
    """A local --model_name_or_path must hold a model (config.json, or a LoRA adapter's adapter_config.json, which
    HF generate loads on its base but a vLLM engine cannot): a run folder or an unfinished run is named as such,
    rather than left to the tokenizer's error."""
    from rloo_utils.checkpoints import checkpoint_dirs, is_saved_model

    if generator == "vllm" and os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise JudgeError(
            f"--model_name_or_path {path} holds a LoRA adapter, which a vLLM engine does not load as a "
            "model: give its merged model (a --use_peft run with --save_merged_model writes it to "
            "<model>/merged), or --generator hf"
        )
    if not os.path.isdir(path) or any(
        os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")
    ):
        return  # a hub id, a .gguf file, a model: loading it says what is wrong, if anything
    given = f"--model_name_or_path {path} holds no trained model (no config.json)"
    model, checkpoints = os.path.join(path, "model"), checkpoint_dirs(path)
    if is_saved_model(model):
        raise JudgeError(f"{given}: it is a run folder, whose model is {model}: give that")
    if checkpoints:
        policy = os.path.join(checkpoints[-1], "policy")
        if is_saved_model(policy):
            raise JudgeError(
                f"{given}: it is the folder of a run that has not finished; its newest checkpoint's model "
                f"is {policy}: give that, or continue the run to its end"
            )
        raise JudgeError(
            f"{given}: it is the folder of a run that has not finished, and its newest checkpoint "
            f"{checkpoints[-1]} holds sharded weights (dcp/), not a model: continue the run to its end"
        )
    if os.path.isdir(model) or os.path.isfile(os.path.join(path, "args.json")):
        raise JudgeError(f"{given}: it is the folder of a run that has not finished and has no checkpoint yet")
    raise JudgeError(f"{given}: give the folder a run saved its model in (runs/<run_name>/model), or a hub id")


def generate_vllm(
    model_path: str, prompts: list, max_new_tokens: int, temperature: float, max_prompt_length: int, seed: int
) -> list[str]:
    """The model's completion of each prompt with a vLLM engine in this process (the same prompt tokens as HF)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from rloo_utils.generation import end_token_ids, tokenize_prompts
    from rloo_utils.models import from_pretrained

    cpu = vllm_environment()
    from vllm import LLM, SamplingParams

    tokenizer = from_pretrained(AutoTokenizer, model_path)
    ids, mask, _, _ = tokenize_prompts(tokenizer, prompts, max_prompt_length, torch.device("cpu"))
    try:  # the EOS ids the model declares, as HF generate stops at them
        model_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        model_eos = None
    _, stop_ids = end_token_ids(tokenizer, model_eos, None, False)
    llm = LLM(
        model=model_path,
        seed=seed,
        dtype="float32" if cpu else "auto",
        enforce_eager=cpu,
        max_model_len=ids.shape[1] + max_new_tokens,
    )
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, stop_token_ids=stop_ids, seed=seed)
    outputs = llm.generate([{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)], params)
    return [o.outputs[0].text for o in outputs]


def post_json(url: str, body, api_key, timeout: float, retries: int = 5):
    """GET (body None) or POST JSON; retries a rate limit, a server error or a timeout, with growing pauses."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as e:
            if e.code not in (408, 429, 500, 502, 503, 504) or attempt == retries:
                raise JudgeError(f"{url} answered HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if attempt == retries:
                raise JudgeError(f"{url} does not answer ({getattr(e, 'reason', e)})") from None
        time.sleep(min(60.0, 2.0**attempt))


def check_judge(base_url: str, model: str, api_key) -> None:
    """The endpoint answers /models and serves the judge model (before any generation)."""
    served = [m["id"] for m in post_json(f"{base_url}/models", None, api_key, timeout=30, retries=1).get("data", [])]
    if model not in served:
        raise JudgeError(
            f"the judge at {base_url} does not serve --judge_model {model}; it serves "
            f"{', '.join(served[:10]) or 'nothing'}"
        )


def ask_judge(base_url: str, model: str, api_key, prompt: str, first: str, second: str, choice: bool) -> str:
    """The judge's raw answer to one comparison."""
    body = {
        "model": model,
        "temperature": 0,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT.format(prompt=prompt, first=first, second=second)},
        ],
    }
    if choice:
        body["structured_outputs"] = {"choice": ["0", "1"]}
    return (
        post_json(f"{base_url}/chat/completions", body, api_key, timeout=300)["choices"][0]["message"]["content"] or ""
    )


def verdict(answer: str):
    """0 or 1 from the judge's answer, None when it says neither."""
    answer = answer.strip().strip(".").strip()
    return int(answer) if answer in ("0", "1") else None


def wilson_interval(wins: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (Wilson 1927): well behaved for small n and rates near 0 or 1."""
    if n == 0:
        return 0.0, 1.0
    p = wins / n
    centre, half = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n),
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def release_output(path) -> None:
    """The --output this evaluation claimed (empty) is removed when it stops with an error, so that a rerun may use it."""
    if path and os.path.isfile(path) and os.path.getsize(path) == 0:
        os.remove(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = lambda message: sys.exit(f"judge.py: error: {message}")  # one line, no usage block
    parser.add_argument("--model_name_or_path", required=True, help="the model to evaluate (a folder or a hub id)")
    parser.add_argument("--dataset_name", required=True, help="a hub dataset or local data, as rloo.py reads it")
    parser.add_argument("--dataset_split", default="test")
    parser.add_argument("--reference_column", default="completion", help="the column of reference completions")
    parser.add_argument("--num_examples", type=int, default=1000)
    parser.add_argument("--generator", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--max_new_tokens", type=int, default=53)
    parser.add_argument("--max_prompt_length", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--batch_size", type=int, default=16, help="prompts per HF generate call")
    parser.add_argument(
        "--judge_base_url", required=True, help="e.g. https://api.openai.com/v1 or http://127.0.0.1:8000/v1"
    )
    parser.add_argument("--judge_model", required=True)
    parser.add_argument("--judge_api_key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--judge_choice", action="store_true", help="constrain the answer to 0 or 1 (vLLM server)")
    parser.add_argument("--judge_concurrency", type=int, default=8, help="requests to the judge at once")
    parser.add_argument("--seed", type=int, default=1, help="of the positions and of sampling")
    parser.add_argument("--output", default=None, help="a new .jsonl file for every judged pair")
    cli = parser.parse_args(argv)
    if min(cli.num_examples, cli.judge_concurrency, cli.batch_size, cli.max_new_tokens, cli.max_prompt_length) < 1:
        parser.error(
            "--num_examples, --judge_concurrency, --batch_size, --max_new_tokens and --max_prompt_length must "
            "be at least 1"
        )
    if not cli.temperature >= 0:
        parser.error(f"--temperature must be 0 (greedy) or more, got {cli.temperature}")
    if cli.output and os.path.exists(cli.output):
        parser.error(f"--output {cli.output} exists: give a new file name")
    base_url = cli.judge_base_url.rstrip("/")
    cli.model_name_or_path = os.path.expanduser(cli.model_name_or_path)  # (~: for the checks and every load)

    from rloo_utils.data import load_prompt_dataset
    from rloo_utils.errors import UsageError
    from rloo_utils.models import from_pretrained

    try:  # everything that can be refused is checked before the model generates
        if cli.generator == "vllm":
            check_vllm()
        check_judge(base_url, cli.judge_model, cli.judge_api_key)
        dataset = load_prompt_dataset(os.path.expanduser(cli.dataset_name), cli.dataset_split)
        if dataset is None:
            raise JudgeError(f"dataset {cli.dataset_name} has no split {cli.dataset_split!r}: give --dataset_split")
        if cli.reference_column not in dataset.column_names:
            raise JudgeError(
                f"dataset {cli.dataset_name} (split {cli.dataset_split}) has no column "
                f"{cli.reference_column!r}; its columns are {dataset.column_names}: give --reference_column"
            )
        from transformers import AutoTokenizer

        check_model_folder(cli.model_name_or_path, cli.generator)
        from_pretrained(AutoTokenizer, cli.model_name_or_path)  # the model is there (its tokenizer loads)
        if cli.output:
            open(cli.output, "x").close()  # claimed now, so that a second evaluation cannot write it too
    except (JudgeError, UsageError, OSError) as e:
        parser.error(str(e))
    try:
        return evaluate(cli, dataset, base_url)
    except BaseException:  # an error, Ctrl-C: the claimed --output (still empty) goes, so that a rerun may use it
        release_output(cli.output)
        raise


def evaluate(cli, dataset, base_url: str) -> int:
    """Generate, judge, write --output and print the win rate."""
    from rloo_utils.errors import UsageError

    dataset = dataset.select(range(min(cli.num_examples, len(dataset))))
    prompts, references = dataset["prompt"], [reference_text(r) for r in dataset[cli.reference_column]]

    print(f"generating {len(prompts)} completions with {cli.generator} ...", flush=True)
    try:
        if cli.generator == "vllm":
            completions = generate_vllm(
                cli.model_name_or_path, prompts, cli.max_new_tokens, cli.temperature, cli.max_prompt_length, cli.seed
            )
        else:
            completions = generate_hf(
                cli.model_name_or_path,
                prompts,
                cli.max_new_tokens,
                cli.temperature,
                cli.max_prompt_length,
                cli.batch_size,
                cli.seed,
            )
    except UsageError as e:  # a tokenizer without a model beside it, damaged weights...
        sys.exit(f"judge.py: error: {e}")

    rng = random.Random(cli.seed)
    model_first = [rng.random() < 0.5 for _ in prompts]  # the model's completion is response 0, else response 1
    pairs = [(c, r) if first else (r, c) for c, r, first in zip(completions, references, model_first)]
    print(f"asking {cli.judge_model} about {len(pairs)} pairs ...", flush=True)
    with concurrent.futures.ThreadPoolExecutor(cli.judge_concurrency) as pool:
        try:
            answers = list(
                pool.map(
                    lambda i: ask_judge(
                        base_url, cli.judge_model, cli.judge_api_key, as_text(prompts[i]), *pairs[i], cli.judge_choice
                    ),
                    range(len(pairs)),
                )
            )
        except JudgeError as e:
            sys.exit(f"judge.py: error: {e}")
    verdicts = [verdict(a) for a in answers]
    wins = sum(v == (0 if first else 1) for v, first in zip(verdicts, model_first) if v is not None)
    judged = sum(v is not None for v in verdicts)
    if cli.output:
        with open(cli.output, "w") as f:
            for i, (answer, v) in enumerate(zip(answers, verdicts)):
                f.write(
                    json.dumps(
                        {
                            "prompt": as_text(prompts[i]),
                            "model": completions[i],
                            "reference": references[i],
                            "model_position": 0 if model_first[i] else 1,
                            "answer": answer,
                            "model_wins": None if v is None else v == (0 if model_first[i] else 1),
                        }
                    )
                    + "\n"
                )
    low, high = wilson_interval(wins, judged)
    rate = f"{100 * wins / judged:.2f}%" if judged else "n/a"
    print(
        f"Model win rate: {rate} (95% CI {100 * low:.1f}-{100 * high:.1f}%; {wins} of {judged} judged pairs, "
        f"{len(pairs) - judged} answers neither 0 nor 1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
