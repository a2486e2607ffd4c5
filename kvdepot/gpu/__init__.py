"""Engine-memory side: layouts and grouping, shared memory, transfer engines."""
