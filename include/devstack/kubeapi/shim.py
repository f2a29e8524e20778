"""Container shim: start one container (or one exec'd process in a running container) with runc, and parent it.

Run as ``python -I -S shim.py SPEC_FILE`` by the local Kubernetes API (standard library only, no
imports from the repository), as containerd runs its runc shim. The spec file (JSON, removed once
read) says:

* ``mode``: ``run`` (``runc run --detach`` of the bundle) or ``exec`` (``runc exec --detach`` of
  ``argv`` in the running container ``id``);
* ``runc``, ``root`` (runc's state directory), ``id``, ``bundle`` (run), ``argv`` (exec),
  ``memory_cgroup`` (run: where the OOM killer's count is read once the container exited),
  ``report_fd`` (a pipe to the server: JSON lines ``{"pid"}``, ``{"started"}`` or ``{"start_error"}``,
  then ``{"exit_code", "signal", "oom"}``).

The container's stdout and stderr are the shim's own, which the server reads; runc's own errors
go to a log file of their own and come back as the start error. The shim is a child subreaper, so
the container's PID 1 becomes its child once runc has started it: it forwards SIGTERM/SIGINT/
SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to it, reports its exit status (128+N for a signal, as container
runtimes do) and, for ``run``, deletes the container (its cgroup and runc state) afterwards. It
dies with the server (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The server's SIGKILL for a container that runc may still be creating: killing the shim then would leave the
# container that the in-flight `runc run --detach` goes on to create without a parent (runtime.Proc).
KILL_REQUEST = signal.SIGRTMIN

libc = ctypes.CDLL(None, use_errno=True)


def runc_error(log_path: str) -> str:
    """The last error runc logged (its JSON log), without runc's own prefix."""
    message = ""
    try:
        with open(log_path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("level") in ("error", "fatal"):
                    message = entry.get("msg", "")
    except OSError:
        pass
    return message or "runc failed without a message"


def oom_killed(memory_cgroup: str | None) -> bool:
    if not memory_cgroup:
        return False
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(memory_cgroup, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip() not in ("", "0"):
                        return True
        except OSError:
            continue
    return False


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.unlink(sys.argv[1])  # it may hold secret-sourced environment values
    report_fd = spec.get("report_fd")
    if report_fd is not None:
        os.set_inheritable(report_fd, False)  # the container must not hold the server's pipe open

    def report(**kv) -> None:
        if report_fd is not None:
            try:
                os.write(report_fd, (json.dumps(kv) + "\n").encode())
            except OSError:
                pass

    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    container = 0
    pending: list[int] = []
    kill_requested = False

    def kill(_signum, _frame) -> None:
        nonlocal kill_requested
        kill_requested = True
        if container:
            try:
                os.kill(container, signal.SIGKILL)
            except ProcessLookupError:
                pass

    signal.signal(KILL_REQUEST, kill)

    def forward(signum, _frame) -> None:
        if container:
            try:
                os.kill(container, signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)

    runc, root, cid = spec["runc"], spec["root"], spec["id"]
    log_path = spec["log"]
    pid_file = log_path + ".pid"
    base = [runc, "--root", root, "--log", log_path, "--log-format", "json"]
    if spec["mode"] == "run":
        argv = [*base, "run", "--detach", "--pid-file", pid_file, "--bundle", spec["bundle"], cid]
    else:
        argv = [*base, "exec", "--detach", "--pid-file", pid_file]
        for item in spec.get("env") or []:
            argv += ["--env", item]
        argv += [cid, *spec["argv"]]
    # runc passes its standard streams through to the container: ours, which the server reads
    rc = subprocess.run(argv, stdin=0, stdout=1, stderr=2).returncode
    if rc != 0:
        what = "OCI runtime create failed" if spec["mode"] == "run" else "OCI runtime exec failed"
        report(start_error=f"{what}: {runc_error(log_path)}: unknown")
        if spec["mode"] == "run":
            subprocess.run([*base, "delete", "--force", cid], capture_output=True)
        return 128
    with open(pid_file) as f:
        container = int(f.read().strip())
    if kill_requested:  # asked while runc was creating it: it goes now, and is reaped and deleted below
        os.kill(container, signal.SIGKILL)
    report(pid=container)
    report(started=True)
    for sig in pending:
        forward(sig, None)
    status = 0
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            break  # reaped elsewhere: cannot happen, the shim is the only waiter
        if pid == container:
            break
    oom = oom_killed(spec.get("memory_cgroup"))
    if spec["mode"] == "run":
        subprocess.run([*base, "delete", "--force", cid], capture_output=True)
    for path in (pid_file, log_path):
        try:
            os.unlink(path)
        except OSError:
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        report(exit_code=128 + sig, signal=sig, oom=oom)
        return 128 + sig
    code = os.WEXITSTATUS(status)
    report(exit_code=code, signal=None, oom=oom)
    return code


if __name__ == "__main__":
    sys.exit(main())
