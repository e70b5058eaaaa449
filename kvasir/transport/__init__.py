"""How messages travel, apart from what they are (kvasir/wire/): ZeroMQ sockets and typed
channels (channels), several client messages in one ZeroMQ message (envelopes), CURVE
authentication (curve), which host binds each socket and where (routes), the sockets of a
plan across hosts (fabric), the runtime directory (rundir) and a peer's dropped
connection (resets) (layer 3: above the messages, below every process role)."""
