"""Answers for people: what a llama.cpp log says went wrong and what would fix it (``diagnose``),
what fits on a machine (``fit``), and the one-line summary that ``diagnose``, ``tune`` and
``profile show`` share (``summary``)."""
