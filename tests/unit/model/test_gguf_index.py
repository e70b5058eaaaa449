"""Reading a GGUF file's header and tensor table directly, against the gguf package's reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

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
