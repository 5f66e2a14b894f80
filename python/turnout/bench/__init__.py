"""turnout's benchmarks: ``python -m turnout.bench [SUBCOMMAND ...]``.

Each subcommand is a module of this package with the same name that provides
``TITLE`` (a line above its table), ``COLUMNS`` (see ``report.column``),
``run(num_ranks, quick) -> rows`` (raising ``report.Refused`` where it
cannot measure in this setting) and, optionally, ``plot_series(rows)`` for the
PNG (one panel, or a list of panels each with its ``title``) and ``title(rows)``
for a title that depends on the run. Adding one is a module plus an entry
below (in ``SUBCOMMANDS``, or in ``ON_REQUEST`` for one run only when named).
"""

#: The subcommands, in the order a plain ``python -m turnout.bench`` runs them.
SUBCOMMANDS = ("ceiling", "layout", "intranode", "low_latency")
#: Subcommands run only when named: internode needs NVL domains declared
#: smaller than the ranks (TURNOUT_NVL_DOMAIN_SIZE), which a plain run lacks;
#: host repeats intranode's and layout's host rows with many more calls.
ON_REQUEST = ("internode", "host")

#: The subcommands that take shape options (``--tokens`` and so on), each with
#: its defaults: its protocol's shape. ``run`` gets them as keyword arguments;
#: the other subcommands keep their fixed shape.
SHAPE_OPTIONS = {"low_latency": {"tokens": 128, "hidden": 7168, "experts": 288, "topk": 8},
                 "internode": {"tokens": 4096, "hidden": 7168, "experts": 256, "topk": 8}}


def shape_problem(shape: dict, num_ranks: int):
    """What a shape-taking subcommand itself needs of its shape (the library
    checks the rest): the first problem as a message, or None."""
    from .wire import SCALE_GROUP

    if shape["experts"] % num_ranks:
        return f"--experts ({shape['experts']}) must be a multiple of the ranks ({num_ranks})"
    if shape["hidden"] % SCALE_GROUP:
        return f"--hidden ({shape['hidden']}) must be a multiple of {SCALE_GROUP} (FP8 scales)"
    if shape["topk"] > shape["experts"]:
        return f"--topk ({shape['topk']}) exceeds --experts ({shape['experts']})"
    return None
