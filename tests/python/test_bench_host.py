"""The host subcommand (no GPU): run only when named, and each of its targets
names a row that intranode.host_times or the subcommand itself makes."""
import inspect

import pytest

from turnout.bench import ON_REQUEST, SUBCOMMANDS, host, intranode
from turnout.bench.__main__ import parse_args


def test_host_runs_only_when_named():
    assert "host" in ON_REQUEST and "host" not in SUBCOMMANDS
    assert parse_args(["host", "--quick"]).subcommands == ["host"]
    with pytest.raises(SystemExit):
        parse_args(["host", "--tokens", "1024"])  # no shape option: host keeps its fixed shape


@pytest.mark.parametrize("op", sorted(host.TARGETS_US))
def test_every_target_names_a_row_that_is_made(op):
    made_here = f'"{op}"' in inspect.getsource(host.measure)
    made_by_intranode = f'"{op.removesuffix(" (host)")}"' in inspect.getsource(intranode.host_times)
    assert made_here or made_by_intranode, op


def test_targets_are_the_issue_figures():
    assert host.TARGETS_US["dispatch bf16 (host)"] <= 25 and host.TARGETS_US["combine bf16 (host)"] <= 20
    assert host.TARGETS_US["layout back to back (host)"] == 38.0
