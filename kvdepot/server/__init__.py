"""The kvdepot daemon: front end, registry, chunk index, L1 pool, metrics."""
