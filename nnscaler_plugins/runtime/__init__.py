"""What runs on every rank: the ParallelModule, its collectives, process groups and gradient reducer."""
