"""Nothing in the package unpickles: every wire and file format is msgspec, TOML or safetensors."""

from __future__ import annotations

import re

from tests.support.tree import lines_matching

# pickle and the APIs that call it underneath: pyzmq's *_pyobj, torch.load, numpy's
# allow_pickle, multiprocessing's queues and connections, marshal and shelve
FORBIDDEN = re.compile(
    r"\b(import\s+(c?pickle|dill|cloudpickle|marshal|shelve)|from\s+(c?pickle|dill|cloudpickle|marshal|shelve)\s+import"
    r"|send_pyobj|recv_pyobj|torch\.load\s*\(|allow_pickle|multiprocessing)"
)


def test_no_pickle_in_the_package():
    found = lines_matching(FORBIDDEN)
    assert not found, "\n".join(found)


def test_the_scan_catches_what_it_looks_for():
    for line in (
        "import pickle",
        "from pickle import loads",
        "sock.recv_pyobj()",
        "torch.load(path)",
        "import cloudpickle",
        "np.load(f, allow_pickle=True)",
        "from multiprocessing import Queue",
    ):
        assert FORBIDDEN.search(line), line
    for line in ("import msgspec", "safe_open(path)", "torch.frombuffer(buf)"):
        assert not FORBIDDEN.search(line), line
