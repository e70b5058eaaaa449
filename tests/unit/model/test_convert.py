"""Model sources that need converting: the built-in GGUF, other GGUF files, bad input."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from kvasir.cli.main import kvasir
from kvasir.errors import ModelSourceError
from kvasir.model.gguf import SMOLLM2_INSTALL, smollm2_gguf
from kvasir.model.source import resolve_source


def write_gguf(path: Path, architecture: str) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_package_says_how_to_install():
    with pytest.raises(ModelSourceError) as info:
        smollm2_gguf(package="kvasir_no_such_package")
    assert SMOLLM2_INSTALL in str(info.value)


def test_unsupported_gguf_architecture_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("KVASIR_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "encoder.gguf", "bert")
    result = CliRunner().invoke(kvasir, ["model", "prepare", str(path)])
    assert result.exit_code == 2
    assert "GGUF architecture 'bert' is not supported (supported: llama, mistral, qwen2, qwen3)" in result.output
    assert not (tmp_path / "cache").exists()


def test_files_that_are_not_models(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelSourceError, match="not a readable GGUF file"):
        resolve_source(str(junk))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_source(str(text))


def test_folder_without_weights_exits_2_before_spawning(tmp_path, tiny_models):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(tiny_models["llama"] / "config.json", folder / "config.json")
    plan = tmp_path / "plan.toml"
    plan.write_text(
        '[model]\nsource = "model"\nmax_seq_len = 64\n[[stages]]\nlayers = [0, 3]\n[[stages]]\nlayers = [3, 6]\n'
    )
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "kvasird"),
            "start",
            "--plan",
            str(plan),
            "--runtime-dir",
            str(tmp_path / "rt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "has no *.safetensors weights" in proc.stderr
    assert not (tmp_path / "rt").exists()


def test_half_written_conversions_are_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("KVASIR_CACHE_DIR", str(tmp_path))
    partial = tmp_path / ".smollm2-135m.x1y2z3"  # a conversion killed before its rename
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    source = resolve_source("smollm2-135m")
    assert source.weights_dir is None
    with pytest.raises(ModelSourceError, match="kvasir model prepare smollm2-135m"):
        source.require_weights()
    listing = CliRunner().invoke(kvasir, ["model", "list"])
    assert "not prepared" in listing.output and ".smollm2" not in listing.output


@pytest.mark.e2e
def test_sigterm_during_a_conversion_removes_its_temporary_folder(tmp_path):
    """kvasird start (and kvasir model prepare) converting the built-in model get SIGTERM
    half-way: the hidden folder (hundreds of MB when complete) goes with them."""
    import os
    import signal
    import time

    env = {**os.environ, "KVASIR_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvasir"), "model", "prepare", "smollm2-135m"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".smollm2-135m.*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the conversion never started"
        time.sleep(0.05)
    time.sleep(1.0)  # well into reading the GGUF
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 1
    assert "conversion stopped by SIGTERM" in proc.stderr.read()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_conversions_folder_is_removed_by_the_next_one(tmp_path):
    import os

    from kvasir.model.convert import sweep_stale_work

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone
    dead = tmp_path / f".smollm2-135m.{child.pid}.abc123"
    live = tmp_path / f".smollm2-135m.{os.getpid()}.def456"  # a conversion still running
    other = tmp_path / f".gguf-x-1234.{child.pid}.abc"  # another destination's
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 100)
    assert sweep_stale_work(tmp_path / "smollm2-135m") == [dead]
    assert not dead.exists() and live.exists() and other.exists()
