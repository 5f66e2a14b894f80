"""turnout's benchmarks: ``python -m turnout.bench [SUBCOMMAND ...]``.

Each subcommand is a module of this package with the same name that provides
``TITLE`` (a line above its table), ``COLUMNS`` (see ``report.column``),
``run(num_ranks, quick) -> rows`` and, optionally, ``plot_series(rows)`` for the
PNG. Adding one is a module plus an entry below.
"""

#: The subcommands, in the order a plain ``python -m turnout.bench`` runs them.
SUBCOMMANDS = ("ceiling", "layout", "intranode")
