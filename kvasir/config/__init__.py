"""The plan format and its checks, CURVE key files, and the device and dtype tables (layer 1).

See docs/architecture.md."""
