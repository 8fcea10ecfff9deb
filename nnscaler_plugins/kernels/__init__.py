"""What generated code calls on a device, below every stage that plans or lowers.

Autograd-aware collectives (each backward its dual), the group-aware kernels that communicate inside
one op (ring and Ulysses attention, expert dispatch by all-to-all, vocabulary-parallel pieces of
embeddings and losses, batch statistics made whole across replicas) and co-shard's piece runner.
Op rules name these functions as the targets of split ops and the runtime runs them; neither the
rules nor the lowering needs the runtime for it, which is why they live in a layer of their own.
"""
