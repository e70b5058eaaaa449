"""``python -m kvasir.daemon.worker``: a child process of the launcher.

The launcher starts a front as a fresh interpreter and writes its msgpack-encoded
WorkerSettings to the child's stdin; stages, shards and the bridge are forked from the
zygote (kvasir/daemon/zygote.py), which calls ``serve_settings`` itself, or are started
here too where no zygote serves. A worker that returns or exits leaves at once
(kvasir/exits.py): its parent sees it gone without waiting for the interpreter's
teardown.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, NoReturn

from kvasir.exits import exit_code, leave
from kvasir.wire.control import BridgeSettings, FrontSettings, ShardSettings, StageSettings, WorkerSettings
from kvasir.wire.decoding import decode


def main() -> None:
    encoded = sys.stdin.buffer.read()
    sys.stdin.close()
    serve_settings(decode(encoded, WorkerSettings))  # type: ignore[arg-type]  # a union of tagged structs


def serve_settings(settings: WorkerSettings) -> NoReturn:
    """Run the worker ``settings`` describe, then leave with its exit status (1, with the
    traceback printed, for an exception that escapes it)."""
    try:
        run(settings)
    except SystemExit as stop:
        leave(exit_code(stop))
    except BaseException:
        traceback.print_exc()
        leave(1)
    leave(0)


def run(settings: Any) -> None:
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
