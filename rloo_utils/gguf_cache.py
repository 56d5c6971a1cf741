"""A .gguf policy's de-quantised copy, kept between runs (docs/speed.md, "Start-up"): transformers reads a GGUF file
once for the tokenizer, once for the config and once for the weights, ~15 s of a run's start for SmolLM2-135M on 2 CPU
cores; the copy, save_pretrained's folder of the model, its tokenizer and generation config, loads in about a second.

Where: $RLOO_CACHE/gguf, else $XDG_CACHE_HOME/rloo/gguf, else ~/.cache/rloo/gguf; RLOO_CACHE=off goes without. A copy is
keyed by the file (real path, size, modification time, inode and change time) and the converter (the transformers and
gguf versions): another file or another converter makes a new one. The inode and change time tell a re-quantised file of
the same size put in place with its modification time kept (`cp -p`, `rsync -a`, `tar x`). It is written to a temporary
folder of its own, its marker (each file's size) last, then renamed into place, so that a reader sees a whole copy or
none and two runs that make one at once keep one. A copy that cannot be written, or is found damaged, costs one line,
never the run."""

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import socket
import uuid
from typing import Optional

import torch

from rloo_utils.errors import describe

CACHE_FORMAT = 1  # the copy's layout: a change makes new keys
FILE_STATE = ("size", "mtime_ns", "inode", "ctime_ns")  # what of gguf_source changes when the file does
MARKER = "rloo_gguf_copy.json"  # written last: a folder without it is no copy
CACHE_OFF = ("off", "0", "false", "no", "none")  # RLOO_CACHE values that turn the cache off
# Path -> what this process read of a .gguf file whose copy it could not write (or does not write: it is not float32),
# {"tokenizer", "config", "model"}: the loads after the first take those instead of reading the file again
IN_MEMORY: dict[str, dict] = {}


def gguf_cache_root() -> Optional[str]:
    """The folder of the copies: $RLOO_CACHE/gguf, else $XDG_CACHE_HOME/rloo/gguf, else ~/.cache/rloo/gguf; None
    where RLOO_CACHE=off."""
    root = os.environ.get("RLOO_CACHE", "").strip()
    if root.lower() in CACHE_OFF:
        return None
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rloo")
    return os.path.join(os.path.abspath(root), "gguf")


def gguf_source(path: str) -> dict:
    """What a copy is made from: the file as it is now, and the packages that de-quantise it."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package):
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    real = os.path.realpath(path)
    stat = os.stat(real)
    return {
        "file": real,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "inode": stat.st_ino,  # a new file renamed into place (rsync -a, tar x)
        "ctime_ns": stat.st_ctime_ns,  # the same file written over, its modification time set back (cp -p)
        "transformers": installed("transformers"),
        "gguf": installed("gguf"),
        "format": CACHE_FORMAT,
    }


def gguf_copy_name(source: dict) -> str:
    """The copy's folder name: the file's name (for whoever looks in the cache) and a hash of its source."""
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    return f"{os.path.basename(source['file']).removesuffix('.gguf')}-{digest}"


def gguf_copy_problem(folder: str, source: dict) -> Optional[str]:
    """Why `folder` is not a whole copy of `source` ("absent" where there is no folder), None where it is. Each file is
    held to the size the marker recorded: a truncated or missing file is found before loading. (No hash of the
    contents: reading 540 MB to hash them would cost half a second at every start; safetensors checks its header
    against the file's size when it loads, and the JSON files are parsed.)"""
    try:
        with open(os.path.join(folder, MARKER)) as f:
            marker = json.load(f)
        files = marker["files"]
    except FileNotFoundError:
        return "no completion marker" if os.path.isdir(folder) else "absent"
    except OSError:  # a cache that cannot be read (under a file, not ours): as if it held nothing
        return "absent"
    except (ValueError, KeyError, TypeError) as e:
        return f"its marker is unreadable ({describe(e)})"
    if marker.get("source") != source:
        return "its marker names another file"
    for name, size in files.items():
        try:
            found = os.path.getsize(os.path.join(folder, name))
        except OSError:
            return f"{name} is missing"
        if found != size:
            return f"{name} holds {found} bytes, not {size}"
    return None


def gguf_copy_unreadable(folder: str) -> Optional[str]:
    """What in a copy of the right sizes cannot be read (None: every file can): where a load from it failed, whether
    the copy is damaged, or the load's options are what fails (they would from the GGUF file too)."""
    from safetensors import safe_open

    try:
        names = sorted(os.listdir(folder))
    except OSError as e:  # removed meanwhile (another run found it damaged)
        return describe(e)
    for name in names:
        file = os.path.join(folder, name)
        try:
            if name.endswith(".json"):
                with open(file) as f:
                    json.load(f)
            elif name.endswith(".safetensors"):
                with safe_open(file, framework="pt"):  # its header, held against the file's size
                    pass
        except Exception as e:
            return f"{name}: {describe(e)}"
    return None


@contextlib.contextmanager
def gguf_parsed_once():
    """While a copy is made: each file parsed once, not once per load (gguf.GGUFReader, ~4 s of SmolLM2's metadata
    each time), and gguf's tensor-name map made once, not once per module (397 times for SmolLM2, ~7 s). transformers
    imports both from gguf at each call; the tests compare what it loads so with what it loads without."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def parsed(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def read_gguf(path: str, options: dict) -> dict:
    """The tokenizer, config and de-quantised float32 causal LM of a .gguf file, as from_pretrained loads them from it
    (its quantization config dropped: the weights are plain), and the model's loading info."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, **options)
        config = AutoConfig.from_pretrained(folder, gguf_file=name, **options)
        model, info = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            config=copy.deepcopy(config),  # (read once more otherwise)
            dtype=torch.float32,
            output_loading_info=True,
            **options,
        )
    return {"tokenizer": tokenizer, "config": config, "model": model, "info": info}


