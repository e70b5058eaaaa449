"""The command line, the Python client and the bridge process start without torch or
transformers: they are imported only where a model runs (stages, conversion, benchmarks
that load one) or, in the bridge, where a model folder has a tokenizer."""

import subprocess
import sys


def test_commands_and_client_import_no_model_libraries():
    probe = (
        "import sys, kvasir.cli.main, kvasir.cli.kvasird, kvasir.client, kvasir.bridge.process; "
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"importing the command line loads {loaded}"
