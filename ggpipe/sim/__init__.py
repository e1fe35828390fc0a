"""Simulation: profiles of measured hosts and links (``ggpipe calibrate``),
and whole jobs on a virtual clock with the real decoding loops
(``ggpipe simulate``). Above ``decoding`` and ``cluster``; only front ends
import it."""
