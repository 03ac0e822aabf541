"""The benchmarks behind the README's figures. Each runs from the repository root as ``python -m benchmarks.NAME``
(``lightning_onebit`` installed, e.g. ``pip install -e .``); ``python -m benchmarks.NAME --help`` shows its command
lines. Shared parts: :mod:`benchmarks.common` (paths, the argument parser, the in-process multi-rank launcher
``launch``, the example module, results files) and :mod:`benchmarks.netns` (the shaped network namespaces of
``slow_link``, ``multinode`` and ``advisor``, removed whatever happens).
"""
