"""The GPU suite, marked ``gpu`` (skipped without CUDA; ``test_nccl.py`` needs two GPUs), and
``test_cuda_detectors.py``: what CUDA and NCCL would break, seen on CPU (not marked: it runs everywhere).

GPU checks of a single layer stay with that layer (``kernels/``, ``hooks/``, ``callbacks/``)."""
