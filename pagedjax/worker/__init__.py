"""Device side of the engine: paged attention adapter, step inputs, model runner."""
