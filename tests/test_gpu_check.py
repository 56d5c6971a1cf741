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


@pytest.mark.slow
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
    assert "bash benchmark/experiments/gsm8k.sh" in kit[1]["parts"]["rloo_gsm8k"]["commands"][0].replace(ROOT + "/", "")
    assert parts["rloo_bf16_saved_model"]["saved_dtype"] == "torch.float32"
    assert parts["rloo_bf16_saved_model"]["fraction_of_weights_changed"] > 0.2
    for name, processes in (("multigpu_1_process", 1), ("multigpu_every_process", 2)):
        result = parts[name]
        assert result["processes"] == processes and result["resume_differences"] == "none: the same run", name
        assert result["killed_after_update"] == 2 and result["resumed"]["updates"] == 3, name  # killed in update 3
        assert len(result["uninterrupted"]["peak_max_rss_gib"]) == processes, name
    memory = parts["memory_per_parameter"]
    assert memory["table"][0] == "| setup | before B/param | after B/param |"
    assert memory["model"].startswith("Llama, hidden 256")
    assert any(line.startswith("| **full + KL: total** | **20.000** |") for line in memory["table"])
    rloo, trl = parts["timing_rloo"], parts["timing_trl"]
    assert set(rloo["stages"]) == set(check.STAGES) and rloo["seconds_per_update"] > sum(rloo["stages"].values())
    assert rloo["workload"] == trl["workload"] and rloo["workload"]["bf16"] is False
    # the same work by each side's own log: as many updates, of as many completions, none past the length asked
    assert rloo["ran"]["updates"] == trl["ran"]["updates"] == rloo["workload"]["updates"] == 2
    assert rloo["ran"]["completions"] == trl["ran"]["completions"] == [rloo["workload"]["completions"]]
    assert 1 < rloo["ran"]["longest"] <= rloo["workload"]["max_tokens"] and 1 < trl["ran"]["longest"] <= 32
    assert rloo["tokens_per_completion"] > 1 and trl["tokens_per_completion"] > 1 and trl["trl"] == "1.16.0"


@pytest.mark.slow
def test_each_timing_with_compile_on_and_off_has_its_numbers_against_the_hardware(kit):
    """The four timings ran what they say (their commands), and each has, from its own run's log, what the hardware
    numbers are made of; on a CPU no peak is assumed: those cells say so, and no number is made up."""
    _, report, markdown = kit
    parts = report["parts"]
    commands = {name: " ".join(parts[name]["commands"]) for name in check.TIMINGS}
    assert "--cache_implementation" not in commands["timing_rloo"] + commands["timing_trl"]  # each side's default
    assert "--cache_implementation dynamic" in commands["timing_rloo_no_compile"]
    assert "benchmark/trl_baseline.py" in commands["timing_trl_static"]
    assert "--cache_implementation static" in commands["timing_trl_static"]
    tiny_parameters = 819_840  # the timing model at size smoke: embeddings 4096 x 128 (tied), 2 layers, a final norm
    for name in check.TIMINGS:
        t = parts[name]["results"]
        w = t["workload"]
        assert t["ran"]["updates"] == 2 and t["ran"]["completions"] == [w["completions"]], name
        assert t["parameters"] == t["trainable_parameters"] == tiny_parameters, name
        bf16_weights = t.get("weights_dtype") == "bfloat16"  # timing_rloo_bf16_weights*: bf16 weights even on a CPU
        assert t["generation_bytes_per_parameter"] == (2 if bf16_weights else 4), name  # else fp32 on a CPU
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
    assert "| part | cache | generation tok/s | decoding steps/s | step ms | bound ms | x from bound |" in markdown
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
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert "check.py: stopped by SIGTERM; report in" in proc.stderr.read()
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
    assert "| timing_rloo | auto | 3200 | 100.0 | 10.00 | 0.500 | 20 | 144 | 14.6% | 1.8% |" in markdown
    assert "| timing_trl | auto | 3200 | 100.0 | 10.00 | 0.500 | 20 | 144 | 14.6% | 0.7% |" in markdown  # 7.2/989
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
    assert f"| timing_rloo | auto | 3200 | 100.0 | 10.00 | {unknown} | {unknown} | 144 | {unknown} | {unknown} |" in (
        markdown
    )
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
