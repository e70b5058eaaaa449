"""Reading a GGUF file's header and tensor table directly, against the gguf package's reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvasir.errors import ModelSourceError
from kvasir.model.gguf import gguf_architecture
from kvasir.model.quant.gguf_index import GgufFormatError, read_index
from tests.support.gguf_models import save_tiny_gguf


def test_the_table_and_data_equal_the_gguf_packages(tmp_path):
    path = save_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", "Q4_0", "Q8_0", num_layers=2)
    index = read_index(path)
    reader = gguf.GGUFReader(str(path))
    assert index.metadata["general.architecture"] == "qwen2" and index.metadata["qwen2.block_count"] == 2
    assert set(index.tensors) == {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        info = index.tensors[tensor.name]
        assert info.type_id == int(tensor.tensor_type) and list(info.shape) == tensor.shape.tolist()
        data = np.asarray(index.data(info, tensor.n_bytes))
        assert np.array_equal(data, np.asarray(tensor.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"GGML" + bytes(20), "no GGUF magic"),
        (b"GGUF" + (9).to_bytes(4, "little") + bytes(16), "version 9"),
        (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little"), "ends inside its header"),
        (b"GGUF" + (3).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little") + bytes(8), "not plausible"),
    ],
)
def test_what_is_not_a_gguf_file_is_refused(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufFormatError, match=message):
        read_index(path)


def test_a_truncated_file_is_refused_where_its_header_ends(tmp_path):
    whole = save_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q4_1", "Q8_0", num_layers=2).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:200])
    with pytest.raises(GgufFormatError, match="ends inside its header|runs past the end"):
        read_index(cut)


def nested_arrays(depth: int) -> bytes:
    """A GGUF header whose one metadata value is an array of an array of ... (``depth``
    levels) of one u8: about 12 bytes a level."""
    key = b"general.nested"
    head = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    level = (9).to_bytes(4, "little") + (1).to_bytes(8, "little")  # elements: arrays, one of them
    innermost = (0).to_bytes(4, "little") + (1).to_bytes(8, "little") + b"\x07"  # elements: u8, one of them
    value = (9).to_bytes(4, "little") + level * (depth - 1) + innermost
    return head + len(key).to_bytes(8, "little") + key + value


def test_metadata_nested_past_the_bound_is_refused_not_a_recursion_error(tmp_path):
    path = tmp_path / "nested.gguf"
    path.write_bytes(nested_arrays(5000))  # about 60 KB: deeper than Python's recursion limit
    with pytest.raises(GgufFormatError, match="nested deeper than 4"):
        read_index(path)
    with pytest.raises(ModelSourceError, match="is not a readable GGUF file: metadata arrays nested deeper"):
        gguf_architecture(path)  # what the loader and `kvasir model prepare` call first
    shallow = tmp_path / "shallow.gguf"
    shallow.write_bytes(nested_arrays(2))  # within the bound: read (and skipped, as every array)
    assert read_index(shallow).metadata == {"general.nested": None}


def test_a_string_longer_than_the_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "long.gguf"
    path.write_bytes(
        b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1).to_bytes(8, "little") + (1 << 30).to_bytes(8, "little")
    )
    with pytest.raises(GgufFormatError, match="a string of 1073741824 bytes"):
        read_index(path)
