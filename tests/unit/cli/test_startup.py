"""The command line, the Python client and the bridge process start without torch or
transformers: they are imported only where a model runs (stages, conversion, benchmarks
that load one) or, in the bridge, where a model folder has a tokenizer."""

import subprocess
import sys

LOADED = "','.join(m for m in ('torch', 'transformers') if m in sys.modules)"  # the model libraries imported


def test_commands_and_client_import_no_model_libraries():
    probe = f"import sys, kvasir.cli.main, kvasir.cli.kvasird, kvasir.client, kvasir.bridge.process; print({LOADED})"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"importing the command line loads {loaded}"


def test_kvasird_refuses_a_plan_that_does_not_check_before_loading_model_libraries(tmp_path):
    """A plan's own errors (here one stage) exit 2 before torch and transformers load:
    a bad plan fails in a fraction of a second, not after the seconds they take."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nsource = "smollm2-135m"\n[[stages]]\nlayers = [0, 30]\n')
    probe = (
        "import atexit, sys\n"
        f"atexit.register(lambda: print({LOADED}))\n"
        "from kvasir.cli.kvasird import kvasird\n"
        f"kvasird([sys.argv[1], '--plan', {str(bad)!r}, *sys.argv[2:]])\n"
    )
    for verb in (["start"], ["join", "--host", "b"]):
        run = subprocess.run([sys.executable, "-c", probe, *verb], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "a pipeline needs at least two stages" in run.stderr, run.stderr
        assert run.stdout.strip() == "", f"kvasird {verb[0]} loaded {run.stdout.strip()} before refusing the plan"
