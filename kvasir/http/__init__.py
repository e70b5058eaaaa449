"""The HTTP front: an OpenAI-compatible API and Prometheus metrics, in processes of their
own that reach the daemon as clients of the bridge (docs/architecture.md, The HTTP front)."""
