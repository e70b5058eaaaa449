"""``scripts/decode-step``, the one-process measure of a lone request's decode step that
docs/bench/latency.md quotes, runs as written, on the tree KVASIR_TREE names (the way two
commits are measured alternately; without it, this checkout's)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(?P<tree>\S+): plans/tiny-2stage.toml, 1 threads: decode step median (?P<ms>[0-9.]+) ms")


def decode_step(env: dict[str, str]) -> re.Match:
    run = subprocess.run(
        [str(ROOT / "scripts" / "decode-step"), "plans/tiny-2stage.toml", "1", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    found = LINE.match(run.stdout.strip().splitlines()[-1])
    assert found is not None, run.stdout
    assert float(found["ms"]) > 0
    return found


def test_the_decode_step_script_measures_the_tree_named(tmp_path):
    from kvasir.model.convert import prepare
    from kvasir.model.source import resolve_source

    prepare(resolve_source("smollm2-135m"))  # the plan's model, converted once into the cache
    # another tree (here this package seen from tmp_path) is the one imported and named
    (tmp_path / "kvasir").symlink_to(ROOT / "kvasir", target_is_directory=True)
    assert decode_step({**os.environ, "KVASIR_TREE": str(tmp_path)})["tree"] == str(tmp_path)
