"""The runtime dir's safety checks: who made it, what is in it, who else may write there.

The runtime dir holds the daemon's sockets, and whoever answers on its ``client.sock``
receives every prompt sent there. The fallback ``/tmp/kvasir-$UID`` sits in a folder
every user can write to, so another user could make it first; and a daemon given
``--runtime-dir /run`` must not take over (chmod, delete sockets in) a folder that is
not its own. Both sides check before they use it:

- ``kvasird`` serves only from a real directory (not a symbolic link) that this user
  owns and that holds nothing but Kvasir's own files (its lock and sockets, maybe left
  by a killed daemon); it makes the directory itself when it is missing.
- A client connects only to a real directory that no other user can write to, owned by
  the client's user or root; a root client also accepts a directory of another owner
  when the folder it sits in is not writable by everyone (only a privileged process,
  such as systemd's ``RuntimeDirectory=`` for a ``DynamicUser``, put it there).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import zmq

from kvasir.errors import KvasirError

OURS = re.compile(
    r"^(kvasird\.lock|(client|events|bridge-in|control|hosts|command-bridge|((stage|credits|kv|kvpool|shard|experts|command-stage|command-shard|command-front)-[0-9]+))\.sock)$"
)

SOCKET_PATH_MAX: int = getattr(zmq, "IPC_PATH_MAX_LEN", 107)  # a Unix socket's path, bytes (sun_path less its NUL)
LONGEST_SOCKET = "command-shard-99.sock"  # a worker index of up to two digits


class RuntimeDirError(KvasirError):
    """A runtime dir that is not safe to serve from or to connect to."""


def is_ours(name: str) -> bool:
    """A file name kvasird makes in its runtime dir (the lock, one of its sockets)."""
    return OURS.match(name) is not None


def make_runtime_dir(path: Path) -> None:
    """The daemon's side: make ``path`` (0700) or check an existing one; RuntimeDirError
    when its sockets' paths would be too long, or it is a link, not a directory, another
    user's, or holds files not Kvasir's."""
    check_socket_room(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = _lstat(path)
    if st.st_uid != os.getuid():
        raise RuntimeDirError(
            f"runtime dir {path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
            "another user made it; give kvasird a --runtime-dir of its own"
        )
    foreign = sorted(entry.name for entry in os.scandir(path) if not is_ours(entry.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise RuntimeDirError(
            f"runtime dir {path} holds files that are not kvasird's ({shown}): give kvasird a directory "
            "of its own (it removes stale sockets there)"
        )
    os.chmod(path, 0o700)


def check_socket_room(path: Path) -> None:
    """RuntimeDirError when a socket in ``path`` could not be bound: the kernel refuses a
    Unix socket's path over SOCKET_PATH_MAX bytes, which a worker would meet only when it
    binds, and fail."""
    longest = len(os.fsencode(path.absolute() / LONGEST_SOCKET))
    if longest > SOCKET_PATH_MAX:
        raise RuntimeDirError(
            f"runtime dir {path} is too long for its sockets: {path / LONGEST_SOCKET} would be {longest} bytes, "
            f"and a Unix socket's path holds at most {SOCKET_PATH_MAX}; give kvasird a shorter --runtime-dir"
        )


def lock_runtime_dir(path: Path) -> int:
    """Make (or check) the runtime dir and take its lock for this process: the lock file's
    descriptor, holding our pid. RuntimeDirError when another kvasird holds it."""
    import fcntl

    make_runtime_dir(path)
    fd = os.open(path / "kvasird.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeDirError(f"another kvasird is serving from runtime dir {path}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def check_client_dir(path: Path) -> None:
    """The client's side: RuntimeDirError when ``path`` is not safe to send prompts to.
    A missing directory is FileNotFoundError (no daemon there)."""
    st = _lstat(path)
    me = os.getuid()
    if st.st_mode & 0o022:
        raise RuntimeDirError(
            f"runtime dir {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); kvasird keeps "
            "it 0700, so another user may have made it: refusing to connect"
        )
    if st.st_uid not in (me, 0) and not (me == 0 and not os.stat(path.parent).st_mode & 0o002):
        raise RuntimeDirError(
            f"runtime dir {path} belongs to uid {st.st_uid}, not to you (uid {me}) or root: another user "
            "may have made it to receive your prompts; refusing to connect (pass your daemon's --runtime-dir)"
        )


def _lstat(path: Path) -> os.stat_result:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeDirError(f"runtime dir {path} is a symbolic link: kvasird uses only a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime dir {path} is not a directory")
    return st
