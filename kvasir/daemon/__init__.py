"""The launcher (``kvasird start``): host checks, shared-memory layout, spawning the
children, readiness, supervision, restarts, shutdown and service notification (layer 8).

See docs/architecture.md."""
