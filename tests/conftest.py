"""Fixtures: a tiny Llama policy, its tokenizer and a reward model, built locally in a second (nothing downloaded).

And what keeps the tests apart: one thread per process (two xdist workers share the 2 cores of CI, and so do the script
runs and servers they start), vLLM's usage statistics off, the environment put back after each test, and the `slow`
mark held honest: a test that starts a training process, torchrun or vLLM must carry it (`pytest -m "not slow"` is the
fast tier, docs/tests.md)."""

import glob
import importlib
import inspect
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Optional

import pytest

# Before torch is imported anywhere in this process: its thread pool reads OMP_NUM_THREADS once. Every process the tests
# start inherits these (a test about threads sets its own).
os.environ.update(
    OMP_NUM_THREADS="1",
    MKL_NUM_THREADS="1",
    VLLM_NO_USAGE_STATS="1",  # vLLM reports usage to its authors unless told not to
    DO_NOT_TRACK="1",
    TOKENIZERS_PARALLELISM="false",
)
ORIGINAL_ENVIRONMENT = dict(os.environ)
# The seconds a test waits at most on a thread, a queue or a process that answers at once when all is well (a rollout
# made in the rollout queue's thread, a helper's "ready"): a wait that would hang fails its test within a minute
WAIT = 60
SESSION_CACHE = None  # pytest_configure's

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPTS = [
    "rloo.py",
    "rloo_vllm.py",
    "rloo_multigpu.py",
]  # each holds the whole algorithm (tests/test_scripts_in_step.py)

# The longest files first: under the README's `-n 2 --dist loadfile --no-loadscope-reorder` each worker takes the next
# file when it is done, so that the two end together instead of one running the last long file alone. The order is that
# of the per-file seconds of docs/tests.md ("Where the time goes", issue 59's run; `python tests/durations.py` prints them).
LONGEST_FIRST = [
    "test_benchmark.py",
    "test_multigpu.py",
    "test_vllm.py",
    "test_resume.py",
    "test_gpu_check.py",
    "test_lora.py",
    "test_tools.py",
    "test_end_to_end.py",
    "test_evaluation.py",
    "test_bad_input.py",
    "test_trl_switch.py",
    "test_images.py",
    "test_precision.py",
    "test_vllm_lora.py",
    "test_gguf_cache.py",
    "test_padding_free.py",
    "test_rollouts.py",
    "test_sandbox.py",  # issue 71's, placed by their time on the CPU of their session, not yet in docs/tests.md
    "test_math_reward.py",
    "test_static_cache.py",
    "test_batch_split.py",
    "test_dynamic_sampling.py",
    "test_real_use.py",
    "test_verifiable.py",
    "test_algorithm_family.py",
    "test_openrlbenchmark.py",
    "test_sharded_loading.py",
]


# The fixtures of a vLLM server (a worker's tests share one, test_tools.py's tests the vault's), started at first use
SERVERS = {"server", "dying_server", "lora_server", "vault_server"}


def pytest_collection_modifyitems(items):
    def rank(item):
        name = os.path.basename(str(item.path))
        # In a file, the tests that need no server first: the server starts with the first test that asks for it
        file_rank = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return file_rank, bool(SERVERS & set(item.fixturenames))

    items.sort(key=rank)  # stable: otherwise each file's tests keep their order


