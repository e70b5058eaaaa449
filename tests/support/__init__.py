"""What the tests share: tiny models of the real architectures and their Hugging Face
references (models), a real daemon driven from a test (daemon), fake channels (channels)."""
