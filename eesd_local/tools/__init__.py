"""Tools beside the engine: downloads, the files an engine needs made before it opens (prepare),
weights and requantisation, conversion, the simulator, the bench, exit-head training. They use the
engine's layers; nothing below them imports them."""