# Every test, its fixtures included, ends within this many seconds (pytest-timeout) or fails: a deadlock costs its test
# 10 minutes, not CI its limit. 5x the slowest test but one (56-111 s, docs/tests.md's tables), and room for the shared
# server's start (300 s at most) before a worker's first test that uses it; a test that needs longer says so with
# @pytest.mark.timeout(N) (tests/test_gpu_check.py's kit).
TEST_TIMEOUT = 600


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout's own, which reads the options
def pytest_configure(config):
    # The signal method, on purpose: at the limit SIGALRM raises in the test (xdist runs tests in its workers' main
    # thread), so its `finally` blocks and its fixtures' teardown kill what it started (servers' process groups,
    # torchrun's workers, subprocess.run's child) and the worker goes on to the next test. The thread method's
    # os._exit would leave them running on the 2 cores and lose the worker. --timeout or PYTEST_TIMEOUT still win.
    if config.getoption("timeout", None) is None and "PYTEST_TIMEOUT" not in os.environ:
        config.option.timeout = TEST_TIMEOUT
    if config.getoption("timeout_method", None) is None:
        config.option.timeout_method = "signal"
    config.addinivalue_line(
        "markers", "slow: starts a training process, torchrun or vLLM (`-m 'not slow'` is the fast tier)"
    )
    config.addinivalue_line("markers", "learning: a run whose reward must rise (docs/tests.md, 5 seeds of each)")
    # The de-quantised copies of .gguf files (rloo_utils/gguf_cache.py: the embedded default's) in one folder for the
    # session, never the user's ~/.cache: made by the controlling process before it starts the xdist workers, which
    # inherit it, as does every run they start (the first run that loads SmolLM2 makes its copy, the others start from
    # it); removed at the end by the process that made it. A RLOO_CACHE given (a folder, or off) is kept. (Here, not
    # at import: the benchmark scripts import this file.)
    global SESSION_CACHE
    if "RLOO_CACHE" not in os.environ:
        SESSION_CACHE = tempfile.mkdtemp(prefix="rloo-test-cache-")
        os.environ["RLOO_CACHE"] = ORIGINAL_ENVIRONMENT["RLOO_CACHE"] = SESSION_CACHE


def pytest_unconfigure(config):
    if SESSION_CACHE is not None:
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--learning_seed", type=int, default=1, help="the seed of the learning tests' runs (docs/tests.md: 1 to 5)"
    )
    parser.addoption(
        "--learning_record", default=None, help="append each learning test's rewards to this JSON lines file"
    )


# A command starts a run when Python (or bash) runs a script of this repository with it (a training script, a benchmark,
# an experiment, a helper the tests run as a user would), or it is torchrun or vLLM.
REPOSITORY_SCRIPTS = {
    os.path.basename(path)
    for pattern in ("*.py", "benchmark/*.py", "benchmark/gpu/*.py", "benchmark/experiments/*.sh", "tests/*.py")
    for path in glob.glob(os.path.join(ROOT, pattern))
}


