"""A model folder's tokenizer, loaded the one way every process that needs it does (the
bridge and the HTTP front to tokenize and detokenize, the tail for structured output)."""

from __future__ import annotations

from pathlib import Path

MAX_TEMPLATE_BYTES = 1024 * 1024


def load_tokenizer(folder: Path | None, chat_template: str | None = None):
    """The model folder's tokenizer, or None when it has none (token ids only); with
    ``chat_template`` (a Jinja file, the plan's ``model.chat_template``) in place of the
    model's own template."""
    if folder is None or not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_template(Path(chat_template))
    return tokenizer


def read_template(path: Path) -> str:
    """A chat template file's text (ValueError saying why it cannot be used)."""
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"chat template {path} is over {MAX_TEMPLATE_BYTES} bytes")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"chat template file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read chat template {path}: {exc}") from None
