"""Answers for people: what a llama.cpp log says went wrong and what would fix it (``diagnose``),
what fits on a machine (``fit``), the one-line summary that ``diagnose``, ``tune`` and
``profile show`` share (``summary``), and the HTML report of a tune (``html``), read from its study
(``data``), with plotly plots (``plots``)."""
