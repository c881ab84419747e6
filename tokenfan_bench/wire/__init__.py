"""What a subscriber receives, decoded: pure modules (bytes in, values out; no I/O, no event loop)."""
