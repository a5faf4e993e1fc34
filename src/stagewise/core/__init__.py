"""The serving boundary: the engine core process, its client and the typed messages between them."""
