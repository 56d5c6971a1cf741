"""The client of a vLLM server started apart (rloo_vllm.py's --vllm_mode server; rloo_multigpu.py with a server):
VLLMServer, which checks what the server serves, sends it the prompts over HTTP and pushes the policy's weights to it
(rloo_utils/weight_transfer.py); the bodies of its requests, and the command-line options a server needs for LoRA."""

import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional

import torch

from rloo_utils.data import row_images
from rloo_utils.errors import RunError, UsageError, describe
from rloo_utils.lora import plain_state_dict
from rloo_utils.models import MODEL_OPTIONS
from rloo_utils.processes import agreed, get_rank
from rloo_utils.vllm_options import SERVER_COMMAND, adapter_problem, choose_lora_push, vllm_lora_rank
from rloo_utils.weight_transfer import (
    CountedWeights,
    check_gpus_apart,
    nccl_sender_parts,
    nccl_workers,
    rendezvous_address,
    shared_memory_folder,
    uses_nccl,
    weight_push,
    write_adapter,
)


def lora_server_options(rank: int) -> str:
    """What a server's command needs for adapters of this rank to be loaded into it at run time."""
    return f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank {vllm_lora_rank(rank) or rank}"


def completion_request(model: str, prompt: list, options: dict, seed: Optional[int], n: int = 1) -> dict:
    """The body of a /v1/completions request: the prompt as token ids (or a list of prompts), n completions of each,
    sampling_options, and the completions returned as token ids with their log-probs. The choices come prompt by
    prompt, completion by completion (choice index = prompt's position * n + i); with a seed, completion i of every
    prompt is seeded seed + i."""
    return {
        "model": model,
        "prompt": prompt,
        "n": n,
        **options,
        "seed": seed,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }


GENERATE_ROUTE = "/inference/v1/generate"  # vLLM's tokens-in, tokens-out route (vllm serve --enable-scale-out)


def generate_request(prompt: list[int], images, options: dict, seed: Optional[int], n: int) -> dict:
    """The body of a request to GENERATE_ROUTE: the prompt's token ids (its image tokens expanded, as the trainer's),
    its images as PNG data URLs (vLLM's own processor reads them), and sampling_options with n and the seed (completion
    i seeded seed + i, as /v1/completions does) as vLLM's SamplingParams; token ids and log-probs come back."""
    parts = [{"type": "image_url", "url": png_data_url(image)} for image in row_images(images)] if images else []
    return {
        "token_ids": prompt,
        "sampling_params": {**options, "n": n, "seed": seed, "detokenize": False},
        **({"content_parts": parts} if parts else {}),
    }


def png_data_url(image) -> str:
    import base64

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def prompt_runs(prompts: list[list[int]], seeds: Optional[list[int]], images=None) -> list[tuple[int, int]]:
    """[start, end) of each run of rows that repeat one prompt (and its images, the same objects) with consecutive
    seeds (or without seeds): one request with n = end - start (and seed seeds[start]) draws exactly those rows."""
    runs, start = [], 0
    for row in range(1, len(prompts) + 1):
        if (
            row == len(prompts)
            or prompts[row] != prompts[start]
            or (images is not None and images[row] is not images[start])
            or (seeds is not None and seeds[row] != seeds[start] + row - start)
        ):
            runs.append((start, row))
            start = row
    return runs


