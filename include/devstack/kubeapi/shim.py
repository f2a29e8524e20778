"""Container shim: start one container process in fresh namespaces, or one process inside a running container.

Run as ``python -I -S shim.py SPEC_FILE`` by the local Kubernetes API (standard library only,
no imports from the repository). The spec file (JSON, removed once read) says:

* ``mode``: ``run`` (a container's main process) or ``join`` (an exec into a running container);
* ``isolation``: ``namespaces`` (root: new mount, PID and UTS namespaces), ``rootless`` (the same
  inside a new user namespace) or ``none`` (a plain process; the server remaps mount paths);
* ``argv``, ``env``, ``cwd``, ``hostname``, ``mounts`` ([{src, dst, ro}], bind-mounted before the
  exec so that mount paths are real paths inside the container), ``target_pid`` (join),
  ``report_fd`` (a pipe to the server: JSON lines ``{"pid"}``, ``{"started"}`` or
  ``{"start_error"}``, then ``{"exit_code", "signal"}``), ``cgroup`` (memory cgroup to join).

The shim stays as the parent of the container's PID 1: it forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT/
SIGUSR1/SIGUSR2 to it, reports its exit status (128+N for a signal, as container runtimes do), and
dies with the server (PR_SET_PDEATHSIG), taking the container with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

libc = ctypes.CDLL(None, use_errno=True)


def _b(value: str | None) -> bytes | None:
    return None if value is None else value.encode()


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str | None, dst: str, fstype: str | None, flags: int) -> None:
    _check(libc.mount(_b(src), _b(dst), _b(fstype), ctypes.c_ulong(flags), None), f"mount {src} on {dst}")


def die_with_parent() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def which(cmd: str, env: dict[str, str]) -> str:
    if "/" in cmd:
        return cmd
    for d in env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":"):
        cand = os.path.join(d or ".", cmd)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError(f'exec: "{cmd}": executable file not found in $PATH')


def enter_new_namespaces(isolation: str) -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if isolation == "rootless":
        flags |= CLONE_NEWUSER
    _check(libc.unshare(flags), "unshare")
    if isolation == "rootless":
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
    # keep the container's mounts out of the host's mount table
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def join_namespaces(target: int, isolation: str) -> None:
    kinds = (["user"] if isolation == "rootless" else []) + ["mnt", "uts", "pid"]
    fds = [os.open(f"/proc/{target}/ns/{k}", os.O_RDONLY) for k in kinds]
    root = os.open(f"/proc/{target}/root", os.O_RDONLY | os.O_DIRECTORY)
    for kind, fd in zip(kinds, fds, strict=True):
        _check(libc.setns(fd, 0), f"setns {kind} of pid {target}")
        os.close(fd)
    # setns(mnt) leaves us at the namespace's root mount; the container lives in its chroot
    os.fchdir(root)
    os.chroot(".")
    os.close(root)


def setup_container_fs(spec: dict) -> None:
    """Build the container's root: a private tmpfs holding bind mounts of the host's top-level entries.

    Mount points that do not exist on the host (``/data``, ``/airflow/xcom``) are created inside that
    tmpfs, so the host's own file system is left alone; then the volumes are bind-mounted and the
    process chroots into the new root.
    """
    mounts = sorted(spec.get("mounts", []), key=lambda m: m["dst"].count("/"))
    # hold every source before mounting anything: a mount (e.g. the private /tmp) may hide a later source
    sources = [(m, os.open(m["src"], os.O_PATH), os.path.isdir(m["src"])) for m in mounts]
    root = spec["rootfs"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV)
    for entry in sorted(os.listdir("/")):
        host, inside = "/" + entry, os.path.join(root, entry)
        if os.path.islink(host):
            os.symlink(os.readlink(host), inside)
        elif os.path.isdir(host):
            os.mkdir(inside)
            if entry != "proc":
                mount(host, inside, None, MS_BIND | MS_REC)
        elif os.path.exists(host):
            open(inside, "a").close()
            mount(host, inside, None, MS_BIND)
    mount("proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for m, fd, is_dir in sources:
        dst = os.path.join(root, m["dst"].lstrip("/"))
        if is_dir:
            os.makedirs(dst, exist_ok=True)
        elif not os.path.exists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
        if m.get("ro"):
            mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)
        os.close(fd)
    hostname = spec.get("hostname")
    if hostname:
        _check(libc.sethostname(hostname.encode(), len(hostname.encode())), "sethostname")
    os.chdir(root)
    os.chroot(".")
    os.chdir("/")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        return probe(sys.argv[2])
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

    die_with_parent()
    mode, isolation = spec["mode"], spec["isolation"]
    if spec.get("cgroup"):
        try:
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass
    try:
        if isolation != "none":
            if mode == "run":
                enter_new_namespaces(isolation)
            else:
                join_namespaces(int(spec["target_pid"]), isolation)
    except OSError as exc:
        report(start_error=f"cannot create the container's namespaces: {exc}")
        return 128

    child = 0
    pending: list[int] = []

    def forward(signum, _frame) -> None:
        if child:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    err_r, err_w = os.pipe()  # both close-on-exec: EOF without data means the exec succeeded
    child = os.fork()
    if child == 0:
        try:
            os.close(err_r)
            die_with_parent()
            for sig in FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
            if isolation == "none":
                os.setpgid(0, 0)
            elif mode == "run":
                setup_container_fs(spec)
            env = spec["env"]
            os.chdir(spec.get("cwd") or "/")
            argv = spec["argv"]
            os.execve(which(argv[0], env), argv, env)
        except BaseException as exc:  # noqa: BLE001 - anything here is a start error for the server
            if isinstance(exc, FileNotFoundError) and str(exc.args[0]).startswith("exec:"):
                msg = str(exc.args[0])
            elif isinstance(exc, OSError):
                msg = f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")
            else:
                msg = f"{type(exc).__name__}: {exc}"
            try:
                os.write(err_w, msg.encode() or b"start failed")
            finally:
                os._exit(128)
    os.close(err_w)
    report(pid=child)
    for sig in pending:
        forward(sig, None)
    chunks = []
    while True:
        try:
            data = os.read(err_r, 65536)
        except InterruptedError:
            continue
        if not data:
            break
        chunks.append(data)
    os.close(err_r)
    if chunks:
        report(start_error=b"".join(chunks).decode(errors="replace"))
    else:
        report(started=True)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = 0
            break
    if isolation == "none":
        # a namespace would take every process of the container down with its PID 1
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        report(exit_code=128 + sig, signal=sig)
        return 128 + sig
    code = os.WEXITSTATUS(status)
    if not chunks:
        report(exit_code=code, signal=None)
    return code


def probe(isolation: str) -> int:
    """Exit 0 when this process may create the namespaces ``isolation`` needs (and mount /proc)."""
    try:
        enter_new_namespaces(isolation)
    except OSError:
        return 1
    pid = os.fork()
    if pid == 0:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            os._exit(0 if os.getpid() == 1 else 1)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return 0 if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
