"""The zygote: a fork of ``kvasird start`` (or ``join``) made once the launcher has imported
a stage's and a shard's modules, which forks each stage, shard, bridge and HTTP front the
launcher asks for.

A fresh interpreter spends seconds importing torch and transformers before a stage can
load its weights, and a bridge or front before it can load the model's tokenizer
(transformers' tokenizers import torch); every worker, and every restart, paid that
again (a default plan's bridge and front were ready 7 s after their stages). The
launcher imports them anyway (it resolves the plan with transformers' config and sizes
its rings with torch): it imports the rest (``preload``) and forks the zygote before it
runs a torch operation or starts a thread (kvasir/daemon/forks.py), so the daemon pays
the imports once, not once in the launcher and again in a zygote of its own. The zygote
never runs a torch operation, starts a thread or touches a GPU: a worker forked from it
starts as a fresh interpreter would after its imports (torch's thread pools, CUDA and
the weights are all made after the fork, in the worker). ``kvasird`` runs in
``worker_env`` (huge pages, OpenMP's spin; kvasir/daemon/environment.py), which glibc and
libgomp read when they load, so every fork has them.

The launcher writes each worker's settings as a frame (4-byte big-endian length, then
the msgpack WorkerSettings) to the zygote's Unix stream socket: a front's frame carries
its listening socket with its first bytes (SCM_RIGHTS), and the fork holds that
descriptor as its ``listen_fd``; any other frame carries none. The zygote forks twice,
so that the worker is orphaned at once and becomes the launcher's child (the launcher
is a child subreaper, kvasir/daemon/forks.py), and answers on a pipe with the worker's
pid (4 bytes). End of file on its socket (the launcher closed it, or died) ends the
zygote.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import struct
import time
import traceback
from typing import Any, NoReturn

import msgspec

from kvasir.daemon.worker import serve_settings
from kvasir.exits import exit_code, leave
from kvasir.wire.control import FrontSettings, ShardSettings, StageSettings, WorkerSettings
from kvasir.wire.decoding import Malformed, decode

FRAME = struct.Struct(">I")
PID = struct.Struct(">i")
PR_SET_NAME = 15  # linux/prctl.h
MAX_SETTINGS_BYTES = 64 << 20  # a plan's settings are kilobytes; anything near this is not the launcher's


def preload() -> None:
    """Import what a stage and a shard import, and each served family's transformers
    modules (a stage imports its family's when it builds the model)."""
    import kvasir.shard.process  # noqa: F401
    import kvasir.stage.process  # noqa: F401
    from kvasir.model.families import FAMILIES

    for model_type in FAMILIES:
        try:
            importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:  # a transformers without this family: its stage says so when it loads
            pass


def read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``; None at end of file (also mid-frame)."""
    parts = []
    while size:
        part = os.read(fd, size)
        if not part:
            return None
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


def serve(inbound: int, outbound: int) -> None:
    """Fork a worker for each frame until end of file. ``inbound`` is a Unix stream socket:
    a front's frame brings its listening socket (SCM_RIGHTS, with the frame's first bytes)."""
    channel = socket.socket(fileno=inbound)
    try:
        while (head := read_head(channel)) is not None:
            frame, fds = head
            try:
                settings = read_settings(inbound, frame, fds)
                if settings is None:
                    return
                os.write(outbound, PID.pack(fork_worker(settings, (inbound, outbound))))
            finally:
                for fd in fds:
                    os.close(fd)  # the worker has its own copy
    finally:
        channel.detach()  # the fd is the caller's


def read_head(channel: socket.socket) -> tuple[bytes, list[int]] | None:
    """A frame's 4-byte length and the file descriptors sent with it; None at end of file."""
    data, fds, flags, _ = socket.recv_fds(channel, FRAME.size, 1)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise SystemExit("kvasir zygote: more file descriptors than a front's one socket")
    rest = read_exactly(channel.fileno(), FRAME.size - len(data)) if data else None
    if rest is None:
        for fd in fds:
            os.close(fd)
        return None
    return data + rest, fds


