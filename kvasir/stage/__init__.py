"""A stage process: the agent loop, its intakes and outlets, the ring heads, the KV hand-off
between pools, sampling and the model engine (layer 5).

See docs/architecture.md."""