def what_it_starts(args) -> str | None:
    """The script, module or program that makes a command (a list, or a shell line) a run, or None."""
    if isinstance(args, (str, bytes)):
        pieces = shlex.split(args.decode() if isinstance(args, bytes) else args)
    else:
        pieces = [os.fspath(word) for word in ([args] if isinstance(args, os.PathLike) else args)]
    command = []
    for piece in [*pieces, ";"]:
        if piece not in ("&&", "||", ";", "|"):
            command.append(piece)
            continue
        program, rest = (os.path.basename(command[0]), command[1:]) if command else ("", [])
        if program in ("torchrun", "vllm"):
            return program
        if re.fullmatch(r"python[0-9.]*|bash|sh", program):
            options = list(itertools.takewhile(lambda word: word.startswith("-"), rest))
            target = rest[len(options)] if len(options) < len(rest) else ""  # after -m a module, else a script
            if options[-1:] == ["-m"] and (target == "torch.distributed.run" or target.split(".")[0] == "vllm"):
                return target
            if not {"-c", "-m"} & set(options) and os.path.basename(target) in REPOSITORY_SCRIPTS:
                return target
        command = []
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around each test, its fixtures included: its environment put back after it (in-process vLLM engines and
    rloo_multigpu.py's main() write OMP_NUM_THREADS, VLLM_*, RANK, ... into os.environ, which every later test of this
    worker and every process it starts would inherit), and, unless it is marked slow, no run started."""
    environment = dict(os.environ)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    real_popen = subprocess.Popen
    if item.get_closest_marker("slow") is None:

        class Unmarked(real_popen):
            def __init__(self, args, *more, **options):
                started = what_it_starts(args)
                if started:
                    pytest.fail(
                        f"{item.nodeid} starts {started}: mark it @pytest.mark.slow (the fast tier starts none)"
                    )
                super().__init__(args, *more, **options)

        subprocess.Popen = Unmarked
    try:
        yield
    finally:
        subprocess.Popen = real_popen
        if os.environ != environment:
            os.environ.clear()
            os.environ.update(environment)
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the movie was good great bad awful fine happy sad long short plot actor film story scene ending music "
    "funny boring love hate beautiful terrible a an and but or so it is was this that very really quite"
).split()


def build_tiny_models(path: str) -> dict:
    """Write a ~2M-parameter Llama policy + tokenizer to path/policy and a reward model to path/reward."""
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    policy_dir, reward_dir = os.path.join(path, "policy"), os.path.join(path, "reward")
    LlamaForCausalLM(config).save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    reward = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1)
    reward.save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    return {"policy": policy_dir, "reward": reward_dir, "tokenizer": tokenizer}


def build_reward_model_with_its_own_tokenizer(path: str) -> str:
    """A reward model whose tokenizer is not the policy's (another vocabulary and special tokens, adding a BOS), as a
    Llama reward model scoring a Qwen policy: rloo.py must hand it text, not the policy's token ids."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [" ".join(WORDS[::-1])] * 50,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def run_rloo_vllm_in_process(monkeypatch, argv: list, cwd, make_engine, check_engine) -> None:
    """rloo_vllm.main run in this process on argv, in cwd, its colocated engine made by make_engine (in
    ColocatedVLLM's place: called with its arguments) and the check of the engine's log-probs, which needs vLLM's own
    engine, replaced by check_engine; W&B offline, the run's guard and its Ctrl-C handlers undone after."""
    import signal

    import rloo_vllm
    from rloo_utils import options, vllm_sampling
    from rloo_utils.lifecycle import RunGuard

    with monkeypatch.context() as patched:
        patched.setattr(vllm_sampling, "ColocatedVLLM", make_engine)  # where VLLMSampler makes its engine
        patched.setattr(vllm_sampling, "check_engine", check_engine)
        patched.setattr(RunGuard, "active", None)  # (the run's guard is undone with the rest)
        patched.setenv("WANDB_MODE", "offline")
        patched.chdir(cwd)
        patched.setattr(sys, "argv", ["rloo_vllm.py", *map(str, argv)])
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            rloo_vllm.main(options.parse_args(rloo_vllm.Args))
        finally:
            for s, handler in handlers.items():  # the run's Ctrl-C handling ends with it
                signal.signal(s, handler)


def keywords_of(function, args, /, **given) -> dict:
    """The keyword-only parameters of `function` (rloo_utils' functions take the options they read by name, a class
    its __init__'s), each the option of its name in `args` (a script's Args, or a namespace of the fields read), but
    those `given`."""
    parameters = inspect.signature(function).parameters.values()
    names = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return {name: given[name] if name in given else getattr(args, name) for name in names}


def engine_options_of(args, config_folder: str, device, **kwargs) -> dict:
    """vllm_colocated.engine_options as ColocatedVLLM starts the engine of a script's options (Args)."""
    from rloo_utils.vllm_colocated import engine_dtype, engine_max_model_len, engine_options

    return engine_options(
        config_folder,
        device,
        **kwargs,
        seed=args.seed,
        dtype=engine_dtype(args.vllm_dtype),
        trust_remote_code=args.trust_remote_code,
        max_model_len=engine_max_model_len(**keywords_of(engine_max_model_len, args)),
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        enforce_eager=args.vllm_enforce_eager,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
    )


