"""Files that hold secrets (CURVE secret keys, bearer keys, TLS keys): open to their owner
only, or refused."""

from __future__ import annotations

import os
from pathlib import Path

from kvasir.errors import KvasirError


class KeyFileError(KvasirError):
    """A key file or folder is missing, is not a key, or is open to other users."""


def check_private(path: str | Path) -> None:
    """A file holding a secret (a secret key, bearer keys, a TLS key) must not be open to
    the owner's group or others: KeyFileError naming the fix otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # what reads it says the file is missing
    if mode & 0o077:
        raise KeyFileError(
            f"{path} holds a secret and is open to other users (mode {mode & 0o777:04o}): chmod 600 {path}"
        )
