"""Boundary slot rings between stages (shared memory, page-locked, CUDA IPC), the choice of
edge kind, shared-memory files and the CUDA IPC handle exchange (layer 4; no model code).

See docs/architecture.md."""