@pytest.fixture(params=[script[: -len(".py")] for script in SCRIPTS])
def each_script(request, monkeypatch):
    """Runs a test of the shared functions once per script: the test module's `rloo` is each script in turn."""
    module = importlib.import_module(request.param)
    monkeypatch.setattr(request.module, "rloo", module)
    return module


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return build_tiny_models(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def other_reward(tmp_path_factory):
    return build_reward_model_with_its_own_tokenizer(str(tmp_path_factory.mktemp("other_reward")))


def write_tiny_gguf(path: str, tokenizer, layers: int = 2, hidden: int = 64, ffn: int = 128) -> str:
    """A ~50k-parameter Llama as llama.cpp writes one (SmolLM2's layout: the tiny tokenizer as a "gpt2" BPE, the
    embeddings in Q8_0, the other matrices in Q4_1, the norms in F32, random weights), which transformers reads and
    de-quantises in a fraction of a second: the GGUF path of SmolLM2 at the cost of the tiny model."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    special = {t.content for t in tokenizer.added_tokens_decoder.values()}
    heads, kv_heads, head_dim = 2, 1, hidden // 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control (special) tokens
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_unk_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)

    def add(name, shape, kind):
        weights = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        writer.add_tensor(name, quantize(weights, kind), raw_dtype=kind)

    Q8_0, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    add("token_embd.weight", (len(tokens), hidden), Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + rng.standard_normal(hidden) * 0.1).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, shape in [
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv_heads * head_dim, hidden)),
            ("attn_v", (kv_heads * head_dim, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ]:
            add(f"blk.{i}.{name}.weight", shape, Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tiny, tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp("tiny_gguf") / "tiny.Q4_1.gguf"), tiny["tokenizer"])


def write_prompts(path: str) -> str:
    """The tests' 64 prompts of 3 to 9 random words, each with a `topic` column; returns the path."""
    rng = __import__("random").Random(1)
    rows = [
        {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))), "topic": rng.choice(["a", "b"])}
        for _ in range(64)
    ]
    return write_jsonl(path, rows)


def build_tiny_task(out: str) -> None:
    """The benchmark experiments' cheap task: the tiny models in <out>/tiny and the tests' prompts in
    <out>/prompts.jsonl."""
    build_tiny_models(os.path.join(out, "tiny"))
    write_prompts(os.path.join(out, "prompts.jsonl"))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    return write_prompts(str(tmp_path_factory.mktemp("data") / "prompts.jsonl"))


def run_env() -> dict:
    return {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}


