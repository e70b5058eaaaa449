"""``python -m kvasir.daemon.worker``: a child process of the launcher.

The launcher starts each child as a fresh interpreter (no fork after torch is
imported) and writes its msgpack-encoded WorkerSettings to the child's stdin. A worker
that returns or exits leaves at once (kvasir/exits.py): its parent sees it gone without
waiting for the interpreter's teardown.
"""

from __future__ import annotations

import sys
from typing import Any

from kvasir.exits import exit_code, leave
from kvasir.wire.control import BridgeSettings, FrontSettings, ShardSettings, StageSettings, WorkerSettings
from kvasir.wire.decoding import decode


def main() -> None:
    try:
        run()
    except SystemExit as stop:
        leave(exit_code(stop))
    leave(0)


def run() -> None:
    encoded = sys.stdin.buffer.read()
    sys.stdin.close()
    settings: Any = decode(encoded, WorkerSettings)  # type: ignore[arg-type]  # a union of tagged structs
    match settings:
        case StageSettings():
            from kvasir.stage.process import run_stage

            run_stage(settings)
        case ShardSettings():
            from kvasir.shard.process import run_shard

            run_shard(settings)
        case BridgeSettings():
            from kvasir.bridge.process import run_bridge

            run_bridge(settings)
        case FrontSettings():
            from kvasir.http.process import run_front

            run_front(settings)


if __name__ == "__main__":
    main()
