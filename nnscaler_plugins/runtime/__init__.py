"""What runs on every rank: the ParallelModule, its collectives, process groups and gradient reducer,
and the piece functions generated code calls instead of a split op."""
