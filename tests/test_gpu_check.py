"""benchmark/gpu/check.py, the kit a lent GPU runs, run whole on the CPU with tiny models so that it never rots; and its
plumbing: a part that fails or hangs (its workers in sessions of their own, as torchrun's are) is reported and killed
without stopping the others, and carried wheels go first on the parts' path."""

import json
import os
import signal
import subprocess
import sys
import time
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