def read_settings(inbound: int, head: bytes, fds: list[int]) -> WorkerSettings | None:
    """The settings of the frame ``head`` begins, a front's listening socket ``fds[0]`` in
    them; None at end of file (also mid-frame)."""
    (size,) = FRAME.unpack(head)
    if size > MAX_SETTINGS_BYTES:
        raise SystemExit(f"kvasir zygote: a frame of {size} bytes; settings are far smaller")
    encoded = read_exactly(inbound, size)
    if encoded is None:
        return None
    try:
        settings: Any = decode(encoded, WorkerSettings)  # type: ignore[arg-type]  # a union of tagged structs
    except Malformed as exc:
        raise SystemExit(f"kvasir zygote: settings that do not decode: {exc}") from None
    wanted = 1 if isinstance(settings, FrontSettings) else 0
    if len(fds) != wanted:
        raise SystemExit(f"kvasir zygote: {type(settings).__name__} with {len(fds)} file descriptors, not {wanted}")
    return msgspec.structs.replace(settings, listen_fd=fds[0]) if fds else settings


def fork_worker(settings: WorkerSettings, pipes: tuple[int, int]) -> int:
    """Fork, fork again and let the middle process exit: the worker's pid."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                become_worker(settings, pipes)
            os.write(write_end, PID.pack(worker))
        finally:
            os._exit(0)
    os.close(write_end)
    answer = read_exactly(read_end, PID.size)
    os.close(read_end)
    os.waitpid(middle, 0)  # once it is gone the worker is the launcher's child
    if answer is None:
        raise SystemExit("kvasir zygote: the fork of a worker failed")
    (pid,) = PID.unpack(answer)
    return pid


def orphaned(middle: int, timeout_s: float = 10.0) -> None:
    """Wait (briefly: it exits at once) until the middle process is gone and this one is
    the launcher's child, which its checks of its parent expect."""
    deadline = time.monotonic() + timeout_s
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.001)


def become_worker(settings: WorkerSettings, pipes: tuple[int, int]) -> NoReturn:
    """In the forked worker: once the launcher's child, the zygote's pipes closed, stdin
    empty, SIGINT as in a fresh interpreter; then the worker's own code, and its exit (1
    if it fails before its code runs: never back into the zygote's frames)."""
    try:
        orphaned(os.getppid())
        ready_worker(settings, pipes)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    serve_settings(settings)


def ready_worker(settings: WorkerSettings, pipes: tuple[int, int]) -> None:
    """What a fresh interpreter has that a fork of the zygote must be given."""
    for fd in pipes:
        os.close(fd)
    name_process(worker_name(settings))  # ps, top: the worker, not the zygote's command line
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def worker_name(settings: WorkerSettings) -> str:
    match settings:
        case StageSettings(index=index):
            return f"stage-{index}"
        case ShardSettings(index=index):
            return f"shard-{index}"
        case FrontSettings(index=index):
            return f"front-{index}"
    return "bridge"


def name_process(name: str) -> None:
    """This process's name as the kernel shows it (``/proc/PID/comm``, 15 bytes at most)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name stays
        pass


def keep_only(fds: tuple[int, ...]) -> None:
    """Close every descriptor this fork inherited but the standard streams and ``fds`` (the
    launcher's lock, sockets and files are its own)."""
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2 and int(name) not in fds:
            try:
                os.close(int(name))
            except OSError:  # the listing's own descriptor, closed already
                pass


def run(inbound: int, outbound: int) -> NoReturn:
    """In the forked zygote: named so, Ctrl-C left to the launcher, then forks until end
    of file on ``inbound``; its exit, never a return into the launcher's frames."""
    code = 1
    try:
        keep_only((inbound, outbound))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
        name_process("zygote")
        serve(inbound, outbound)
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException:
        traceback.print_exc()
    leave(code)
