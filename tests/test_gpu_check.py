"""benchmark/gpu/check.py, the kit a lent GPU runs, run whole on the CPU with tiny models so that it never rots; and its
plumbing: a part that fails or hangs (its workers in sessions of their own, as torchrun's are) is reported and killed
without stopping the others, and carried wheels go first on the parts' path."""

import json
import os
import signal
import subprocess
import sys
import time
import types
import zipfile

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmark", "gpu"))
import check  # noqa: E402

CHECK = os.path.join(ROOT, "benchmark", "gpu", "check.py")
# The kit took 135-306 s here (docs/tests.md), past the suite's 600 s a test on a slower machine: whichever test of it
# runs first (any, in another order) gets the kit's own bound (its subprocess.run's 1800 s) and a margin to report it
KIT_TIMEOUT = pytest.mark.timeout(1900)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The whole kit on the CPU at its smoke size (each part's code once, 2 updates a run: what the parts would show
    on a CPU, learning, resuming, evaluating without changing the training, is held by the tests that own it), every
    part, three at a time (on 2 cores its parts wait on imports and on each other), TRL from its own environment."""
    out, work = tmp_path_factory.mktemp("report"), tmp_path_factory.mktemp("work")
    trl_python = os.path.join(ROOT, ".venv-trl", "bin", "python")
    proc = subprocess.run(
        [
            sys.executable,
            CHECK,
            "--device",
            "cpu",
            "--out",
            out,
            "--work",
            work,
            "--jobs",
            "3",
            "--size",
            "smoke",
            "--trl_python",
            trl_python,
            "--deadline",
            "1500",
            "--part_timeout",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=tmp_path_factory.mktemp("cwd"),
    )
    with open(out / "report.json") as f:
        report = json.load(f)
    with open(out / "report.md") as f:
        return proc, report, f.read()


@pytest.mark.slow
@KIT_TIMEOUT
def test_every_part_passes_on_the_cpu_and_the_report_says_what_ran(kit):
    proc, report, markdown = kit
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    assert set(statuses) == set(check.PARTS)
    assert statuses.pop("rloo_padding_free_flash_attention_2") == "skipped"  # CUDA only
    assert set(statuses.values()) == {"passed"}, {
        n: report["parts"][n].get("output", "")[-2000:] for n, s in statuses.items() if s != "passed"
    }
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert report["parts"]["rloo_padding_free_flash_attention_2"]["reason"] == "needs CUDA"
    assert report["environment"]["torch"].startswith("2.") and report["environment"]["cuda_available"] is False
    for name in statuses:
        assert f"| {name} | passed |" in markdown
        assert report["parts"][name]["commands"], name  # as a user would type them
    assert report["parts"]["rloo_lora"]["commands"][0].endswith("--lora_r 8 --bf16 --use_peft")
    assert " python rloo.py --model_name_or_path " in report["parts"]["rloo_fp32"]["commands"][0]
    assert "## Seconds per update, rloo.py and TRL's RLOOTrainer" in markdown and "| seconds per update | " in markdown
    assert "| setup | before B/param | after B/param |" in markdown
    assert "## The sampler-trainer gap" in markdown and "| sampler_gap float16 | a float16 copy of" in markdown
    assert "## Profile: one HF generate call, one training forward-backward" in markdown


@pytest.mark.slow
@KIT_TIMEOUT
def test_the_parts_numbers_are_those_of_real_runs(kit):
    parts = {name: part.get("results", {}) for name, part in kit[1]["parts"].items()}
    for name in ("rloo_fp32", "rloo_bf16", "rloo_gradient_checkpointing", "rloo_padded", "rloo_lora", "rloo_vlm"):
        assert parts[name]["updates"] == 2 and parts[name]["seconds_per_update"] > 0, name
        assert parts[name]["peak_max_rss_gib"][0] > 0.1, name
        if name != "rloo_vlm":  # its 0/1 colour reward can tie every group of the first update: no step to take
            assert parts[name]["kl_last"] != 0, name  # the reward model never ties: the first update moved the policy
    assert parts["rloo_learns"]["updates"] == 2  # at smoke size; the learning is tests/test_end_to_end.py's
    evaluates = parts["rloo_evaluates"]
    assert evaluates["training_differences"] == "none: the same training"
    assert [e["step"] for e in evaluates["evaluations"]] == [0, 8, 16] and evaluates["not_evaluating"]["updates"] == 2
    gsm8k = parts["rloo_gsm8k"]  # the recipe itself ran, short: its data made, 2 updates, evaluated 3 times
    assert gsm8k["updates"] == 2 and len(gsm8k["flexible_accuracy"]) == 3 and 0 <= gsm8k["accuracy_after"] <= 1
    assert gsm8k["sampler_weights"] == "the policy's own float32 weights"  # the default's, on a CPU
    assert "bash benchmark/experiments/gsm8k.sh" in kit[1]["parts"]["rloo_gsm8k"]["commands"][0].replace(ROOT + "/", "")
    assert parts["rloo_bf16_saved_model"]["saved_dtype"] == "torch.float32"
    assert parts["rloo_bf16_saved_model"]["fraction_of_weights_changed"] > 0.2
    for name, processes in (("multigpu_1_process", 1), ("multigpu_every_process", 2)):
        result = parts[name]
        assert result["processes"] == processes and result["resume_differences"] == "none: the same run", name
        assert result["killed_after_update"] == 2 and result["resumed"]["updates"] == 3, name  # killed in update 3
        assert len(result["uninterrupted"]["peak_max_rss_gib"]) == processes, name
    assert parts["rloo_learns"]["sampler_weights"] == "the policy's own float32 weights"  # the default's, on a CPU
    memory = parts["memory_per_parameter"]
    assert memory["table"][0] == "| setup | before B/param | after B/param |"
    assert memory["model"].startswith("Llama, hidden 256")
    copy = next(line for line in memory["table"] if line.startswith("| full + KL: sampler's copy"))
    copy_bytes = float(copy.split("|")[2])  # 2 a parameter in bfloat16 (a tied LM head held apart: 2 more per row)
    assert "--sampler_weights bfloat16" in copy and 2 <= copy_bytes <= 2 * (1 + 8000 * 256 / 9_390_336) + 1e-3
    assert any(line.startswith(f"| **full + KL: total** | **{20 + copy_bytes:.3f}** |") for line in memory["table"])
    rloo, trl = parts["timing_rloo"], parts["timing_trl"]
    assert set(rloo["stages"]) == set(check.STAGES) and rloo["seconds_per_update"] > sum(rloo["stages"].values())
    assert rloo["workload"] == trl["workload"] and rloo["workload"]["bf16"] is False
    # the same work by each side's own log: as many updates, of as many completions, none past the length asked
    assert rloo["ran"]["updates"] == trl["ran"]["updates"] == rloo["workload"]["updates"] == 2
    assert rloo["ran"]["completions"] == trl["ran"]["completions"] == [rloo["workload"]["completions"]]
    assert 1 < rloo["ran"]["longest"] <= rloo["workload"]["max_tokens"] and 1 < trl["ran"]["longest"] <= 32
    assert rloo["tokens_per_completion"] > 1 and trl["tokens_per_completion"] > 1 and trl["trl"] == "1.16.0"
    # rloo.py's default as a user runs it: on a CPU its own float32 weights sample, so no gap is logged
    assert rloo["options"] == "rloo.py's defaults" and rloo["cache_implementation"] == "auto: dynamic"
    assert rloo["sampler"]["weights"] == "policy" and rloo["sampler_gap"] == {}
    gap = parts["sampler_gap"]  # a copy of other numerics samples: the gap logged, the correction's ratios beside it
    assert set(gap["runs"]) == {"bfloat16", "float16"}
    for dtype, run in gap["runs"].items():
        assert run["sampler_weights"].startswith(f"a {dtype} copy of the policy's float32 weights"), run
        assert run["updates"] == run["updates_with_gap"] == 2, run
        means, extremes = run["mean_over_updates"], run["extremes_over_updates"]
        assert set(means) == set(check.GAP_METRICS), run
        assert 0 < means["sampling/sampling_logp_difference/mean"] <= means["sampling/sampling_logp_difference/max"]
        assert means["sampling/kl"] >= 0 and 0 <= means["sampling/importance_sampling_ratio/clipped_fraction"] <= 1
        assert extremes["sampling/importance_sampling_ratio/min"] <= means["sampling/importance_sampling_ratio/mean"]
    profile = parts["profile"]  # one generate call and one forward-backward of update 2, CPU activities only
    assert set(profile["stages"]) == {"generation", "policy_forward_backward"}
    for stage, numbers in profile["stages"].items():
        assert 0 < numbers["host_ms"] and 0 < numbers["wall_ms"] and numbers["device_ms"] is None, stage
        assert 1 <= len(profile["top"][stage]) <= 15 and profile["top"][stage][0]["calls"] >= 1, stage
    assert profile["sampler_weights"] == "the policy's own float32 weights"
    assert any(line.startswith("### one HF generate call") for line in profile["table"])
    assert "benchmark/gpu/profile_step.py --out" in kit[1]["parts"]["profile"]["commands"][0]


@pytest.mark.slow
@KIT_TIMEOUT
def test_each_timing_with_compile_on_and_off_has_its_numbers_against_the_hardware(kit):
    """The timings ran what they say (their commands: rloo.py's defaults, or one lever), and each has, from its own
    run's log, what the hardware numbers are made of; on a CPU no peak is assumed: those cells say so, and no number is
    made up."""
    _, report, markdown = kit
    parts = report["parts"]
    commands = {name: " ".join(parts[name]["commands"]) for name in check.TIMINGS}
    assert "--cache_implementation" not in commands["timing_rloo"] + commands["timing_trl"]  # each side's default
    for option in ("--bf16", "--no_bf16", "--dtype", "--sampler_weights", "--decoding_loop", "--fused_output_layer"):
        assert option not in commands["timing_rloo"], option  # rloo.py as a user runs it
    for name, lever in [
        ("timing_rloo_policy_weights", "--sampler_weights policy"),
        ("timing_rloo_float16_sampler", "--sampler_weights float16"),
        ("timing_rloo_own_decoding", "--decoding_loop own --cache_implementation static"),  # static: auto's on CUDA
        ("timing_rloo_no_fused_head", "--fused_output_layer off"),
        ("timing_rloo_compiled_layers", "--compile_decoder_layers"),
        ("timing_rloo_bf16_weights_static", "--cache_implementation static --dtype bfloat16"),
    ]:
        assert commands[name].endswith(f"--run_name run {lever}"), name  # the one lever, after the workload's options
        assert parts[name]["results"]["options"] == lever, name
    assert "--cache_implementation dynamic" in commands["timing_rloo_no_compile"]
    assert "benchmark/trl_baseline.py" in commands["timing_trl_static"]
    assert "--cache_implementation static" in commands["timing_trl_static"]
    tiny_parameters = 819_840  # the timing model at size smoke: embeddings 4096 x 128 (tied), 2 layers, a final norm
    for name in check.TIMINGS:
        t = parts[name]["results"]
        w = t["workload"]
        assert t["ran"]["updates"] == 2 and t["ran"]["completions"] == [w["completions"]], name
        assert t["parameters"] == t["trainable_parameters"] == tiny_parameters, name
        # the bytes of the weights that sample: a 16-bit copy's or 16-bit weights' 2, even on a CPU; else fp32's 4
        sampler = t.get("sampler") or {"weights": "policy", "dtype": "float32"}  # TRL's: its fp32 policy
        assert (sampler["weights"], sampler["dtype"]) == {
            "timing_rloo_float16_sampler": ("float16 copy", "float16"),
            "timing_rloo_bf16_weights": ("policy", "bfloat16"),
            "timing_rloo_bf16_weights_static": ("policy", "bfloat16"),
        }.get(name, ("policy", "float32")), name
        assert t["generation_bytes_per_parameter"] == (4 if sampler["dtype"] == "float32" else 2), name
        assert 1 < t["decoding_steps"] <= w["max_tokens"], name
        assert 0 < t["generation_seconds"] < t["seconds_per_update"], name
        assert 0 < t["forward_backward_seconds"] < t["seconds_per_update"], name
        assert t["generated_tokens"] == pytest.approx(t["tokens_per_completion"] * w["completions"], rel=0.01), name
        assert t["trained_tokens"] > t["generated_tokens"] + w["completions"] * 16, name  # prompts of 16-48 words
        h = t["against_hardware"]
        assert h["generation_tokens_per_second"] == pytest.approx(t["generated_tokens"] / t["generation_seconds"])
        assert h["mfu"] is h["mfu_update"] is h["bandwidth_bound_step_ms"] is h["x_from_bandwidth_bound"] is None
        assert h["training_tflops"] > 0, name
    for name in ("timing_rloo", "timing_rloo_no_compile"):  # the kit's tokens per second are rloo.py's own
        t = parts[name]["results"]
        assert t["against_hardware"]["generation_tokens_per_second"] == pytest.approx(
            t["generated_tokens_per_second_logged"], rel=0.01
        )
    assert "| part | cache | sampler weights | generation tok/s | decoding steps/s | step ms | bound ms |" in markdown
    assert f"Peak assumed: no CUDA device: {check.UNKNOWN_PEAK}" in markdown
    assert markdown.count(check.UNKNOWN_PEAK) == 1 + 4 * len(check.TIMINGS)  # the peak; each timing's bound, x, MFUs
    assert "rloo.py / TRL, compile on (timing_rloo / timing_trl_static)" in markdown
    assert "rloo.py / TRL, compile off (timing_rloo_no_compile / timing_trl)" in markdown


def test_a_failing_or_hanging_part_is_reported_and_killed_whole(tmp_path):
    """A part's process and everything it started (a worker in a session of its own too) die at the part's limit."""
    fails = [sys.executable, "-c", "print('before'); raise SystemExit('boom')"]
    failed = check.launch(fails, 30, dict(os.environ), "a")
    assert failed["status"] == "failed" and failed["exit"] == 1 and "before" in failed["output"]
    assert "boom" in failed["output"]
    skipped = check.launch([sys.executable, "-c", f"raise SystemExit({check.SKIPPED})"], 30, dict(os.environ), "b")
    assert skipped["status"] == "skipped"
    worker_pid = tmp_path / "worker.pid"
    hangs = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        f"open({str(worker_pid)!r}, 'w').write(str(w.pid))\n"
        "time.sleep(300)"
    )
    start = time.perf_counter()
    hung = check.launch([sys.executable, "-c", hangs], 5, dict(os.environ), "c")
    assert hung["status"] == "timed out" and time.perf_counter() - start < 30
    assert wait_until_dead([int(worker_pid.read_text())])


def wait_until_dead(pids: list[int], seconds: float = 30) -> bool:
    """Every one of pids dead (a zombie until init reaps it, or gone) within the time: SIGKILL takes a moment."""

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return not f.read().split(") ")[-1].startswith("Z")
        except FileNotFoundError:
            return False

    deadline = time.time() + seconds
    while any(map(alive, pids)) and time.time() < deadline:
        time.sleep(0.1)
    return not any(map(alive, pids))


def marked_processes(work) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"{check.MARKER}={work}:".encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_a_stopped_check_kills_every_process_of_its_parts_and_keeps_the_report(tmp_path):
    """SIGTERM (as Ctrl-C) while a part runs rloo.py: nothing of it runs on, the report says what was interrupted; and
    while it ran, a second check on its work folder was refused in one line."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen(
        [
            sys.executable,
            CHECK,
            "--device",
            "cpu",
            "--out",
            out,
            "--work",
            work,
            "--only",
            "rloo_learns",
            "--wheels",
            tmp_path / "none",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = work / "parts" / "rloo_learns" / "run1.log"
    deadline = time.time() + 300
    while not (log.exists() and "updates of 32 completions" in log.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    assert marked_processes(work), "rloo.py is not running"
    second = subprocess.run(
        [sys.executable, CHECK, "--device", "cpu", "--out", tmp_path / "out2", "--work", work],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode != 0 and "Traceback" not in second.stderr
    assert "is in use by another check.py" in second.stderr
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "check.py: stopped by SIGTERM; report in" in stderr
    with open(out / "report.json") as f:
        report = json.load(f)
    assert report["parts"]["rloo_learns"]["status"] == "interrupted" and report["interrupted_by"] == "SIGTERM"
    assert "| rloo_learns | interrupted |" in (out / "report.md").read_text()
    assert wait_until_dead(marked_processes(work))


def test_carried_wheels_go_first_on_the_parts_path(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "kit_probe-1.0-py3-none-any.whl", "w") as z:  # the smallest wheel pip installs
        files = {
            "kit_probe.py": "VALUE = 42\n",
            "kit_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: kit-probe\nVersion: 1.0\n",
            "kit_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        }
        for name, text in files.items():
            z.writestr(name, text)
        record = "kit_probe-1.0.dist-info/RECORD"
        z.writestr(record, "".join(f"{n},,\n" for n in [*files, record]))
    env = {"PYTHONPATH": "/elsewhere"}
    installed = check.install_wheels(str(wheels), str(tmp_path / "work"), env)
    assert installed["wheels"] == ["kit_probe-1.0-py3-none-any.whl"]
    assert env["PYTHONPATH"] == f"{tmp_path / 'work' / 'site'}{os.pathsep}/elsewhere"
    probe = subprocess.run(
        [sys.executable, "-c", "import kit_probe; print(kit_probe.VALUE)"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert probe.stdout.strip() == "42", probe.stderr
    assert "none in" in check.install_wheels(str(tmp_path / "absent"), str(tmp_path / "work2"), {})["wheels"]


@pytest.mark.parametrize(
    "option, needle",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--jobs", "0"], "--jobs is 0: give at least 1"),
        (["--out", "{tmp}/a_file"], "is a file: give a folder for report.md"),
        (["--out", "{tmp}/old_report"], "holds a report already: give another folder"),
        (["--work", "{tmp}/home"], "holds files the kit did not make: give a new or empty folder"),
        (["--peak_tflops", "0"], "--peak_tflops is 0.0: give a positive number"),
        (["--bandwidth_tbps", "nan"], "--bandwidth_tbps is nan: give a positive number"),
    ],
)
@pytest.mark.slow
def test_bad_options_are_one_line_and_touch_nothing(option, needle, tmp_path):
    (tmp_path / "a_file").write_text("mine\n")
    (tmp_path / "old_report").mkdir()
    (tmp_path / "old_report" / "report.md").write_text("the first GPU's\n")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").mkdir()  # a folder of the user's that the kit would replace
    args = ["--device", "cpu", "--out", str(tmp_path / "out"), *(a.format(tmp=tmp_path) for a in option)]
    proc = subprocess.run([sys.executable, CHECK, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("check.py: error: ") and needle in proc.stderr, proc.stderr
    assert (tmp_path / "a_file").read_text() == "mine\n" and (tmp_path / "home" / "models").is_dir()
    assert (tmp_path / "old_report" / "report.md").read_text() == "the first GPU's\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_asking_for_cuda_without_one_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, CHECK, "--out", tmp_path / "r", "--wheels", tmp_path / "none"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        timeout=300,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "check.py: error: torch sees no CUDA device here" in proc.stderr
    assert "--device cpu --size tiny" in proc.stderr


# ---- The numbers against the hardware --------------------------------------------------------------------------------


def timing(**numbers) -> dict:
    """A timing's results as the parts write them, of round numbers: 1e9 parameters in bf16, 256 decoding steps of 32
    completions in 5.12 s, 10,000 tokens trained in a forward-backward of 0.5 s and an update of 6 s."""
    return {
        "workload": {"completions": 32, "generations": 4, "max_tokens": 256, "updates": 5, "bf16": True},
        "cache_implementation": "auto",
        "sampler_weights": "a bfloat16 copy",
        "seconds_per_update": 6.0,
        "seconds_per_update_min": 5.5,
        "tokens_per_completion": 256.0,
        "parameters": 1_000_000_000,
        "trainable_parameters": 1_000_000_000,
        "generation_bytes_per_parameter": 2,
        "generation_seconds": 5.12,
        "decoding_steps": 256.0,
        "generated_tokens": 8192.0,
        "trained_tokens": 10_000.0,
        "forward_backward_seconds": 0.5,
        **numbers,
    }


def test_the_hardware_numbers_are_their_formulas_by_hand():
    device = check.hardware(None, peak_tflops=1000.0, bandwidth_tbps=2.0)
    h = check.against_hardware(timing(), device)
    assert h["generation_tokens_per_second"] == 1600  # 8192 tokens / 5.12 s
    assert h["decoding_steps_per_second"] == 50  # 256 steps / 5.12 s
    assert h["decode_step_ms"] == 20  # 5.12 s / 256
    assert h["bandwidth_bound_step_ms"] == 1  # 1e9 parameters x 2 bytes / 2e12 bytes a second
    assert h["x_from_bandwidth_bound"] == 20
    assert h["training_tflop_per_update"] == 60  # 6 x 1e9 x 10,000 tokens
    assert h["training_tflops"] == 120  # in 0.5 s
    assert h["mfu"] == 0.12  # of 1,000 TFLOP/s
    assert h["mfu_update"] == 0.01  # 60 TFLOP in the update's 6 s: 10 TFLOP/s
    fp32 = check.against_hardware(timing(generation_bytes_per_parameter=4), device)  # a step reads twice the bytes
    assert fp32["bandwidth_bound_step_ms"] == 2 and fp32["x_from_bandwidth_bound"] == 10
    lora = check.against_hardware(timing(trainable_parameters=10_000_000), device)  # 6 FLOPs per *trained* parameter
    assert lora["mfu"] == 0.0012 and lora["bandwidth_bound_step_ms"] == 1  # generation still reads every weight
    unknown = check.against_hardware(timing(), check.hardware(None))
    assert unknown["generation_tokens_per_second"] == 1600 and unknown["training_tflops"] == 120  # the device's own
    assert unknown["mfu"] is unknown["mfu_update"] is unknown["bandwidth_bound_step_ms"] is None
    assert unknown["x_from_bandwidth_bound"] is None


@pytest.mark.parametrize(
    "name, peak, bandwidth",
    [
        ("NVIDIA H200", 989.0, 4.8),
        ("NVIDIA H100 80GB HBM3", 989.0, 3.35),
        ("NVIDIA H100 PCIe", 756.0, 2.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 2.039),
        ("NVIDIA A100-SXM4-40GB", 312.0, 1.555),
        ("NVIDIA L40S", 362.0, 0.864),
    ],
)
def test_a_known_device_s_peak_and_bandwidth_come_from_the_table(name, peak, bandwidth):
    found = check.hardware(name)
    assert (found["peak_tflops"], found["bandwidth_tbps"]) == (peak, bandwidth)
    assert found["peak_from"] == found["bandwidth_from"] == "the kit's table" and found["device"] == name


@pytest.mark.parametrize(
    "name", [None, "NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H200 NVL", "nvidia h200"]
)
def test_an_unknown_device_or_a_cpu_has_no_peak_unless_given(name):
    """Not the table's card (a MIG slice, another variant, a CPU): nothing assumed, and the options fill it in."""
    found = check.hardware(name)
    assert found["peak_tflops"] is found["bandwidth_tbps"] is found["peak_from"] is found["bandwidth_from"] is None
    given = check.hardware(name, peak_tflops=100.0, bandwidth_tbps=1.5)
    assert (given["peak_tflops"], given["peak_from"]) == (100.0, "--peak_tflops")
    assert (given["bandwidth_tbps"], given["bandwidth_from"]) == (1.5, "--bandwidth_tbps")


def test_an_option_replaces_the_table_s_number_alone():
    found = check.hardware("NVIDIA H200", peak_tflops=500.0)
    assert (found["peak_tflops"], found["peak_from"]) == (500.0, "--peak_tflops")
    assert (found["bandwidth_tbps"], found["bandwidth_from"]) == (4.8, "the kit's table")


def synthetic_report(
    device: dict, names=("timing_rloo", "timing_rloo_no_compile", "timing_trl", "timing_trl_static")
) -> dict:
    """A report of the four timings on made-up results (1.2e9 parameters: a bf16 step's floor at 4.8 TB/s is 0.5 ms):
    rloo.py 4 s per update compiled and 8 s not, TRL 10 s with its default and 5 s static."""
    seconds = {"timing_rloo": 4.0, "timing_rloo_no_compile": 8.0, "timing_trl": 10.0, "timing_trl_static": 5.0}
    numbers = dict(parameters=1_200_000_000, trainable_parameters=1_200_000_000, generation_seconds=2.56)
    return {
        "command": "python benchmark/gpu/check.py --out r",
        "started": "2026-11-28",
        "device": "cuda",
        "size": "full",
        "seconds": 60.0,
        "wheels": [],
        "environment": {"devices": [device["device"]]},
        "hardware": device,
        "parts": {
            name: {"status": "passed", "results": timing(**numbers, seconds_per_update=seconds[name])} for name in names
        },
    }


def test_the_report_shows_each_timing_against_the_hardware_and_rloo_over_trl(tmp_path):
    check.write_report(str(tmp_path), synthetic_report(check.hardware("NVIDIA H200")))
    markdown = (tmp_path / "report.md").read_text()
    assert "Peak assumed: NVIDIA H200: 989.0 TFLOP/s dense bf16 (the kit's table), 4.8 TB/s" in markdown
    # 8192 tokens and 256 steps in 2.56 s; 10 ms a step against 1.2e9 x 2 B / 4.8 TB/s = 0.5 ms; 6 x 1.2e9 x 10,000 =
    # 72 TFLOP in 0.5 s: 144 TFLOP/s, 14.6% of 989; over the 4 s update 18 TFLOP/s, 1.8%
    assert (
        "| timing_rloo | auto | a bfloat16 copy | 3200 | 100.0 | 10.00 | 0.500 | 20 | 144 | 14.6% | 1.8% |" in markdown
    )
    assert (
        "| timing_trl | auto | a bfloat16 copy | 3200 | 100.0 | 10.00 | 0.500 | 20 | 144 | 14.6% | 0.7% |" in markdown
    )
    assert "rloo.py / TRL, compile on (timing_rloo / timing_trl_static): 4.0 / 5.0 s per update = 0.80" in markdown
    assert (
        "rloo.py / TRL, compile off (timing_rloo_no_compile / timing_trl): 8.0 / 10.0 s per update = 0.80" in markdown
    )
    assert "| decoding steps | 256.0 | 256.0 | 256.0 | 256.0 |" in markdown
    saved = json.loads((tmp_path / "report.json").read_text())["parts"]["timing_rloo"]["results"]["against_hardware"]
    assert saved["x_from_bandwidth_bound"] == 20 and saved["mfu"] == pytest.approx(144 / 989, abs=1e-6)


def test_the_report_says_the_peak_is_unknown_rather_than_make_one_up(tmp_path):
    """A device not in the table: the hardware cells say how to give the peak; the device's own numbers stay."""
    report = synthetic_report(check.hardware("NVIDIA GeForce RTX 4090"), names=("timing_rloo", "timing_trl"))
    check.write_report(str(tmp_path), report)
    markdown = (tmp_path / "report.md").read_text()
    unknown = check.UNKNOWN_PEAK
    assert f"Peak assumed: NVIDIA GeForce RTX 4090: {unknown}" in markdown
    assert (
        f"| timing_rloo | auto | a bfloat16 copy | 3200 | 100.0 | 10.00 | {unknown} | {unknown} | 144 | {unknown} | "
        f"{unknown} |"
    ) in markdown
    assert "rloo.py / TRL, compile" not in markdown  # neither pair ran whole
    report["hardware"] = check.hardware("NVIDIA GeForce RTX 4090", peak_tflops=165.2)  # given: its MFU, no floor
    check.write_report(str(tmp_path), report)
    assert "| 144 | 87.2% | 10.9% |" in (tmp_path / "report.md").read_text()  # 144 / 165.2; 18 / 165.2


def test_parameters_are_counted_from_the_saved_weights_a_tied_head_once(tmp_path):
    import torch
    from safetensors.torch import save_file

    path, _ = check.build_timing_model(str(tmp_path / "timing"), "tiny", "cpu")
    # embeddings 4096 x 128 (the LM head tied to them); per layer q 128x128, k and v 128x64, o 128x128, the MLP
    # 3 x 128 x 256, 2 norms of 128; 2 layers; the final norm
    per_layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256 + 2 * 128
    assert check.count_parameters(path) == 4096 * 128 + 2 * per_layer + 128 == 819_840
    shards = tmp_path / "shards"  # two files, and a writer that kept the tied head: counted once
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4)}, str(shards / "model-1.safetensors"))
    save_file({"lm_head.weight": torch.zeros(10, 4), "norm": torch.zeros(4)}, str(shards / "model-2.safetensors"))
    assert check.count_parameters(str(shards)) == 44
    (shards / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))  # untied: a head of its own
    assert check.count_parameters(str(shards)) == 84


def test_trl_static_is_skipped_with_its_reason_where_trl_s_config_lacks_the_field(tmp_path, monkeypatch):
    old_trl = tmp_path / "old" / "trl"
    old_trl.mkdir(parents=True)
    (old_trl / "__init__.py").write_text(  # a TRL whose RLOOConfig predates the field
        "import dataclasses\n__version__ = '0.9.6'\n\n\n@dataclasses.dataclass\nclass RLOOConfig:\n    beta: int = 0\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "old"))
    part = types.SimpleNamespace(trl_python=sys.executable, size="smoke", device="cpu")
    with pytest.raises(check.Skip, match="TRL 0.9.6's RLOOConfig has no cache_implementation"):
        check.timing_trl(part, "static")
    monkeypatch.delenv("PYTHONPATH")
    version, fields = check.trl_version(
        types.SimpleNamespace(trl_python=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    )
    assert version == "1.16.0" and "cache_implementation" in fields  # the TRL the kit carries: timing_trl_static runs


# ---- The sampler's weights, the sampler-trainer gap, the profile -----------------------------------------------------


@pytest.mark.parametrize(
    "output, expected",
    [
        (
            "HF generate samples from a bfloat16 copy of the policy's float32 weights, refreshed after each update\n",
            ("bfloat16 copy", "bfloat16", "float32", "a bfloat16 copy of the policy's float32 weights"),
        ),
        (  # rich wraps a long line where the console is narrow
            "loading\nHF generate samples from a float16 copy of the\npolicy's float32 weights, refreshed after each "
            "optimizer step\nrun run: 5 updates",
            ("float16 copy", "float16", "float32", "a float16 copy of the policy's float32 weights"),
        ),
        (
            "HF generate samples from the policy's own float32 weights\n",
            ("policy", "float32", "float32", "the policy's own float32 weights"),
        ),
        (
            "HF generate samples from the policy's own bfloat16 weights\n",
            ("policy", "bfloat16", "bfloat16", "the policy's own bfloat16 weights"),
        ),
    ],
)
def test_which_weights_sampled_is_read_from_the_line_rloo_prints(output, expected):
    said = check.sampler_said(output)
    assert (said["weights"], said["dtype"], said["policy_dtype"], said["said"]) == expected


def test_a_run_that_says_nothing_of_its_sampler_reads_as_none():
    assert check.sampler_said("run run: 5 updates of 32 completions, device cuda\nsaved the trained model") is None
    assert check.sampler_said("HF generate keeps a dynamic KV cache, uncompiled: image prompts") is None


@pytest.mark.parametrize(
    "sampler, bf16, options, expected",
    [
        ({"weights": "bfloat16 copy", "dtype": "bfloat16"}, True, {}, 2),
        ({"weights": "float16 copy", "dtype": "float16"}, False, {}, 2),  # a copy's 2, on a CPU too
        ({"weights": "policy", "dtype": "float32"}, True, {}, 2),  # bf16 autocast's cast weights
        ({"weights": "policy", "dtype": "float32"}, False, {}, 4),
        ({"weights": "policy", "dtype": "bfloat16"}, False, {"dtype": "bfloat16"}, 2),
        (None, False, {}, 4),  # no line: as rloo.py's auto takes the options, on a CPU the fp32 policy
        (None, False, {"sampler_weights": "float16"}, 2),
        (None, False, {"dtype": "bfloat16"}, 2),
        (None, True, {"sampler_weights": "policy"}, 2),
    ],
)
def test_a_decoding_step_reads_the_bytes_of_the_weights_that_sample(sampler, bf16, options, expected):
    assert check.sampling_bytes(sampler, bf16, options) == expected


def test_the_cache_said_is_the_option_and_what_auto_came_to():
    assert check.cache_used(None, "cuda", "run run: ...") == "auto: static, compiled"
    assert check.cache_used(None, "cpu", "") == "auto: dynamic"
    said = "HF generate keeps a dynamic KV cache, uncompiled: --bf16 computes in\nbfloat16 over float32 weights"
    assert check.cache_used(None, "cuda", said) == "auto: dynamic (rloo.py said why)"
    assert check.cache_used("static", "cpu", "") == "static, compiled"
    assert check.cache_used("dynamic", "cuda", "") == "dynamic"


def gap_row(difference: float, largest: float, kl: float, ratios=None) -> dict:
    """An update's metrics as rloo.py logs them with a copy of other numerics sampling."""
    row = {
        "episode": 32,
        "reward": 1.0,
        "sampling/sampling_logp_difference/mean": difference,
        "sampling/sampling_logp_difference/max": largest,
        "sampling/kl": kl,
    }
    if ratios is not None:
        low, mean, high, clipped = ratios
        row.update(
            {
                "sampling/importance_sampling_ratio/min": low,
                "sampling/importance_sampling_ratio/mean": mean,
                "sampling/importance_sampling_ratio/max": high,
                "sampling/importance_sampling_ratio/clipped_fraction": clipped,
            }
        )
    return row


def test_the_gap_is_each_metric_s_mean_over_the_updates_and_its_extremes():
    rows = [
        gap_row(0.01, 0.2, 1e-4, (0.5, 1.0, 2.0, 0.0)),
        gap_row(0.03, 0.6, 3e-4, (0.25, 1.1, 5.0, 0.125)),
        {"episode": 96, "reward": 2.0},  # an update that logged none: left out of the means
    ]
    gap = check.gap_summary(rows)
    assert gap["updates_with_gap"] == 2
    means = gap["mean_over_updates"]
    assert means["sampling/sampling_logp_difference/mean"] == pytest.approx(0.02)
    assert means["sampling/sampling_logp_difference/max"] == pytest.approx(0.4)
    assert means["sampling/kl"] == pytest.approx(2e-4)
    assert means["sampling/importance_sampling_ratio/min"] == pytest.approx(0.375)
    assert means["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.05)
    assert means["sampling/importance_sampling_ratio/clipped_fraction"] == pytest.approx(0.0625)
    assert gap["extremes_over_updates"] == {
        "sampling/sampling_logp_difference/max": 0.6,
        "sampling/importance_sampling_ratio/min": 0.25,
        "sampling/importance_sampling_ratio/max": 5.0,
    }
    uncorrected = check.gap_summary([gap_row(0.01, 0.2, 1e-4)])  # --no_importance_sampling_correction: no ratios
    assert set(uncorrected["mean_over_updates"]) == set(check.GAP_METRICS[:3])
    assert set(uncorrected["extremes_over_updates"]) == {"sampling/sampling_logp_difference/max"}
    assert check.gap_summary([{"episode": 32, "reward": 1.0}]) == {}  # the policy itself sampled


def test_the_report_shows_the_sampler_and_the_gap_of_each_run_and_the_profile(tmp_path):
    report = synthetic_report(check.hardware("NVIDIA H200"), names=("timing_rloo", "timing_rloo_no_compile"))
    timings = report["parts"]
    timings["timing_rloo_policy_weights"] = timings.pop("timing_rloo_no_compile")
    timings["timing_rloo"]["results"]["sampler_gap"] = check.gap_summary(
        [gap_row(0.01, 0.2, 1e-4, (0.5, 1.0, 2.0, 0.0)), gap_row(0.03, 0.6, 3e-4, (0.25, 1.1, 5.0, 0.125))]
    )
    timings["timing_rloo_policy_weights"]["results"].update(sampler_gap={}, sampler_weights="the policy's own")
    float16 = {"sampler_weights": "a float16 copy", **check.gap_summary([gap_row(0.002, 0.05, 1e-5)])}
    report["parts"]["sampler_gap"] = {"status": "passed", "seconds": 30.0, "results": {"runs": {"float16": float16}}}
    table = ["Profiled: rloo.py's update 2", "", "### one HF generate call (...): `generation`", "", "| kernel |"]
    report["parts"]["profile"] = {"status": "passed", "seconds": 40.0, "results": {"table": table}}
    check.write_report(str(tmp_path), report)
    markdown = (tmp_path / "report.md").read_text()
    assert "| timing_rloo_policy_weights | auto | the policy's own | 3200 |" in markdown  # the hardware table's
    assert "| sampler weights | a bfloat16 copy | the policy's own |" in markdown  # the seconds table's
    assert "| sampler_gap | passed | 30.0 | the sampler-trainer gap's table below |" in markdown
    assert "| profile | passed | 40.0 | the table below |" in markdown
    gap = markdown[markdown.index("## The sampler-trainer gap") : markdown.index("## Profile")]
    assert (
        "| timing_rloo | a bfloat16 copy | 2 | 0.02 | 0.4; 0.6 | 0.0002 | 0.375; 0.25 | 1.05 | 3.5; 5 | 0.0625 |" in gap
    )
    assert "| sampler_gap float16 | a float16 copy | 1 | 0.002 | 0.05; 0.05 | 1e-05 | - | - | - | - |" in gap
    assert "timing_rloo_policy_weights" not in gap  # the policy sampled: no gap to show
    profile = markdown[markdown.index("## Profile: one HF generate call, one training forward-backward") :]
    assert profile.splitlines()[2:7] == table


def test_a_profile_is_summed_up_from_torch_s_profiler():
    """profile_step.py's tables from a real torch.profiler run on the CPU: host time only, operators ranked by self
    CPU time; and a CUDA-like summary's table of kernels by their CUDA time."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmark", "gpu"))
    import profile_step

    x = torch.randn(256, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            x = (x @ x).softmax(-1)
    found = profile_step.summarise(prof, 0.5, top=2)
    assert found["device_ms"] is found["device_busy"] is found["kernels"] is None and found["host_ms"] > 0
    assert found["kernel_launches"] == found["graph_launches"] == found["synchronisations"] == 0
    assert found["ranked_by"] == "self CPU time (operators)" and len(found["top"]) == 2
    assert found["top"][0]["ms"] >= found["top"][1]["ms"] and {r["name"] for r in found["top"]} <= {
        "aten::mm",
        "aten::_softmax",
        "aten::softmax",
        "aten::matmul",
    }
    cuda_like = {
        "wall_ms": 100.0,
        "host_ms": 80.0,
        "device_ms": 25.0,
        "device_busy": 0.25,
        "kernels": 5000,
        "kernel_launches": 4000,
        "graph_launches": 256,
        "synchronisations": 3,
        "ranked_by": "CUDA time (kernels and copies)",
        "top": [{"name": "sm90_xmma_gemm|bf16", "calls": 48, "ms": 12.0, "share": 0.48}],
    }
    lines = profile_step.markdown(
        {
            "workload": {"completions": 32, "generations": 4, "max_tokens": 256},
            "profiled_update": 2,
            "options": "rloo.py's defaults",
            "device": "NVIDIA H200",
            "sampler_weights": "a bfloat16 copy of the policy's float32 weights",
            "cache": "auto: static, compiled",
            "stages": {"generation": cuda_like},
        }
    )
    assert lines[0].startswith("Profiled: rloo.py's update 2 of the timing workload (32 completions, 8 prompts x 4")
    assert (
        "wall 100.0 ms; host (CPU) 80.0 ms; device 25.0 ms, busy 25% of the wall; 5,000 kernels; 4,000 kernel "
        "launches, 256 CUDA graph launches, 3 synchronisations by the host" in lines
    )
    assert "| kernel | calls | CUDA ms | share | mean us |" in lines
    assert "| `sm90_xmma_gemm/bf16` | 48 | 12.000 | 48.0% | 250.0 |" in lines


@pytest.mark.slow
def test_profile_step_profiles_rloo_s_update_on_the_cpu(tmp_path):
    """benchmark/gpu/profile_step.py alone at --size smoke (the tiny timing model built in --work): its run's update 2
    profiled, both stages' tables written, rloo.py's options after `--` passed on."""
    out = tmp_path / "profile"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmark", "gpu", "profile_step.py"),
            "--out",
            out,
            "--size",
            "smoke",
            "--work",
            tmp_path / "work",
            "--top",
            "5",
            "--",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = json.loads((out / "profile.json").read_text())
    assert found["options"] == "--seed 3" and found["command"].endswith("--run_name run --seed 3")
    assert found["device"] == "cpu" and found["profiled_update"] == 2 and found["cache"] == "auto: dynamic"
    assert found["sampler_weights"] == "the policy's own float32 weights"
    for stage in ("generation", "policy_forward_backward"):
        numbers = found["stages"][stage]
        assert numbers["device_ms"] is None and 0 < numbers["host_ms"] and len(numbers["top"]) == 5, stage
    markdown = (out / "profile.md").read_text()
    assert "### one HF generate call" in markdown and "### one training forward-backward" in markdown
    assert markdown.count("| operator | calls | self CPU ms | share | mean us |") == 2
    assert (out / "runs" / "run" / "metrics.jsonl").exists()  # the run's folder in --out
