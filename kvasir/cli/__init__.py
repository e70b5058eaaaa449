"""The command line, one module per command: ``kvasir`` (kvasir/cli/main.py) and ``kvasird``
(kvasir/cli/kvasird.py) (layer 10).

See docs/architecture.md."""
