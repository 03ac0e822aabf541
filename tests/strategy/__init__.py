"""Strategy layer (``lightning_onebit/strategy/``, with ``precision.py`` and ``sidecar.py``): OnebitStrategy in real
Trainer runs, the process-group lifecycle, overlap and topology under Lightning, checkpoints and their sidecars, resumes
in another setup, stalled ranks, LightningCLI, and the bitwise replay of the behaviour record (``tests/behaviour/``)."""
