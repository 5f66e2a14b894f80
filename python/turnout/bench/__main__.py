"""The command line: ``python -m turnout.bench [SUBCOMMAND ...] [--ranks N]
[--json PATH] [--quick]``."""
import argparse
import importlib
import os
import sys
import traceback
from typing import List, Optional

from . import SUBCOMMANDS, report


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m turnout.bench",
        description="turnout's benchmarks, each run on every local GPU at once (one process per rank). "
                    "Prints a table per subcommand, then writes the JSON (and a PNG beside it when "
                    "matplotlib is installed). On one GPU the ranks share it (4 by default): the figures "
                    "then check the protocol and host time; bandwidth there is not NVLink bandwidth.",
        epilog=f"subcommands, in the order they run by default: {', '.join(SUBCOMMANDS)}")
    parser.add_argument("subcommands", nargs="*", metavar="SUBCOMMAND",
                        help="what to run (default: all of them)")
    parser.add_argument("--ranks", type=positive_int, default=None, metavar="N",
                        help="number of ranks, round-robin over the visible GPUs (default: one per GPU, "
                             f"or {report.SHARED_DEFAULT_RANKS} sharing the GPU when only one is visible)")
    parser.add_argument("--json", default="bench-results.json", metavar="PATH",
                        help="where to write the results (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and sizes, for a smoke run")
    args = parser.parse_args(argv)
    unknown = [name for name in args.subcommands if name not in SUBCOMMANDS]
    if unknown:
        parser.error(f"unknown subcommand(s) {', '.join(unknown)}; choose from {', '.join(SUBCOMMANDS)}")
    # Given order, each once; none given means all.
    args.subcommands = list(dict.fromkeys(args.subcommands)) or list(SUBCOMMANDS)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    command = ["python", "-m", "turnout.bench"] + (sys.argv[1:] if argv is None else list(argv))
    results, errors, panels = {}, {}, {}
    machine = report.machine_info(args.ranks)
    num_ranks = machine["ranks"]
    if machine["ranks_share_gpus"]:
        print(report.SHARED_NOTE.format(**machine))
        print()
    for name in args.subcommands:
        try:
            module = importlib.import_module(f"{__package__}.{name}")
            rows = module.run(num_ranks, args.quick)
        except Exception:
            # One failing subcommand should not cost the others' results.
            errors[name] = traceback.format_exc()
            print(f"{name} failed:\n{errors[name]}", file=sys.stderr)
            continue
        results[name] = rows
        print(module.TITLE)
        print(report.format_table(rows, module.COLUMNS))
        print()
        if hasattr(module, "plot_series") and rows:
            panels[name] = module.plot_series(rows)
    png = os.path.splitext(args.json)[0] + ".png"
    if report.plot(panels, png, report.SHARED_NOTE.format(**machine) if machine["ranks_share_gpus"] else None):
        print(f"wrote {png}")
    report.write_json(report.record(command, results, machine, errors), args.json)
    print(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
