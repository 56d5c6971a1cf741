"""The sandbox a model-written program runs in, one process per test run: bubblewrap's namespaces where the machine
allows them (no network, its own pid, ipc, uts, mount and user namespaces, read-only system folders, fresh /sandbox
and /tmp), rlimits and a clean environment always, an unprivileged uid, the process group killed at the wall clock and
past an output cap, and a pool that bounds how many run at once. Its user, the reward function code_reward, and the
schemas of its tests: code_reward.py. What each protection holds, and what none does: docs/verifiable.md, "Code:
code_reward"."""

import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from rloo_utils.errors import UsageError

SANDBOX_MODES = ("bwrap", "rlimits")
DEFAULT_TIMEOUT = 10.0  # seconds of one test run: its wall clock and its CPU
DEFAULT_MEMORY_MB = 1024  # its address space (RLIMIT_AS)
PROCESSES = 64  # RLIMIT_NPROC: a fork bomb stops here
FILES = 64  # RLIMIT_NOFILE
FILE_MB = 16  # RLIMIT_FSIZE, and the size of each of bwrap's fresh folders (/sandbox, /tmp)
OUTPUT_BYTES = 1 << 20  # stdout and stderr together; past it the run is killed
STDERR_TAIL = 4096  # bytes of stderr kept: its last line names the error

# Runs in the sandbox's interpreter (python -I -S: no environment variable, no site-packages: the standard library
# alone), reading its job ({"program", "check", "mark"}) from a file descriptor the trainer passes; `site` would add
# exit() and quit(), which programs call. Without a check the program reads the test's input on stdin and prints its
# answer, as `python main.py` would run it; with one (an assert test) it is run as a module named `solution` (its
# `if __name__ == "__main__":` block left out, as in HumanEval's harness), then the check in its
# namespace, then the mark: a secret of this run, so that a program that ends the process early (os._exit(0),
# sys.exit(0)) does not pass for one whose check ran. The mark is a local of main(), out of the program's globals.
RUNNER = """\
import builtins, json, os, sys


def main(job_fd):
    with os.fdopen(job_fd, "rb") as job_file:
        job = json.loads(job_file.read())
    builtins.exit = builtins.quit = sys.exit
    sys.argv = ["main.py"]
    if job["check"] is None:
        exec(compile(job["program"], "main.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        return
    mark, space = job.pop("mark").encode(), {"__name__": "solution", "__builtins__": builtins}
    exec(compile(job["program"], "main.py", "exec"), space)
    exec(compile(job["check"], "test.py", "exec"), space)
    sys.stdout.flush()
    os.write(1, b"\\n" + mark + b"\\n")


main(int(sys.argv.pop()))
"""


@dataclass
class Run:
    """How one test run ended: exited (returncode), or killed at the wall clock ("timeout") or past the output cap
    ("output_limit"); what it printed (stdout whole up to the cap, the end of stderr), and its seconds."""

    status: str
    returncode: Optional[int]
    stdout: bytes
    stderr: bytes
    seconds: float


