"""The wire protocol: framing (wire), the sealed channel (channel), the handshake and
secrets (auth), what goes inside messages (serialize), the memory replies land in
(buffers) and reply size limits (limits). Nothing here knows about datasets or loaders."""
