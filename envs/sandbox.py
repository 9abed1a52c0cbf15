"""Run an untrusted Python program in a bubblewrap (``bwrap``) sandbox, with hard limits.

What the program sees: a read-only root built from the host's ``/usr`` (and the ``/lib*``, ``/bin``
links or directories beside it, and the interpreter's own prefix when it lives elsewhere), the
program's own directory read-only at ``/sandbox``, a private ``/proc`` and ``/dev``, and one
writable scratch directory, ``/tmp``, a tmpfs of ``scratch_bytes``. Nothing else of the host: no
``/etc``, no home directories, no ``/work``. It runs in new user, pid, network, ipc and uts
namespaces (``--unshare-all``; the network namespace has only a down loopback, so no socket reaches
anything), may not create further user namespaces, and dies with its parent.

Limits: ``envs/sandbox_harness.py`` (the launcher, the sandbox's first Python code) sets the
address-space, CPU-time, process-count, file-size, open-files and core limits on itself before it
runs the program; the host kills the whole sandbox after ``wall_seconds`` or when stdout or stderr
passes ``output_bytes`` (reading stops there, so a program that prints 1 GB costs the host at most
that much). Killing ``bwrap`` ends the sandbox's pid namespace and so every process in it.

The process-count limit only holds for an unprivileged user: the kernel does not apply
RLIMIT_NPROC to root. Run as root (containers, CI), the sandbox is started as ``nobody``
(uid 65534) instead; inside a fresh user namespace the count is per sandbox, so parallel
sandboxes do not share it.

Without a working ``bwrap`` ``Sandbox()`` raises ``SandboxUnavailable`` with the install line; it
never falls back to running the program unsandboxed.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time

INSTALL_HINT = (
    "the code_exec env runs programs only inside bubblewrap: install it with "
    "`apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap` (Fedora), and allow "
    "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 where that knob exists)"
)
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
with open(HARNESS, encoding="utf-8") as _f:
    HARNESS_TEXT = _f.read()
NOBODY = 65534
# Interpreters tried in order; a system interpreter is readable by ``nobody`` (a pyenv or venv one
# under /root usually is not).
PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot start a sandbox here; the message says why and how to fix it."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. wall_seconds: host-side kill (RAGEN DeepCoder: 3 s per test); cpu_seconds:
    RLIMIT_CPU; memory_bytes: RLIMIT_AS (address space); max_processes: RLIMIT_NPROC inside the
    sandbox's user namespace; output_bytes: stdout and stderr each, and RLIMIT_FSIZE;
    scratch_bytes: size of the /tmp tmpfs; open_files: RLIMIT_NOFILE."""

    wall_seconds: float = 3.0
    cpu_seconds: int = 3
    memory_bytes: int = 512 * 2**20
    max_processes: int = 16
    output_bytes: int = 2**20
    scratch_bytes: int = 16 * 2**20
    open_files: int = 64


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one sandboxed run produced. ok: exited with status 0, in time, within the output cap."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_exceeded: bool
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


def default_python() -> str:
    for path in PYTHON_CANDIDATES:
        if os.path.exists(path):
            return path
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _root_mounts(python: str) -> list[str]:
    """bwrap arguments for a read-only root: /usr, the merged-/usr links (or directories), and the
    interpreter's prefix when it is not under /usr."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    real = os.path.realpath(python)
    if not real.startswith("/usr/"):
        prefix = os.path.dirname(os.path.dirname(real))
        args += ["--ro-bind", prefix, prefix]
    return args


class Sandbox:
    """``Sandbox(limits).run(mode, program, stdin, call=None) -> RunResult``.

    mode "stdio": run ``program`` as ``__main__`` with ``stdin``; "call": define it, call
    ``call = (func_name, args_repr)`` and print the repr-free ``str`` of the result as JSON on the last
    stdout line (see ``envs/sandbox_harness.py``). Construction checks bwrap once per (bwrap, python)
    and raises ``SandboxUnavailable`` when it cannot run.
    """

    _checked: dict[tuple[str, str], str | None] = {}

    def __init__(self, limits: SandboxLimits | None = None, python: str | None = None, bwrap: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.python = python or default_python()
        found = bwrap or shutil.which("bwrap")
        if found is None:
            raise SandboxUnavailable(f"bwrap (bubblewrap) is not installed; {INSTALL_HINT}")
        self.bwrap = found
        key = (self.bwrap, self.python)
        if key not in Sandbox._checked:
            Sandbox._checked[key] = self._probe()
        if Sandbox._checked[key] is not None:
            raise SandboxUnavailable(Sandbox._checked[key])

    def _probe(self) -> str | None:
        """None when a trivial program runs in the sandbox; otherwise why not, in one line."""
        try:
            result = self.run("stdio", "print(6 * 7)", "")
        except OSError as error:
            return f"bwrap at {self.bwrap} cannot be started ({error}); {INSTALL_HINT}"
        if result.stdout.strip() == "42":
            return None
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return (f"bwrap cannot run {self.python} in a sandbox here ({why}); if the interpreter is the problem, "
                f"pass python= a system interpreter every user can read; {INSTALL_HINT}")

    def command(self, workdir: str) -> list[str]:
        lim = self.limits
        return [
            self.bwrap, *_root_mounts(self.python), "--ro-bind", workdir, "/sandbox",
            "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--proc", "/proc", "--dev", "/dev",
            "--size", str(lim.scratch_bytes), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            self.python, "-s", "/sandbox/harness.py",
            str(lim.cpu_seconds), str(lim.memory_bytes), str(lim.max_processes), str(lim.output_bytes),
            str(lim.open_files),
        ]

    def run(self, mode: str, program: str, stdin: str, call: tuple[str, str] | None = None) -> RunResult:
        if mode not in ("stdio", "call"):
            raise ValueError(f"mode must be 'stdio' or 'call', got {mode!r}")
        with tempfile.TemporaryDirectory(prefix="ragen-sandbox-") as workdir:
            # The sandbox may run as ``nobody``: its files must be world-readable.
            os.chmod(workdir, 0o755)
            files = {"program.py": program, "mode": mode, "harness.py": HARNESS_TEXT}
            if call is not None:
                files["func_name"], files["args"] = call
            for name, text in files.items():
                path = os.path.join(workdir, name)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(path, 0o644)
            return self._execute(self.command(workdir), stdin)

    def _execute(self, cmd: list[str], stdin: str) -> RunResult:
        lim = self.limits
        drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, **drop)
        threading.Thread(target=_feed, args=(proc.stdin, stdin.encode("utf-8")), daemon=True).start()
        out, err, timed_out, exceeded = _collect(proc, start + lim.wall_seconds, lim.output_bytes)
        if timed_out or exceeded:
            proc.kill()
        returncode = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        return RunResult(returncode, out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace"),
                         timed_out, exceeded, time.monotonic() - start)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the program exited or was killed before reading all of its input


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, the deadline passes, or either passes ``cap`` bytes."""
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as selector:
        for pipe in buffers:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), True, False
            for key, _ in selector.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer += chunk
                if len(buffer) > cap:
                    del buffer[cap:]
                    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), False, True
    # Output closed; the process may still be running (it closed its pipes): wait within the deadline.
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), True, False
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), False, False
