"""The delivery core: the engine link, generations, the stream log, readers, framing and connections."""
