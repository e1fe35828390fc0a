"""Speculation building blocks, MPI-free: trees, verification, the head's
speculation graph, KV partitions, the confidence-cutoff controller and the
draft-model proposer. The modes in ggpipe.scheduling combine them."""
