"""``python -m kvasir.cli``: the ``kvasir`` command with any interpreter (scripts/gpu-check)."""

from kvasir.cli.main import kvasir

kvasir()