def run_rloo(*args, cwd, timeout=600, script="rloo.py"):
    """Run a script as a user would; returns the CompletedProcess (stdout and stderr captured as text)."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *map(str, args)],
        cwd=cwd,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_one_line_error(proc, *needles):
    """A refusal: non-zero exit, no traceback, one `error:` line that holds every needle."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def read_metrics(run_root) -> list[dict]:
    """The updates' rows of the one run under run_root (a run on a dataset with a test split also logs rows of its
    held-out evaluations: tests/test_evaluation.py reads those)."""
    runs = os.path.join(run_root, "runs")
    (run,) = os.listdir(runs)
    with open(os.path.join(runs, run, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "episode" in row]


def run_outcome(run_dir: str):
    """What two runs must share to be the same run: every logged metric but the wall-clock ones, the sample tables,
    and the final weights."""
    from safetensors.torch import load_file

    wall_clock = lambda k: k in ("eps", "step_time", "eval/seconds") or k.startswith(("perf/", "time/"))  # noqa: E731
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [{k: v for k, v in json.loads(line).items() if not wall_clock(k)} for line in f]
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        samples = f.read()
    return metrics, samples, load_file(os.path.join(run_dir, "model", "model.safetensors"))


def wait_for_updates(proc: subprocess.Popen, metrics, n: int, timeout: float = 300) -> None:
    """Wait until the running script `proc` has logged n updates to metrics (a Path); fail if it ends first."""
    deadline = time.time() + timeout
    while not (metrics.exists() and sum('"episode"' in line for line in open(metrics)) >= n):  # (not evaluations)
        if proc.poll() is not None:
            raise AssertionError(
                "the run ended before it could be interrupted"
                + (f": {proc.communicate(timeout=WAIT)[1][-3000:]}" if proc.stderr else "")
            )
        assert time.time() < deadline, f"no {n} updates logged in {timeout} s"
        time.sleep(0.02)


# ---- Learning tests: a dense task that the tiny model learns on every seed in 12 updates ---------------------------
def learning_task(policy: str, data: str, seed: int, per_device_train_batch_size: int = 32) -> list:
    """12 updates of 32 completions (8 prompts x 4) of up to 8 tokens at lr 1e-2, no KL, rewarded by count_symbols
    (tests/reward_fixtures.py): how many of the 32 one-character tokens "!" to "@" a completion writes, ~0.6 at first."""
    return [
        "--model_name_or_path",
        policy,
        "--dataset_name",
        data,
        "--reward_funcs",
        os.path.join(ROOT, "tests", "reward_fixtures.py") + ":count_symbols",
        "--total_episodes",
        384,
        "--per_device_train_batch_size",
        per_device_train_batch_size,
        "--max_completion_length",
        8,
        "--learning_rate",
        "1e-2",
        "--num_generations",
        4,
        "--beta",
        0,
        "--num_sample_generations",
        0,
        "--seed",
        seed,
    ]


@pytest.fixture
def learning_seed(request) -> int:
    return request.config.getoption("learning_seed")


def check_learned(request, rewards: list[float], gain: float, window: int = 3, above: float | None = None) -> None:
    """The mean reward of the last `window` updates passes that of the first by `gain` (and `above`, where given), a
    margin under what each learning test reached on every one of seeds 1 to 5 (docs/tests.md); with
    --learning_record, the rewards are kept there."""
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    record = request.config.getoption("learning_record")
    if record:
        with open(record, "a") as f:
            seed = request.config.getoption("learning_seed")
            test = request.node.nodeid
            f.write(json.dumps({"test": test, "seed": seed, "first": first, "last": last, "rewards": rewards}) + "\n")
    assert last > first + gain and (above is None or last > above), (first, last, rewards)


def first_line(pipe, seconds: float) -> str:
    """A child's first line from its pipe, waited for `seconds` at most: a child that never prints one fails the test
    instead of hanging it (readline() alone waits for ever)."""
    ready, _, _ = select.select([pipe], [], [], seconds)
    assert ready, f"no line from the process in {seconds} s"
    return pipe.readline()


def join_processes(context, seconds: float) -> None:
    """Wait `seconds` at most for the processes of torch.multiprocessing.start_processes(..., join=False): one that
    fails is raised (torch's ProcessRaisedException), one still running at the limit fails the test; either way none
    is left running (start_processes' own join waits for ever)."""
    deadline = time.monotonic() + seconds
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the processes did not end within {seconds} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=WAIT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(
    tiny, tmp_path_factory, logprobs_mode: str = "processed_logprobs", max_lora_rank: Optional[int] = None
):
    """vLLM's OpenAI-compatible server on the tiny model, as docs/vllm.md starts it, for a fixture; stopped at the end.
    logprobs_mode: what a server started otherwise than docs/vllm.md says returns; max_lora_rank: a server that loads
    adapters of up to this rank at run time, as docs/lora.md starts it for the adapter push (--vllm_lora_push)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        tiny["policy"],
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--max-model-len",
        "512",
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        logprobs_mode,
        "--enable-scale-out",
        *(("--enable-lora", "--max-lora-rank", str(max_lora_rank)) if max_lora_rank else ()),
    ]
    env = {
        **run_env(),
        "VLLM_SERVER_DEV_MODE": "1",
        **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if max_lora_rank else {}),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # The model runs in the engine's process: with its own worker process (vLLM's default on CPU), the worker spins
        # on their shared-memory queue for 1 s after every step, 1 s of a core per request that took 0.1 s
        # (docs/tests.md, "Servers")
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    proc = subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, open(log).read()[-3000:]
            assert time.time() < deadline, "the vLLM server did not start in 300 s"
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(1)
        yield {"url": url, "process": proc, "log": log}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)


@pytest.fixture(scope="session")
def server(tiny, tmp_path_factory):
    """The tiny model's vLLM server, one for all the tests of a pytest worker that need it (it starts with the first):
    every run and test pushes its weights before it samples, so what an earlier test left on it does not count."""
    yield from start_vllm_server(tiny, tmp_path_factory)


@pytest.fixture
def dying_server(tiny, server):
    """A server for a test to kill: tests/forwarder.py in front of the shared server, as {"url", "process"}. SIGKILLed,
    it is what a run sees of a server that dies (connections reset, the port refused); the server behind serves on
    (checked after the test: it completes a prompt)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "forwarder.py"), str(port), server["url"].rsplit(":", 1)[1]],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert first_line(proc.stdout, WAIT).strip() == "ready"
        yield {"url": f"http://127.0.0.1:{port}", "process": proc}
    finally:
        proc.kill()
        proc.wait(timeout=60)
    body = json.dumps({"model": tiny["policy"], "prompt": [5, 6, 7], "max_tokens": 2}).encode()
    request = urllib.request.Request(server["url"] + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert len(json.load(response)["choices"]) == 1


# ---- A tiny vision-language policy (LLaVA: a CLIP vision tower, a Llama language model) and a task on images --------
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
COLOUR_REWARD = '''
def colour_named(completions, image, **kwargs):
    """1 when the completion's first word names the colour of the image (its strongest channel), else 0."""
    rewards = []
    for completion, picture in zip(completions, image):
        r, g, b = picture.convert("RGB").getpixel((0, 0))
        colour = ["red", "green", "blue"][[r, g, b].index(max(r, g, b))]
        words = completion[-1]["content"].split()
        rewards.append(float(bool(words) and words[0] == colour))
    return rewards
'''


def word_tokenizer(words: list[str], special: list[str], chat_template: str, **special_tokens):
    """A word-level tokenizer (a vocabulary of a few words: a random policy names a colour often enough to learn)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(special + words)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token=special[0]))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.add_special_tokens(special)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token=special[0], bos_token=special[1], eos_token=special[2], **special_tokens
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_vlm(path: str) -> dict:
    """A ~100k-parameter LLaVA saved in bf16 (as hub checkpoints are) with its processor at path/llava; 48 solid-colour
    images (red, green or blue, jittered, of varied widths) with the prompt "what colour is this image" at
    path/data/train.jsonl (paths relative to it); the reward function colour_named at path/colour_reward.py."""
    import random

    import torch
    from PIL import Image
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
    tokenizer = word_tokenizer(
        list(COLOURS) + "what colour is this image the a it user assistant".split(),
        special,
        VLM_CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<image>"},
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=special.index("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model_dir = os.path.join(path, "llava")
    LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(model_dir)
    LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        image_token="<image>",
        chat_template=VLM_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    ).save_pretrained(model_dir)
    rng = random.Random(0)
    os.makedirs(os.path.join(path, "data", "images"))
    rows = []
    for i in range(48):
        colour = list(COLOURS)[i % 3]
        rgb = tuple(max(0, min(255, v + rng.randint(-20, 20))) for v in COLOURS[colour])
        Image.new("RGB", (16 + rng.randint(0, 8), 16), rgb).save(os.path.join(path, "data", "images", f"{i}.png"))
        rows.append({"prompt": [{"role": "user", "content": "what colour is this image"}], "image": f"images/{i}.png"})
    data = write_jsonl(os.path.join(path, "data", "train.jsonl"), rows)
    with open(os.path.join(path, "colour_reward.py"), "w") as f:
        f.write(COLOUR_REWARD)
    return {
        "policy": model_dir,
        "data": data,
        "reward": os.path.join(path, "colour_reward.py") + ":colour_named",
        "tokenizer": tokenizer,
        "root": path,
    }


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")))


@pytest.fixture(scope="session")
def lora_server(tiny, tmp_path_factory):
    """The tiny model's vLLM server with runtime LoRA loading, one for all the tests of a pytest worker that need it:
    every run pushes its base weights first, and its adapters under names of its own."""
    yield from start_vllm_server(tiny, tmp_path_factory, max_lora_rank=16)  # the default --lora_r's