def not_cacheable(model) -> Optional[str]:
    """Why a model read from a .gguf file has no float32 copy that loads as the file does (None: it has): weights left
    packed (transformers' GGUF kernels), or a half-precision file, which --dtype auto loads in half precision."""
    quantizer = getattr(model, "hf_quantizer", None)
    if getattr(quantizer, "packed_modules", None):
        return "its weights stay packed"
    own = getattr(getattr(quantizer, "header", None), "dtype", None)
    if own not in (None, torch.float32):
        return f"its weights are {own}"
    return None


def without_quantization_config(model):
    """De-quantised weights: the model as any other, which save_pretrained writes as a normal folder."""
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
        model.hf_quantizer = None
    return model


def temporary_name(folder: str) -> str:
    """A sibling of `folder` that no other process names: .<name>.<pid>-<random>@<host>.tmp (prune_gguf_copies removes
    it once that process is gone)."""
    parent, name = os.path.split(folder)
    return os.path.join(parent, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}@{socket.gethostname()}.tmp")


def temporary_owner(name: str) -> Optional[tuple[str, int]]:
    """(host, process id) of a temporary_name; None for any other name."""
    if not (name.startswith(".") and name.endswith(".tmp") and "@" in name):
        return None
    before, host = name.removesuffix(".tmp").rsplit("@", 1)
    pid = before.rsplit(".", 1)[-1].split("-")[0]
    return (host, int(pid)) if pid.isdigit() else None


def write_gguf_copy(folder: str, source: dict, built: dict) -> bool:
    """save_pretrained of the model and tokenizer into a temporary sibling of `folder`, the marker last, then renamed to
    `folder`; False where another process renamed its copy first: that one is kept, and this one removed. The
    temporary folder never outlives a failure."""
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    temporary = temporary_name(folder)
    try:
        os.mkdir(temporary)
        model = built["model"]
        # save_pretrained writes into the model's config (architectures, dtype): where the copy cannot be written, the
        # run goes on with this model, which must stay as the file loads it
        own_config, model.config = model.config, copy.deepcopy(model.config)
        try:
            model.save_pretrained(temporary)
        finally:
            model.config = own_config
        # The file's own config over the one save_pretrained writes (that adds `architectures` and `dtype`, which
        # AutoConfig of the file has not): the same config either way
        built["config"].save_pretrained(temporary)
        built["tokenizer"].save_pretrained(temporary)
        files = {
            os.path.relpath(os.path.join(parent, name), temporary): os.path.getsize(os.path.join(parent, name))
            for parent, _, names in os.walk(temporary)
            for name in names
        }
        with open(os.path.join(temporary, MARKER), "w") as f:
            json.dump({"source": source, "files": files}, f, indent=1)
        try:
            os.rename(temporary, folder)
        except OSError:  # a folder there already (not empty): another process's copy, if whole
            if gguf_copy_problem(folder, source) is not None:
                raise
            return False
        return True
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # (gone where renamed)


