"""``python -m kvasir.daemon.worker``: a child process of the launcher.

The launcher starts each child as a fresh interpreter (no fork after torch is
imported) and writes its msgpack-encoded WorkerSettings to the child's stdin.
"""

from __future__ import annotations

import sys

from kvasir.wire.control import WorkerSettings
from kvasir.wire.decoding import decode


def main() -> None:
    encoded = sys.stdin.buffer.read()
    sys.stdin.close()
    role = decode(encoded, WorkerSettings).role
    if role == "stage":
        from kvasir.stage.process import run_stage

        run_stage(encoded)
    elif role == "shard":
        from kvasir.shard.process import run_shard

        run_shard(encoded)
    elif role == "bridge":
        from kvasir.bridge.process import run_bridge

        run_bridge(encoded)
    elif role == "front":
        from kvasir.http.process import run_front

        run_front(encoded)
    else:
        raise SystemExit(f"unknown worker role {role!r}")


if __name__ == "__main__":
    main()
