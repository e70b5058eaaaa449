"""The KV pool's files, private by construction: every folder 0700 and every file 0600,
made with ``O_EXCL | O_NOFOLLOW`` relative to an open folder, so no symlink is followed,
no file is reused and no path is walked again after its check (a folder swapped or a
link planted later changes nothing for a tier that holds its folder open).

A tier's root (the plan's ``disk_dir`` on a host, or the daemon's memory tier under
/dev/shm) is opened once and checked: a real folder, not a symlink, owned by this user
and writable by nobody else (the memory tier's, which the daemon makes fresh: open to
nobody else at all), or ``Refused`` by name. A file read back is checked before a byte
of it is read: a regular file of this user, open to nobody else, of exactly the size
its reader expects (``Unfit`` otherwise).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvasir.config.keys import POOL_SECRET, SECRET_TEXT, new_secret_text, parse_secret
from kvasir.errors import KvasirError

FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never stalls a read


class Refused(KvasirError):
    """A tier folder this daemon will not use: ``reason`` says why (a word for the counter)."""

    def __init__(self, path: Path, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path, self.reason = path, reason


class Unfit(ValueError):
    """A file that is not one the pool wrote: not a regular file, another user's, open to
    others, or not the size expected. ``reason``: a word for the counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def reason_of(exc: OSError) -> str:
    """The errno's name (``ENOSPC``), the word a fault is counted under."""
    return errno.errorcode.get(exc.errno or 0, "OSError")


class Folder:
    """One folder held open: every name below is looked up relative to it."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path  # for messages only: nothing is opened by it again

    @classmethod
    def root(cls, path: Path, *, make: bool, private: bool) -> Folder:
        """A tier's root folder (made 0700 when ``make`` and missing); ``private``: open
        to nobody else (mode 0700), else writable by nobody else. Refused otherwise."""
        if make:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise Refused(path, reason_of(exc), f"cannot be made: {exc.strerror}") from None
        try:
            fd = os.open(path, FOLDER_FLAGS)
        except OSError as exc:
            raise _unopened(path, exc) from None
        try:
            _check_folder(fd, path, 0o077 if private else 0o022)
        except Refused:
            os.close(fd)
            raise
        return cls(fd, path)

    def child(self, name: str) -> Folder:
        """The folder ``name`` below, made 0700 if missing; one of this user's from before
        is made 0700 if it was open to others; another user's, or a symlink, refused."""
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise Refused(self.path / name, reason_of(exc), f"cannot be made: {exc.strerror}") from None
        path = self.path / name
        try:
            fd = os.open(name, FOLDER_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            raise _unopened(path, exc) from None
        try:
            info = os.fstat(fd)
            if info.st_uid == os.geteuid() and info.st_mode & 0o077:
                os.fchmod(fd, 0o700)  # a folder this user made before folders were private
            _check_folder(fd, path, 0o077)
        except (Refused, OSError):
            os.close(fd)
            raise
        return Folder(fd, path)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def create(self, name: str, data: bytes | memoryview) -> None:
        """A new file ``name`` (0600; never an existing one, never through a symlink)
        holding ``data``; on any error nothing of it is left."""
        fd = os.open(name, NEW_FILE, 0o600, dir_fd=self.fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            self.remove(name)
            raise
        os.close(fd)

    def read(self, name: str, size: int, *, touch: bool = False) -> bytes:
        """All ``size`` bytes of the file ``name``, checked first (``Unfit``); ``touch``:
        its modification time made now (a tier's last use)."""
        fd = os.open(name, READ_FILE, dir_fd=self.fd)
        try:
            check_file(os.fstat(fd), size)
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise Unfit("short", f"{name}: ended after {got} of {size} bytes")
                got += n
            if touch:
                os.utime(fd)
            return bytes(data)
        finally:
            os.close(fd)

    def rename(self, source: str, target: str) -> None:
        os.rename(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link(self, source: str, target: str) -> None:
        """``target`` as a second name of ``source`` (FileExistsError if it exists: never replaced)."""
        os.link(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def remove(self, name: str) -> None:
        """Remove the file ``name`` if it is there and can be (a failure is left for the next look)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            pass

    def secret(self) -> bytes:
        """The pool secret kept in this folder (``kvpool.secret``), made whole (0600) by the
        first stage to ask; one that is not a secret the pool made is refused."""
        try:
            return self._secret()
        except FileNotFoundError:
            pass
        partial = f"{POOL_SECRET}.{os.getpid()}.partial"
        self.remove(partial)
        try:
            self.create(partial, new_secret_text())
            self.link(partial, POOL_SECRET)
        except FileExistsError:
            pass  # another stage made it first: that one serves
        finally:
            self.remove(partial)
        return self._secret()

    def _secret(self) -> bytes:
        try:
            return parse_secret(self.read(POOL_SECRET, SECRET_TEXT), self.path / POOL_SECRET)
        except (Unfit, KvasirError) as exc:
            raise Refused(self.path / POOL_SECRET, "secret", f"is not this pool's secret: {exc}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def check_file(info: os.stat_result, size: int) -> None:
    """A file the pool wrote: regular, this user's, open to nobody else, ``size`` bytes."""
    if not stat.S_ISREG(info.st_mode):
        raise Unfit("not_a_file", "not a regular file")
    if info.st_uid != os.geteuid():
        raise Unfit("owner", f"owned by uid {info.st_uid}")
    if info.st_mode & 0o077:
        raise Unfit("mode", f"open to other users (mode {info.st_mode & 0o777:04o})")
    if info.st_size != size:
        raise Unfit("size", f"{info.st_size} bytes, not {size}")


def _unopened(path: Path, exc: OSError) -> Refused:
    """Why a folder did not open (O_NOFOLLOW: a symlink in its place does not)."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink():
        return Refused(path, "symlink", "is a symlink (a tier folder must be a real folder)")
    return Refused(path, reason_of(exc), f"cannot be opened: {exc.strerror}")


def _check_folder(fd: int, path: Path, forbidden: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
        raise Refused(path, "not_a_folder", "is not a folder")
    if info.st_uid != os.geteuid():
        raise Refused(path, "owner", f"is owned by uid {info.st_uid}, not this daemon's user (uid {os.geteuid()})")
    if info.st_mode & forbidden:
        open_to = "open to" if forbidden == 0o077 else "writable by"
        raise Refused(path, "mode", f"is {open_to} other users (mode {info.st_mode & 0o777:04o})")
