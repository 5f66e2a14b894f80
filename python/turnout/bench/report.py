"""What the bench prints and writes: aligned tables, the JSON record, the PNG."""
import datetime
import json
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: NVLink limit per GPU per direction on the reference host (4x H200, every
#: pair NV18): 18 NVLink4 links x 26.56 GB/s = 478 GB/s. Bandwidth rows are
#: given as a percent of it.
NVLINK_RAW_GBPS = 478.0

#: Ranks of a run on a single GPU, which they share.
SHARED_DEFAULT_RANKS = 4
SHARED_NOTE = ("{ranks} ranks share {count} GPU(s) ({gpus_label}): bandwidth figures measure HBM and SM sharing, "
               "not NVLink; compare them only within one run. Host times and correctness hold.")

Column = Tuple[str, Callable[[Dict], str]]


class Refused(ValueError):
    """A subcommand that cannot measure anything in this setting (a group of
    one NVL domain for internode, a shape it cannot take): the command line
    prints the message alone, no traceback."""


def column(header: str, key: str, fmt: str = "{}", scale: float = 1) -> Column:
    """A table column showing ``row[key] / scale`` through ``fmt``; "-" when
    missing or None."""
    def cell(row: Dict) -> str:
        value = row.get(key)
        return "-" if value is None else fmt.format(value / scale if scale != 1 else value)
    return header, cell


def range_column(header: str, key: str, fmt: str = "{:.1f}") -> Column:
    """``min..max`` over ranks, from the fields ``timing.merge_ranks`` adds."""
    def cell(row: Dict) -> str:
        low, high = row.get(f"{key}_min"), row.get(f"{key}_max")
        return "-" if low is None or high is None else f"{fmt.format(low)}..{fmt.format(high)}"
    return header, cell


def pct_of_raw(gbps: float) -> float:
    return 100.0 * gbps / NVLINK_RAW_GBPS


def format_table(rows: Sequence[Dict], columns: Sequence[Column]) -> str:
    """Right-aligned columns under a header and a rule."""
    cells = [[header for header, _ in columns]] + [[cell(row) for _, cell in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def default_ranks(num_devices: int) -> int:
    """One rank per GPU; on a single GPU, ``SHARED_DEFAULT_RANKS`` ranks sharing it."""
    return num_devices if num_devices >= 2 else SHARED_DEFAULT_RANKS


def machine_info(num_ranks: Optional[int] = None) -> Dict:
    """The GPUs, software, and the ranks of the run (``num_ranks`` or the default)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(count)]
    ranks = num_ranks or default_ranks(count)
    return {"gpus": gpus, "count": count, "torch": torch.__version__, "cuda": torch.version.cuda,
            "ranks": ranks, "ranks_share_gpus": ranks > count, "gpus_label": ", ".join(sorted(set(gpus)))}


def run_environment() -> Dict[str, str]:
    """The variables that change what a run measures: turnout's own and
    NVSHMEM's (a declared domain size, a transport left out)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("TURNOUT_", "NVSHMEM_"))}


def record(command: List[str], results: Dict[str, List[Dict]], machine: Dict,
           errors: Optional[Dict[str, str]] = None, other_gpu_processes: Optional[Dict] = None) -> Dict:
    """The JSON document of one run. ``other_gpu_processes``: what
    ``gpu_processes.query`` saw on the run's GPUs at its ``start`` and ``end``
    (and which ``gpus`` it looked at)."""
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine, "command": command, "environment": run_environment(), "results": results}
    if other_gpu_processes is not None:
        doc["other_gpu_processes"] = other_gpu_processes
    if errors:
        doc["errors"] = errors
    return doc


def write_json(doc: Dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def plot(panels: Dict[str, Dict], path: str, note: Optional[str] = None) -> bool:
    """One panel per entry, titled by its key, from a ``plot_series`` dict
    (``x``, ``y``, ``xlabel``, ``ylabel``, optional ``series``: ``(label, x,
    y)`` lines instead of one, optional ``ref``: a ``(value, label)`` line),
    or bars where the dict has ``bars`` (see ``draw_bars``); optional
    ``width`` and ``height`` in inches (5 and 4 by default; the figure takes
    the tallest). ``note`` goes above the panels (ranks
    sharing a GPU say so there); returns False, writing nothing, when
    matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib
    except ImportError:
        return False
    if not panels:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Bars with long labels ask for more room.
    widths = [panel.get("width", 5) for panel in panels.values()]
    height = max(panel.get("height", 4) for panel in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths), height), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, (name, panel) in zip(axes[0], panels.items()):
        if "bars" in panel:
            draw_bars(ax, name, panel)
            continue
        for label, xs, ys in panel.get("series", [(panel["ylabel"], panel["x"], panel.get("y"))]):
            ax.plot(xs, ys, marker="o", label=label)
        if panel.get("ref"):
            value, label = panel["ref"]
            ax.axhline(value, color="gray", linestyle="--", label=label)
        ax.set_title(name)
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(panel["x"], [str(x) for x in panel["x"]])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if note:
        fig.suptitle(note, fontsize="small", wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def draw_bars(ax, title: str, panel: Dict) -> None:
    """Grouped bars: ``categories`` along x, one bar per category for each
    ``(label, values)`` of ``bars`` (None: no bar), ``ylabel``; optional
    ``targets``, one value or None per category, drawn as a mark over the
    category."""
    categories, groups = panel["categories"], panel["bars"]
    width = 0.8 / len(groups)
    for g, (label, values) in enumerate(groups):
        xs = [i - 0.4 + width * (g + 0.5) for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=label)
    targets = [(i, t) for i, t in enumerate(panel.get("targets") or []) if t is not None]
    if targets:
        ax.scatter([i for i, _ in targets], [t for _, t in targets], marker="_", s=900, color="black", zorder=3,
                   label="target")
    ax.set_title(title, fontsize="small", wrap=True)
    ax.set_ylabel(panel["ylabel"])
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize="x-small")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
