"""The command line: ``python -m turnout.bench [SUBCOMMAND ...] [--ranks N]
[--json PATH] [--quick] [--tokens N] [--hidden N] [--experts N] [--topk N]``."""
import argparse
import importlib
import os
import sys
import traceback
from typing import Dict, List, Optional

from . import ON_REQUEST, SHAPE_OPTIONS, SUBCOMMANDS, gpu_processes, report

SHAPE_HELP = {"tokens": "tokens per rank", "hidden": "hidden size", "experts": "number of experts",
              "topk": "experts per token"}


def shape_options() -> List[str]:
    """Every shape option some subcommand takes, each once."""
    return list(dict.fromkeys(option for values in SHAPE_OPTIONS.values() for option in values))


def shape_for(name: str, args: argparse.Namespace) -> Dict[str, int]:
    """The shape keyword arguments of subcommand ``name``: given or default."""
    return {option: default if getattr(args, option) is None else getattr(args, option)
            for option, default in SHAPE_OPTIONS.get(name, {}).items()}


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
        epilog=f"subcommands, in the order they run by default: {', '.join(SUBCOMMANDS)}; run only when named: "
               f"{', '.join(ON_REQUEST)} (NVL domains declared smaller than the ranks with TURNOUT_NVL_DOMAIN_SIZE)")
    parser.add_argument("subcommands", nargs="*", metavar="SUBCOMMAND",
                        help="what to run (default: all but those run only when named)")
    parser.add_argument("--ranks", type=positive_int, default=None, metavar="N",
                        help="number of ranks, round-robin over the visible GPUs (default: one per GPU, "
                             f"or {report.SHARED_DEFAULT_RANKS} sharing the GPU when only one is visible)")
    parser.add_argument("--json", default="bench-results.json", metavar="PATH",
                        help="where to write the results (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and sizes, for a smoke run")
    parser.add_argument("--bind-cpus", action="store_true",
                        help="run each rank's main thread on the CPUs local to its GPU (sets TURNOUT_BIND_CPUS=1, "
                             "which the JSON's environment records)")
    shape = parser.add_argument_group(f"shape (only {', '.join(SHAPE_OPTIONS)}; the others keep their protocol's)")
    for option in shape_options():
        defaults = ", ".join(f"{name} {values[option]}" for name, values in SHAPE_OPTIONS.items() if option in values)
        shape.add_argument(f"--{option}", type=positive_int, default=None, metavar="N",
                           help=f"{SHAPE_HELP[option]} (default: {defaults})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.subcommands if name not in SUBCOMMANDS + ON_REQUEST]
    if unknown:
        parser.error(f"unknown subcommand(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(SUBCOMMANDS + ON_REQUEST)}")
    # Given order, each once; none given means all of SUBCOMMANDS.
    args.subcommands = list(dict.fromkeys(args.subcommands)) or list(SUBCOMMANDS)
    # A shape option that no subcommand of the run reads would be a silent no-op.
    for option in shape_options():
        takers = [name for name, values in SHAPE_OPTIONS.items() if option in values]
        if getattr(args, option) is not None and not set(takers) & set(args.subcommands):
            parser.error(f"--{option} is read by {', '.join(takers)} only, which this run does not include")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.bind_cpus:
        os.environ["TURNOUT_BIND_CPUS"] = "1"  # read by every rank's process as it starts (turnout.launch)
    command = ["python", "-m", "turnout.bench"] + (sys.argv[1:] if argv is None else list(argv))
    results, errors, panels = {}, {}, {}
    machine = report.machine_info(args.ranks)
    if machine["count"] == 0:
        # Every subcommand runs on GPUs: one line, not a traceback per subcommand.
        print("turnout.bench: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver); "
              "every benchmark needs at least one GPU", file=sys.stderr)
        return 2
    num_ranks = machine["ranks"]
    # Another workload on these GPUs slows every figure: looked for before and after, said in the header.
    gpus = gpu_processes.bench_gpus(num_ranks, machine["count"])
    others = {"gpus": "all" if gpus is None else gpus,
              "start": gpu_processes.query(gpu_processes.own_pids(), gpus)}
    header = [report.SHARED_NOTE.format(**machine)] if machine["ranks_share_gpus"] else []
    header += gpu_processes.report_lines(others["start"], "start")
    if header:
        print("\n".join(header))
        print()
    for name in args.subcommands:
        try:
            module = importlib.import_module(f"{__package__}.{name}")
            rows = module.run(num_ranks, args.quick, **shape_for(name, args))
        except report.Refused as e:
            # Nothing to measure in this setting: the reason, not a traceback.
            errors[name] = str(e)
            print(f"{name} refused: {e}", file=sys.stderr)
            continue
        except Exception:
            # One failing subcommand should not cost the others' results.
            errors[name] = traceback.format_exc()
            print(f"{name} failed:\n{errors[name]}", file=sys.stderr)
            continue
        results[name] = rows
        print(module.title(rows) if hasattr(module, "title") else module.TITLE)
        print(report.format_table(rows, module.COLUMNS))
        print()
        if hasattr(module, "plot_series") and rows:
            series = module.plot_series(rows)
            for panel in series if isinstance(series, list) else [series]:
                panels[panel.get("title", name)] = panel
    others["end"] = gpu_processes.query(gpu_processes.own_pids(), gpus)
    footer = gpu_processes.report_lines(others["end"], "end")
    if footer:
        print("\n".join(footer))
    png = os.path.splitext(args.json)[0] + ".png"
    if report.plot(panels, png, "\n".join(header + footer) or None):
        print(f"wrote {png}")
    report.write_json(report.record(command, results, machine, errors, others), args.json)
    print(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
