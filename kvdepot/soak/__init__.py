"""``kvdepot soak``: a randomized multi-process soak test of a daemon, with every retrieved byte
checked and faults injected by seed (`kvdepot.soak.run` says which, and what fails a run)."""
