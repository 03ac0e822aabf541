"""Comm layer (``lightning_onebit/comm.py``, ``topology.py``, ``streams.py``): the compressed allreduce, flat and
hierarchical, its pipelining and byte accounting, the topology plan, and the stream and timing seam."""