def discard_gguf_copy(folder: str) -> None:
    """Renamed away first, so that no reader meets it half removed; another process may have removed it already."""
    gone = temporary_name(folder)
    try:
        os.rename(folder, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def prune_gguf_copies(root: str, source: dict) -> None:
    """After a copy is made: the copies of the same file made before it changed (they can never be used again; those of
    other package versions may be another environment's, and stay), and the temporary folders of processes of this
    host that are gone (killed while writing one)."""
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        owner = temporary_owner(name)
        if owner is not None:
            if owner[0] == socket.gethostname() and not process_alive(owner[1]):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            with open(os.path.join(folder, MARKER)) as f:
                made_from = json.load(f)["source"]
        except Exception:
            continue
        if made_from.get("file") == source["file"] and any(made_from.get(k) != source[k] for k in FILE_STATE):
            discard_gguf_copy(folder)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def gguf_copy(path: str, options: dict) -> Optional[str]:
    """The folder of path's whole copy: found, or made now (a damaged one removed first, with one line); None where
    there is none to use: the cache off, or the copy not written (IN_MEMORY then holds what was read)."""
    root = gguf_cache_root()
    if root is None or path in IN_MEMORY:
        return None
    try:
        source = gguf_source(path)
    except OSError:  # no such file: from_pretrained says so
        return None
    folder = os.path.join(root, gguf_copy_name(source))
    problem = gguf_copy_problem(folder, source)
    if problem is None:
        return folder
    if problem != "absent":
        print(f"the cached copy of {path} in {folder} is damaged ({problem}): removed, made again", flush=True)
        discard_gguf_copy(folder)
    try:
        built = read_gguf(path, options)
    except Exception:  # a file transformers cannot read whole (no tokenizer, no causal LM): read as before, uncached
        IN_MEMORY[path] = {}
        return None
    why_not = not_cacheable(built["model"])
    without_quantization_config(built["model"])
    if why_not is not None:  # loaded from the file as before; the loads after this one take what was read
        IN_MEMORY[path] = built
        return None
    try:
        ours = write_gguf_copy(folder, source, built)
    except Exception as e:  # a full disk, a read-only cache, ... (SafetensorError is no OSError)
        print(
            f"could not cache a de-quantised copy of {path} in {root} ({describe(e)}): this run goes on from the "
            "GGUF file (RLOO_CACHE=off skips the cache)",
            flush=True,
        )
        IN_MEMORY[path] = built
        return None
    if ours:
        print(f"cached a de-quantised copy of {path} in {folder}: later runs start from it", flush=True)
        prune_gguf_copies(root, source)
    return folder


def from_memory(auto_class, path: str, kwargs: dict):
    """What IN_MEMORY holds of path, where it is what auto_class.from_pretrained(path, **kwargs) would load (the
    tokenizer and the model once each: a run changes them); else None."""
    built = IN_MEMORY.get(path, {})
    asked = {k: v for k, v in kwargs.items() if k not in ("trust_remote_code", "revision")}
    name = getattr(auto_class, "__name__", "")
    if name == "AutoConfig" and not asked and "config" in built:
        return copy.deepcopy(built["config"])
    if name == "AutoTokenizer" and not asked:
        return built.pop("tokenizer", None)
    plain = (
        set(asked) <= {"dtype", "attn_implementation", "output_loading_info"}
        and asked.get("dtype") in (None, torch.float32, "float32")
        and asked.get("attn_implementation") is None
    )
    if name == "AutoModelForCausalLM" and plain and "model" in built:
        model = built.pop("model")
        return (model, built["info"]) if asked.get("output_loading_info") else model
    return None


def as_loaded_from_gguf(loaded, path: str):
    """A load from the copy named as one from the file: what transformers records of where it came from (the config's,
    the model's and the tokenizer's name_or_path) is the .gguf file's folder, as if read from it."""
    folder = os.path.dirname(os.path.abspath(path))
    for thing in loaded if isinstance(loaded, tuple) else (loaded,):
        for holder in (thing, getattr(thing, "config", None)):
            if holder is not None and hasattr(holder, "name_or_path"):
                holder.name_or_path = folder
    return loaded


def load_gguf_copy(auto_class, path: str, kwargs: dict):
    """auto_class.from_pretrained(path, **kwargs) for a .gguf path: from its copy (made first where there is none),
    else from what this process read of it; None where neither serves, and the caller reads the file. A copy that
    fails to load, and whose files do not all read, is damaged: removed (one line), made again."""
    for attempt in range(2):
        folder = gguf_copy(path, {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "revision")})
        if folder is None:
            return from_memory(auto_class, path, kwargs)
        try:
            return as_loaded_from_gguf(auto_class.from_pretrained(folder, **kwargs), path)
        except Exception as e:
            unreadable = gguf_copy_unreadable(folder)
            if unreadable is None or attempt == 1:  # the options fail, not the copy: from the file, as before
                return None
            print(
                f"the cached copy of {path} in {folder} is damaged ({describe(e)}; {unreadable}): removed, made again",
                flush=True,
            )
            discard_gguf_copy(folder)
    return None
