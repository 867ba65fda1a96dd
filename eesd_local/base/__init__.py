"""The base layer: errors, paths, atomic files, cache files, parameters and defaults, interrupts, claims."""