def base_interpreter() -> str:
    """The interpreter of this Python's base installation, outside any venv (a venv's python is a link to it): it runs
    the code with none of the trainer's packages."""
    real, base = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
    if real.startswith(base + os.sep):
        return real
    named = os.path.join(base, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    return named if os.path.exists(named) else real


def memfd_with(data: bytes) -> int:
    """An anonymous in-memory file holding data, at its start: nothing on disk to leave behind."""
    fd = os.memfd_create("code_reward")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def remove_folder(path: str) -> None:
    """A test run's folder, whatever the code made of it: a folder it made unreadable is opened again first (root
    needs not; a link is never followed)."""
    if os.geteuid() != 0:
        for folder, subfolders, _ in os.walk(path):
            for name in subfolders:
                inner = os.path.join(folder, name)
                if not os.path.islink(inner):
                    os.chmod(inner, 0o700)
    shutil.rmtree(path, ignore_errors=True)


class Sandbox:
    """Where each test run goes: a fresh process under limits (CPU seconds, address space, processes, open files, file
    size, output, wall clock), with a clean environment, run by bubblewrap (mode "bwrap": no network, its own pid, ipc,
    uts, mount and user namespaces, read-only system folders, fresh /sandbox and /tmp) or alone ("rlimits"), as an
    unprivileged uid; at most `workers` at once."""

    def __init__(
        self,
        mode: str = "bwrap",
        timeout: float = DEFAULT_TIMEOUT,
        memory_mb: int = DEFAULT_MEMORY_MB,
        workers: Optional[int] = None,
        python: Optional[str] = None,
    ):
        """mode: "bwrap" or "rlimits" (--code_sandbox); timeout: wall-clock seconds of a test run, and its CPU seconds
        (--code_timeout); memory_mb: its address space (--code_memory_mb); workers: runs at once (--code_workers;
        None: the cores this process may use); python: the interpreter that runs the code (None: this one's base)."""
        if mode not in SANDBOX_MODES:
            raise UsageError(f"code_reward's sandbox is one of {', '.join(SANDBOX_MODES)}, got {mode!r}")
        self.mode, self.timeout, self.memory_mb = mode, timeout, memory_mb
        self.workers = workers or default_workers()
        self.python = python or base_interpreter()
        # root's processes are exempt from RLIMIT_NPROC, even in a user namespace: the code runs as nobody
        self.root = os.geteuid() == 0
        self.uid, self.gid = nobody_ids() if self.root else (os.geteuid(), os.getegid())
        self.tools, self.line, self.pool, self.lock = {}, None, None, threading.Lock()

    def start(self) -> str:
        """Ready to run: its tools found, a tiny program run as every test will be (one line where it cannot), its
        pool of workers made. Returns the line that says which protections are in force. Once; later calls return
        the line."""
        with self.lock:
            if self.line is None:
                self.tools = self.find_tools()
                probe = self.run({"program": "print(6 * 7)", "check": None}, "")
                if probe.status != "exited" or probe.returncode != 0 or probe.stdout != b"42\n":
                    raise UsageError(self.probe_failure(probe))
                self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="code_reward")
                self.line = self.protections()
            return self.line

    def find_tools(self) -> dict[str, str]:
        """The programs a run needs, by name: prlimit (util-linux: the limits); with bwrap also bwrap and, as root,
        setpriv and unshare (util-linux: the uid dropped, a user namespace of its own); without, setpriv (the run
        killed with the trainer). One line for what is missing."""
        if not sys.platform.startswith("linux"):
            raise UsageError(f"code_reward runs code in a sandbox made of Linux's features, and this is {sys.platform}")
        names = ["prlimit"] + (
            ["bwrap"] + (["setpriv", "unshare"] if self.root else []) if self.mode == "bwrap" else []
        )
        names += ["setpriv"] if self.mode == "rlimits" else []
        tools = {name: shutil.which(name) for name in names}
        if tools.get("bwrap", "") is None:
            raise UsageError(
                "code_reward runs the code in a bubblewrap sandbox, and bwrap is not installed: apt install "
                "bubblewrap (Debian/Ubuntu; dnf install bubblewrap on Fedora), or opt in to limits and a clean "
                "environment alone with --code_sandbox rlimits (the network and the files the code's uid may write "
                "are then NOT protected)"
            )
        absent = [name for name, path in tools.items() if path is None]
        if absent:
            raise UsageError(
                f"code_reward needs {' and '.join(absent)} of util-linux, which the PATH does not hold: apt install "
                "util-linux (Debian/Ubuntu), or leave code_reward out"
            )
        if not os.access(self.python, os.X_OK):
            raise UsageError(f"code_reward's interpreter {self.python} cannot be run")
        return tools

    def probe_failure(self, probe: Run) -> str:
        """The one line of a sandbox that could not run `print(6 * 7)`: what it said, and the way out (bwrap's own
        complaint: the namespaces; else: the interpreter, as the code's uid and under the limits)."""
        said = (probe.stderr or probe.stdout).decode("utf-8", "replace").strip().splitlines()
        what = said[-1][:200] if said else f"{probe.status}, exit code {probe.returncode}"
        if probe.status == "timeout":
            fix = f"give --code_timeout more than {self.timeout:g} s: the interpreter did not even start within it"
        elif what.startswith("bwrap:"):
            fix = (
                "bubblewrap needs namespaces the kernel allows (as a user: kernel.unprivileged_userns_clone=1 and "
                "user.max_user_namespaces > 0; in a container, one allowed to make them), or opt in to limits and a "
                "clean environment alone with --code_sandbox rlimits (the network and the files the code's uid may "
                "write are then NOT protected)"
            )
        elif self.mode == "rlimits" and self.root and "Permission denied" in what:
            fix = (
                f"the code runs as uid {self.uid}, which must be able to run {self.python} (a folder above it may be "
                "private to root): install bubblewrap (apt install bubblewrap), which shows it the interpreter, or "
                "train as a user other than root"
            )
        else:
            fix = f"check that {self.python} runs, and that --code_memory_mb {self.memory_mb} leaves it room to start"
        return f"code_reward could not run a test program in its {self.mode} sandbox ({what}): {fix}"

    def protections(self) -> str:
        """The start line: the protections in force, the limits, how many run at once."""
        limits = (
            f"limits: cpu {self.cpu_seconds()} s, memory {self.memory_mb} MiB, {PROCESSES} processes, {FILES} open "
            f"files, {FILE_MB} MiB a file, {OUTPUT_BYTES >> 20} MiB output, wall {self.timeout:g} s; "
            f"{self.workers} at once"
        )
        who = f"as uid {self.uid}" if self.root else f"as your uid {self.uid}"
        if self.mode == "rlimits":
            exposed = (
                f"the network, and the files and processes uid {self.uid} can reach"
                if self.root
                else "the network, and your own files and processes (the trainer's included)"
            )
            return (
                f"code_reward: rlimits only (--code_sandbox rlimits; NOT protected: {exposed}): no environment "
                f"variable, a fresh folder in {tempfile.gettempdir()} as its working folder, {who}; {limits}"
            )
        version = subprocess.run(
            [self.tools["bwrap"], "--version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        prefix = interpreter_prefix(self.python)
        shown = "/usr" if prefix == "/usr" or prefix.startswith("/usr/") else f"/usr and {prefix}"
        return (
            f"code_reward: {version or 'bubblewrap'} sandbox (no network; own pid, ipc, uts, mount and user "
            f"namespaces; read-only {shown}, nothing else of this machine's files; "
            f"fresh {FILE_MB} MiB /sandbox and /tmp; no environment variable), {who} without capabilities; {limits}"
        )

    def cpu_seconds(self) -> int:
        return max(1, int(-(-self.timeout // 1)))  # RLIMIT_CPU counts whole seconds: the timeout, rounded up

    def limited(self, job_fd: int) -> list[str]:
        """The interpreter's command under prlimit's limits: SIGXCPU at the CPU seconds (SIGKILL one later), the
        address space, processes (counted in the run's own user namespace under bwrap; over the uid's processes
        without it), open files, a file's size, no core file."""
        cpu = self.cpu_seconds()
        return [
            self.tools["prlimit"],
            f"--cpu={cpu}:{cpu + 1}",
            f"--as={self.memory_mb << 20}",
            f"--nproc={PROCESSES}",
            f"--nofile={FILES}",
            f"--fsize={FILE_MB << 20}",
            "--core=0",
            "--",
            self.python,
            "-I",
            "-S",
            "-c",
            RUNNER,
            str(job_fd),
        ]

    def bwrap_command(self, job_fd: int) -> list[str]:
        """bwrap's command line: every namespace (network: loopback alone), the system's folders and the interpreter's
        read-only and nothing else of the machine's files, fresh tmpfs folders of FILE_MB each (/sandbox, the working
        folder, and /tmp), no environment variable but PATH, LANG and HOME; killed with its parent. Run by root, bwrap
        keeps its privileges to set this up, and the code runs as nobody without capabilities, in a user namespace of
        its own (where RLIMIT_NPROC counts its processes alone); run by another user, bwrap makes that namespace."""
        command = [self.tools["bwrap"], "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
        command += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
        if not self.root:
            command += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        command += read_only_system(self.python) + ["--proc", "/proc", "--dev", "/dev"]
        for folder in ("/tmp", "/sandbox"):
            command += ["--perms", "1777", "--size", str(FILE_MB << 20), "--tmpfs", folder]
        # bwrap's own tmpfs (the root, /dev) read-only: run by a user they are that user's, and not limited in size
        command += ["--remount-ro", "/dev", "--remount-ro", "/"]
        command += ["--chdir", "/sandbox", "--clearenv"]
        for name, value in clean_environment("/sandbox").items():
            command += ["--setenv", name, value]
        command.append("--")
        if self.root:
            ids = [f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--inh-caps=-all"]
            command += [self.tools["setpriv"], *ids, "--bounding-set=-all", "--no-new-privs", "--"]
            command += [self.tools["unshare"], "--user", "--"]
        return command + self.limited(job_fd)

    def run(self, job: dict, stdin: str) -> Run:
        """One test run in a process of its own, its folder removed after: job is the runner's ({"program", "check",
        "mark"}), stdin the program's input. The process group is killed at the wall clock, past OUTPUT_BYTES of
        output, and at its end (whatever it left behind in its group)."""
        job_fd, stdin_fd = memfd_with(json.dumps(job).encode()), memfd_with(stdin.encode())
        folder = None
        try:
            if self.mode == "bwrap":
                command, folder_of_run, identity = self.bwrap_command(job_fd), "/", {}
            else:
                folder = folder_of_run = tempfile.mkdtemp(prefix="code_reward_")
                # killed with this thread, as bwrap's --die-with-parent does (the trainer's end, a failure)
                command = [self.tools["setpriv"], "--pdeathsig", "KILL", "--"] + self.limited(job_fd)
                identity = {}
                if self.root:
                    os.chown(folder, self.uid, self.gid)
                    identity = {"user": self.uid, "group": self.gid, "extra_groups": []}
            start = time.monotonic()
            proc = subprocess.Popen(
                command,
                stdin=stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(job_fd,),
                cwd=folder_of_run,
                env=clean_environment(folder_of_run),
                start_new_session=True,  # its own process group, killed whole
                **identity,
            )
        except BaseException:
            if folder:
                remove_folder(folder)
            raise
        finally:
            os.close(job_fd)
            os.close(stdin_fd)
        try:
            status, stdout, stderr = read_until_exit(proc, start + self.timeout)
        finally:
            end_group(proc)
            if folder:
                remove_folder(folder)
        return Run(status, proc.returncode, stdout, stderr, time.monotonic() - start)

    def run_all(self, jobs: list[tuple[dict, str]]) -> list[Run]:
        """Each (job, stdin) run, at most `workers` at once; in their order."""
        self.start()
        return list(self.pool.map(self.run, *zip(*jobs))) if jobs else []


def default_workers() -> int:
    """The cores this process may use, shared among the processes torchrun started on this machine (rloo_multigpu.py:
    each process scores its own completions)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def nobody_ids() -> tuple[int, int]:
    """The uid and gid of nobody, whom root's test runs run as (65534 where the system has no such user)."""
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def clean_environment(home: str) -> dict[str, str]:
    """All the environment a test run gets: none of the trainer's variables (its tokens, its paths)."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home}


def interpreter_prefix(python: str) -> str:
    """The installation an interpreter belongs to: the folder above its bin/."""
    return os.path.dirname(os.path.dirname(python))


def read_only_system(python: str) -> list[str]:
    """bwrap's binds of what the interpreter needs, read-only: /usr, the top-level folders of the system (a link where
    they are links to /usr, as on Debian), the dynamic linker's cache, and the interpreter's own installation where it
    is elsewhere (here pyenv's under /root: the folders above it made, empty, so that nothing else of /root shows)."""
    binds = ["--ro-bind", "/usr", "/usr"]
    tops = ["/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            binds += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            binds += ["--ro-bind", top, top]
            tops.append(top)
    binds += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefix = interpreter_prefix(python)
    if not any(prefix == top or prefix.startswith(top + "/") for top in tops):
        parts = prefix.strip("/").split("/")
        for depth in range(1, len(parts)):  # made 0755 here: as bwrap makes them they copy the host's modes
            binds += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
        binds += ["--ro-bind", prefix, prefix]
    return binds


def read_until_exit(proc: subprocess.Popen, deadline: float) -> tuple[str, bytes, bytes]:
    """Read the process's stdout and stderr until both close and it exits ("exited"), the deadline passes
    ("timeout"), or they hold more than OUTPUT_BYTES together ("output_limit"): stdout whole, stderr's last
    STDERR_TAIL bytes. The process is left unreaped (end_group kills its group first: its id cannot be reused)."""
    stdout, stderr, total = [], b"", 0
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", b"".join(stdout), stderr
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                total += len(chunk)
                if total > OUTPUT_BYTES:
                    return "output_limit", b"".join(stdout), stderr
                if key.fileobj is proc.stdout:
                    stdout.append(chunk)
                else:
                    stderr = (stderr + chunk)[-STDERR_TAIL:]
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:  # exited, not yet reaped
        if time.monotonic() > deadline:
            return "timeout", b"".join(stdout), stderr
        time.sleep(0.002)
    return "exited", b"".join(stdout), stderr


def end_group(proc: subprocess.Popen) -> None:
    """Kill the run's process group (under bwrap: bwrap, whose sandbox dies with it, every process of its pid
    namespace killed), then reap the process; its pipes closed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