def check_same_architecture(url: str, served: Optional[str], ours: str) -> None:
    """The server's model must take the policy's weights: pushing others stops its engine for good ("Worker failed").
    Compared when both are local folders (a server elsewhere, or a hub id, is left to check_engine's log-probs)."""
    if not (served and os.path.isdir(served) and os.path.isdir(ours)):
        return
    from transformers import AutoConfig

    try:
        theirs, mine = (AutoConfig.from_pretrained(m, **MODEL_OPTIONS.get(m, {})).to_dict() for m in (served, ours))
    except Exception:
        return
    for key in (
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        if theirs.get(key) != mine.get(key):
            raise UsageError(
                f"the vLLM server at {url} serves {served}, whose {key} is {theirs.get(key)}, and {ours}'s "
                f"is {mine.get(key)}: its engine cannot take these weights; start it with --model {ours}"
            )


class VLLMServer:
    """A vLLM OpenAI-compatible server started apart (SERVER_COMMAND): prompts go to /v1/completions as token ids.
    New weights go by vLLM's NCCL weight transfer (this process is rank 0 of an NCCL group with the server's workers,
    on GPUs), or as a safetensors file in shared memory that the server reloads through its /collective_rpc route (on
    one machine: its /dev/shm). Both use the server's dev routes (VLLM_SERVER_DEV_MODE=1). Of a LoRA policy whose
    adapter the server can load at run time (--vllm_lora_push), the base weights go once, at the first push, and then
    the adapter alone after every update, as files in shared memory that its /v1/load_lora_adapter route loads under a
    new name each time, which every completion request names as its model; last_push_bytes: what the last push sent."""

    # The merged push until __init__ says otherwise (a client built without it, as tests build one, pushes as before)
    adapter, adapter_name, adapter_pushes, last_push_bytes = False, None, 0, 0

    def __init__(
        self,
        args,
    ):
        """The server at vllm_server_base_url, else at vllm_server_host:vllm_server_port, answering within
        vllm_server_timeout seconds, checked: it holds a prompt of max_prompt_length tokens and its completion of
        max_completion_length, returns log-probs after temperature, and serves the architecture of the policy
        (sft_model_path, else model_name_or_path). Weights go as vllm_server_weight_transfer says (auto: NCCL from a
        GPU); with --use_peft the adapter alone where vllm_lora_push allows and the server can load one of rank
        lora_r, use_dora and lora_modules_to_save (vllm_options.adapter_problem)."""
        base_url, host, port = args.vllm_server_base_url, args.vllm_server_host, args.vllm_server_port
        self.url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.timeout = args.vllm_server_timeout
        try:
            served = self.request("/v1/models")["data"][0]
        except RunError as e:
            raise UsageError(
                f"{e}: start the server first ({SERVER_COMMAND}), or check --vllm_server_base_url / "
                "--vllm_server_host / --vllm_server_port"
            ) from None
        self.model = served["id"]
        needed = args.max_prompt_length + args.max_completion_length
        if served.get("max_model_len") is not None and served["max_model_len"] < needed:
            raise UsageError(
                f"the vLLM server at {self.url} holds {served['max_model_len']} tokens, fewer than a prompt and "
                f"its completion ({args.max_prompt_length} + {args.max_completion_length}): restart it with "
                f"--max-model-len {needed}"
            )
        server_info = self.request("/server_info?config_format=json")  # a dev route: the server's reloads need them
        model_config = (server_info.get("vllm_config") or {}).get("model_config") or {}
        if model_config.get("logprobs_mode") != "processed_logprobs":  # else not the sampling distribution's log-probs
            raise UsageError(
                f"the vLLM server at {self.url} returns log-probs as {model_config.get('logprobs_mode')}, not "
                f"after temperature: restart it with --logprobs-mode processed_logprobs ({SERVER_COMMAND})"
            )
        check_same_architecture(self.url, model_config.get("model"), args.sft_model_path or args.model_name_or_path)
        served_dtype = getattr(torch, str(model_config.get("dtype")).removeprefix("torch."), None)
        self.dtype = served_dtype if isinstance(served_dtype, torch.dtype) else None  # pushes in it (None: as trained)
        self.nccl = uses_nccl(args.vllm_server_weight_transfer)
        # what vllm_options.adapter_problem reads (the adapter's options, the model it names), which the first push
        # checks again with the policy's layers
        self.lora_options, self.model_name_or_path = args.lora_options(), args.model_name_or_path
        self.lora_push = args.vllm_lora_push
        problem = None
        if args.use_peft:
            problem = adapter_problem(self.lora_options, self.model_name_or_path) or self.lora_problem(
                server_info, args.lora_r
            )
        self.adapter = args.use_peft and choose_lora_push(self.lora_push, problem)
        self.adapter_name = None  # the adapter the completions name (the latest pushed); None: the weights alone
        if self.nccl:
            self.workers = nccl_workers(server_info, self.url)
            check_gpus_apart(server_info, self.url, self.workers)
            self.sender = self.source = None  # vLLM's transfer engine and its weight source, from the first push
        if not self.nccl or self.adapter:  # the weights' file, or the adapters' files
            self.folder = shared_memory_folder()

    def lora_problem(self, server_info: dict, rank: int) -> Optional[tuple[str, str]]:
        """Why this server cannot load an adapter of this rank at run time, and the fix (as adapter_problem), from its
        /server_info: started without --enable-lora (its lora_config), without VLLM_ALLOW_RUNTIME_LORA_UPDATING (its
        environment as vLLM reads it), with a lower --max-lora-rank; or on another machine (NCCL), which cannot read
        the adapter's files in this machine's shared memory."""
        lora_config = (server_info.get("vllm_config") or {}).get("lora_config")
        restart = f"restart it with {lora_server_options(rank)}"
        if not lora_config:
            return f"the vLLM server at {self.url} was started without --enable-lora", restart
        if not (server_info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            return f"the vLLM server at {self.url} cannot load adapters while it runs", restart
        if lora_config.get("max_lora_rank", 0) < rank:
            served = lora_config.get("max_lora_rank")
            return f"--lora_r {rank} is above the --max-lora-rank {served} of the vLLM server at {self.url}", restart
        host = socket.gethostbyname(urllib.parse.urlparse(self.url).hostname)
        if self.nccl and not (host.startswith("127.") or host == rendezvous_address(self.url)[0]):
            return (
                f"the vLLM server at {self.url} is on another machine, and an adapter reaches it as files in this "
                "machine's shared memory",
                "start the server on this machine",
            )
        return None

    def request(self, route: str, body: Optional[dict] = None):
        """GET (body None) or POST JSON; the answer's JSON (or text). A server that cannot be reached or fails:
        RunError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = response.read()
            try:
                return json.loads(answer or b"null")
            except ValueError:  # a plain-text answer: the LoRA routes' "Success: ..."
                return answer.decode(errors="replace")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace").strip().replace("\n", " ")[:300]
            if e.code == 404 and route == GENERATE_ROUTE:
                raise RunError(
                    f"the vLLM server at {self.url} has no {route} route, which image prompts go through: "
                    f"start it with --enable-scale-out ({SERVER_COMMAND} --enable-scale-out)"
                ) from None
            if e.code == 404 and route.startswith(("/collective_rpc", "/reset_prefix_cache", "/server_info")):
                raise RunError(
                    f"the vLLM server at {self.url} has no {route} route: start it with VLLM_SERVER_DEV_MODE=1 "
                    f"({SERVER_COMMAND})"
                ) from None
            raise RunError(f"the vLLM server at {self.url} refused {route} (HTTP {e.code}: {detail})") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RunError(
                f"the vLLM server at {self.url} does not answer {route} ({type(reason).__name__}: {reason})"
            ) from None

    def generate(self, prompts: list[list[int]], options: dict, seeds: Optional[list[int]], images=None):
        """Per prompt: (completion token ids, their sampling log-probs). Without seeds, all the prompts in one request;
        with seeds, one request per group (rows that repeat a prompt with consecutive seeds, as sampling_seeds gives
        them) for its G completions, every request in flight at once: the server batches the whole rollout, and draws
        what the colocated engine draws for the same seeds. With images (each row's), through vLLM's tokens-in route,
        which takes them beside the token ids (/v1/completions takes none): one request per group, seeded or not."""

        model = self.adapter_name or self.model  # the policy: its latest adapter on the base, or the weights alone

        def complete(prompt, seed=None, n=1) -> list:
            choices = self.request("/v1/completions", completion_request(model, prompt, options, seed, n))["choices"]
            return [
                (c["token_ids"], c["logprobs"]["token_logprobs"]) for c in sorted(choices, key=lambda c: c["index"])
            ]

        def complete_with_images(row, seed=None, n=1) -> list:
            body = generate_request(prompts[row], images[row], options, seed, n)
            choices = self.request(GENERATE_ROUTE, body)["choices"]
            return [
                (c["token_ids"], [lp["logprob"] for lp in c["logprobs"]["content"]])
                for c in sorted(choices, key=lambda c: c["index"])
            ]

        if seeds is None and images is None:
            return complete(prompts)
        runs = prompt_runs(prompts, seeds, images)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(256, len(runs))) as pool:
            groups = pool.map(
                lambda run: (
                    complete(prompts[run[0]], seeds[run[0]], run[1] - run[0])
                    if images is None
                    else complete_with_images(run[0], seeds and seeds[run[0]], run[1] - run[0])
                ),
                runs,
            )
            return [completion for group in groups for completion in group]

    def push_weights(self, policy, weights) -> None:
        """weights: the script's weights_for_vllm(policy, self.dtype), whose items() are (name, tensor) pairs (merged),
        or base() once and adapter() (the adapter push). Of sharded weights each item is a gather, a collective: every
        process goes through them and rank 0 sends them; a failure on any process stops all of them together (a push
        that failed half-way still goes through every gather)."""
        with agreed(), weight_push():
            if self.adapter and self.adapter_name is None:  # the first push: what the policy's layers allow
                self.adapter = choose_lora_push(
                    self.lora_push, adapter_problem(self.lora_options, self.model_name_or_path, policy)
                )
            if not self.adapter:
                parts = [(self.send_weights, iter(weights.items()))]
            else:  # the base weights once, then the adapter alone, every process naming it alike
                self.adapter_pushes += 1
                base = [(self.send_weights, iter(weights.base()))] if self.adapter_name is None else []
                parts = base + [(self.send_adapter, iter(weights.adapter()))]
            try:
                if get_rank() == 0:
                    self.last_push_bytes = 0
                    for send, pairs in parts:
                        send(policy, pairs)
                    self.request("/reset_prefix_cache", {})
            finally:  # a push that failed half-way still goes through every gather: all processes then stop together
                for _, pairs in parts:
                    for _ in pairs:
                        pass
            if self.adapter:
                self.adapter_name = self.adapter_id(self.adapter_pushes)

    def adapter_id(self, number: int) -> str:
        """The name the number-th adapter is loaded under: the same in every process (each names it in its requests)."""
        return f"rloo_policy_{number}"

    def send_adapter(self, policy, pairs) -> None:
        """The adapter written to a new folder in shared memory and loaded by the server under a new name (a new id:
        an in-place reload, load_inplace, would make it read the files again at every step), the one before unloaded."""
        name, old = self.adapter_id(self.adapter_pushes), self.adapter_name
        folder = os.path.join(self.folder.name, name)
        self.last_push_bytes += write_adapter(policy, pairs, folder)
        with contextlib.suppress(RunError):  # one a killed run left under this name (a fresh server has none)
            self.request("/v1/unload_lora_adapter", {"lora_name": name})
        self.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
        if old is not None:
            self.request("/v1/unload_lora_adapter", {"lora_name": old})
            shutil.rmtree(os.path.join(self.folder.name, old), ignore_errors=True)

    def send_weights(self, policy, weights) -> None:
        weights = CountedWeights(weights)
        if self.nccl:
            self.push_over_nccl(policy, weights)
        else:
            from safetensors.torch import save_file

            needed = sum(v.numel() * v.element_size() for v in plain_state_dict(policy).values())
            free = shutil.disk_usage(self.folder.name).free
            if free < needed:
                raise UsageError(
                    f"{os.path.dirname(self.folder.name)} has {free / 2**20:.0f} MiB free and the policy's "
                    f"weights take {needed / 2**20:.0f} MiB: give the machine more shared memory (Docker: "
                    "--shm-size), or send them over NCCL (--vllm_server_weight_transfer nccl, GPUs)"
                )
            # A new file replaces the old one atomically; contiguous copies, since safetensors refuses shared tensors.
            tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights}
            partial = os.path.join(self.folder.name, "model.safetensors.partial")
            save_file(tensors, partial)
            os.replace(partial, os.path.join(self.folder.name, "model.safetensors"))
            self.request("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.folder.name}})
        self.last_push_bytes += weights.bytes

    def push_over_nccl(self, policy, weights) -> None:
        """vLLM's NCCL weight transfer: the first push opens the group (the server's workers join it through its
        /init_weight_transfer_engine route); every push broadcasts each tensor while the server loads it."""
        try:
            if self.sender is None:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

                init_info, client, self.source = nccl_sender_parts(
                    self.url, self.timeout, self.workers, policy, self.dtype
                )
                self.sender = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client, source=self.source)
            self.source.weights = weights
            self.sender.send_weights()
        except Exception as e:
            raise RunError(
                f"the vLLM server at {self.url} failed a weight transfer over NCCL ({describe(e)})"
            ) from None

    def close(self) -> None:
        if self.adapter_name is not None:
            with contextlib.suppress(RunError):  # the server serves on without it
                self.request("/v1/unload_lora_adapter", {"lora_name": self.adapter_name})
        if not self.nccl or self.adapter:
            self.folder.cleanup()
        if self.nccl and self.sender is not None:
            try:  # the server can then take another trainer's group
                self.sender.client.shutdown_weight_transfer_engine()
            except Exception:
                pass  # the run is over: a server that does not answer holds no group of ours that matters
            self.sender.shutdown()
