"""Nothing in the package unpickles: every wire and file format is msgspec, TOML or safetensors."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "kvasir"

# pickle and the APIs that call it underneath: pyzmq's *_pyobj, torch.load, numpy's
# allow_pickle, multiprocessing's queues and connections, marshal and shelve
FORBIDDEN = re.compile(
    r"\b(import\s+(c?pickle|dill|cloudpickle|marshal|shelve)|from\s+(c?pickle|dill|cloudpickle|marshal|shelve)\s+import"
    r"|send_pyobj|recv_pyobj|torch\.load\s*\(|allow_pickle|multiprocessing)"
)


def test_no_pickle_in_the_package():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
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
