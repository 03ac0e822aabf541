"""Comm layer (``lightning_onebit/comm/``, and ``lightning_onebit/streams.py``): the compressed allreduce, flat and
hierarchical, its pipelining and byte accounting, the topology plan and its process groups, and the stream and timing
seam."""
