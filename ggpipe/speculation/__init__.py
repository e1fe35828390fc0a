"""Speculation building blocks, MPI-free (numpy and ggpipe.sampling only):
trees, verification, the head's speculation graph, KV partitions, the
confidence-cutoff controller, and the drafting strategies in ``proposers/``
behind one protocol. ggpipe.decoding's loop combines them."""
