"""The internode bench's pure-Python parts (no GPU): its network accounting
against the host reference's internode_wire and a hand count, the refusal of
a group of one NVL domain, the labels of the emulated domains, and the
command line's handling of a subcommand run only when named."""
import numpy as np
import pytest
import torch

import turnout_reference as ref
from turnout.bench import ON_REQUEST, SHAPE_OPTIONS, SUBCOMMANDS, report
from turnout.bench.__main__ import main, parse_args
from turnout.bench.internode import (
    DOMAIN_ENV,
    MAIN_SMS,
    RDMA_RECV,
    RDMA_SEND,
    declared_domain_size,
    finish,
    make_row,
    nvshmem_environment,
    plot_series,
    title,
    wire_rows,
)
from turnout.bench.internode_wire import (
    deepep_combine_token_bytes,
    deepep_dispatch_token_bytes,
    network_counts,
    turnout_combine_token_bytes,
    turnout_dispatch_token_bytes,
)
from turnout.bench.low_latency import EMULATED_LABEL, SHARED_LABEL


def routing(num_ranks: int, num_nvl_ranks: int, seed: int, empty_rank: int = 1):
    """Every rank's is_token_in_rank (uint8 [T, R]) from random top-4 routing; ``empty_rank`` has no tokens."""
    rng = np.random.default_rng(seed)
    num_experts = 4 * num_ranks
    out = []
    for r in range(num_ranks):
        t = 0 if r == empty_rank else int(rng.integers(1, 60))
        ids = rng.integers(-1, num_experts, size=(t, 4), dtype=np.int64)
        out.append(ref.get_dispatch_layout(ids, num_ranks, num_experts, num_nvl_ranks)[3].astype(np.uint8))
    return out


@pytest.mark.parametrize("row_bytes, num_scales, num_topk, hidden", [(14336, 0, 8, 7168), (7168, 56, 8, 7168),
                                                                     (32, 1, 3, 16), (100, 0, 0, 50)])
def test_token_bytes_are_the_references(row_bytes, num_scales, num_topk, hidden):
    assert turnout_dispatch_token_bytes(row_bytes, num_scales, num_topk) == \
        ref.turnout_dispatch_token_bytes(row_bytes, num_scales, num_topk)
    assert deepep_dispatch_token_bytes(row_bytes, num_scales, num_topk) == \
        ref.deepep_dispatch_token_bytes(row_bytes, num_scales, num_topk)
    assert turnout_combine_token_bytes(hidden, num_topk) == ref.turnout_combine_token_bytes(hidden, num_topk)
    assert deepep_combine_token_bytes(hidden, num_topk) == ref.deepep_combine_token_bytes(hidden, num_topk)


def test_the_figures_docs_internode_states():
    # FP8 at H = 7168, top-8: 7472 B in both protocols; BF16 combine rows 14368 B against 14384 B.
    assert turnout_dispatch_token_bytes(7168, 56, 8) == deepep_dispatch_token_bytes(7168, 56, 8) == 7472
    assert (turnout_combine_token_bytes(7168, 8), deepep_combine_token_bytes(7168, 8)) == (14368, 14384)


@pytest.mark.parametrize("num_ranks, num_nvl_ranks, channels, chunk", [(4, 2, 3, 4), (4, 1, 2, 1), (8, 4, 5, 3),
                                                                       (8, 2, 1, 16), (16, 8, 4, 2), (6, 3, 7, 5)])
def test_counts_equal_the_reference(num_ranks, num_nvl_ranks, channels, chunk):
    in_rank = routing(num_ranks, num_nvl_ranks, seed=num_ranks * 10 + num_nvl_ranks)
    params = ref.InternodeWireParams()
    params.row_bytes, params.num_scales, params.num_topk, params.hidden = 7168, 56, 8, 7168
    params.num_nvl_ranks, params.num_channels, params.chunk_tokens = num_nvl_ranks, channels, chunk
    expected = ref.internode_wire(in_rank, params)
    for rank in range(num_ranks):
        got = network_counts(in_rank, rank, num_nvl_ranks, row_bytes=7168, num_scales=56, num_topk=8, hidden=7168,
                             num_channels=channels, chunk_tokens=chunk)
        assert got == dict(expected[rank]), f"rank {rank}"


def test_hand_count():
    # 4 ranks as 2 domains of 2, one channel, puts of one token. Rank 0 sends 3 tokens:
    # t0 to ranks 2 and 3 (one copy to domain 1, two per rank), t1 to rank 1 (own domain: nothing
    # crosses), t2 to ranks 0 and 3 (one copy, one per rank). Rank 2 sends one token to ranks 0 and 1.
    in_rank = [torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0], [1, 0, 0, 1]], dtype=torch.bool),
               torch.zeros(0, 4, dtype=torch.bool),
               torch.tensor([[1, 1, 0, 0]], dtype=torch.bool),
               torch.zeros(0, 4, dtype=torch.bool)]
    got = network_counts(in_rank, 0, 2, row_bytes=32, num_scales=0, num_topk=0, hidden=16, num_channels=1,
                         chunk_tokens=1)
    ours, theirs = turnout_dispatch_token_bytes(32, 0, 0), deepep_dispatch_token_bytes(32, 0, 0)
    assert (ours, theirs) == (48, 48)
    assert (got["token_domain_pairs"], got["token_rank_pairs"]) == (2, 3)
    assert (got["dispatch_turnout_bytes"], got["dispatch_deepep_bytes"], got["dispatch_per_rank_bytes"]) == \
        (2 * 48, 2 * 48, 3 * 48)
    assert (got["dispatch_turnout_messages"], got["dispatch_per_rank_messages"]) == (2, 3)
    # Combine: rank 0 forwards for rank 2 (its local index in domain 1), whose one token reached domain 0:
    # one partial back; per rank, one row back per row received from domain 1 (rank 2's token).
    assert (got["combine_turnout_bytes"], got["combine_deepep_bytes"], got["combine_per_rank_bytes"]) == \
        (32, 48, 32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_nvl_ranks=3), "positive divisor"),
    (dict(num_nvl_ranks=0), "positive divisor"),
    (dict(num_channels=0), "num_channels"),
    (dict(chunk_tokens=0), "chunk_tokens"),
    (dict(rank=4), "outside"),
])
def test_bad_arguments_raise(kwargs, match):
    args = dict(rank=0, num_nvl_ranks=2, row_bytes=32, num_scales=0, num_topk=0, hidden=16, num_channels=1,
                chunk_tokens=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        network_counts([torch.zeros(2, 4, dtype=torch.bool)] * 4, **args)
    with pytest.raises(ValueError, match=r"expected \[T, 4\]"):
        network_counts([torch.zeros(2, 3, dtype=torch.bool)] * 4, 0, 2, 32, 0, 0, 16, 1, 1)


def test_wire_rows_put_the_protocols_side_by_side():
    in_rank = routing(8, 4, seed=5, empty_rank=-1)
    shape = dict(SHAPE_OPTIONS["internode"], hidden=256)
    rows = {r["op"]: r for r in wire_rows(in_rank, 0, 4, shape)}
    assert list(rows) == ["dispatch BF16", "dispatch FP8", "combine BF16"]
    fp8 = rows["dispatch FP8"]
    assert fp8["figure"] == "wire: dispatch FP8" and fp8["kind"] == "wire"
    assert fp8["turnout_bytes"] == fp8["token_domain_pairs"] * turnout_dispatch_token_bytes(256, 2, 8)
    assert fp8["per_rank_bytes"] == fp8["token_rank_pairs"] * turnout_dispatch_token_bytes(256, 2, 8)
    assert fp8["ratio_deepep"] == pytest.approx(fp8["turnout_bytes"] / fp8["deepep_bytes"])
    assert fp8["ratio_per_rank"] == pytest.approx(fp8["per_rank_bytes"] / fp8["turnout_bytes"]) and \
        fp8["ratio_per_rank"] >= 1
    assert rows["dispatch BF16"]["turnout_bytes"] > fp8["turnout_bytes"]


def test_wire_rows_count_turnouts_puts_over_its_channels_per_block():
    in_rank = routing(8, 4, seed=5, empty_rank=-1)
    shape = dict(SHAPE_OPTIONS["internode"], hidden=256)
    one = {r["op"]: r for r in wire_rows(in_rank, 0, 4, shape)}
    three = {r["op"]: r for r in wire_rows(in_rank, 0, 4, shape, channels_per_block=3)}
    common = dict(rank=0, num_nvl_ranks=4, row_bytes=256, num_scales=2, num_topk=shape["topk"], hidden=256)
    ours = network_counts(in_rank, **common, num_channels=MAIN_SMS // 2 * 3, chunk_tokens=min(RDMA_SEND,
                                                                                             RDMA_RECV // 3))
    fp8 = three["dispatch FP8"]
    assert fp8["turnout_messages"] == ours["dispatch_turnout_messages"] >= one["dispatch FP8"]["turnout_messages"]
    # Bytes do not depend on channels, and DeepEP's protocol keeps its own.
    for op in one:
        assert three[op]["turnout_bytes"] == one[op]["turnout_bytes"]
        assert (three[op]["deepep_bytes"], three[op]["deepep_messages"]) == \
            (one[op]["deepep_bytes"], one[op]["deepep_messages"])


@pytest.mark.parametrize("env, match", [
    ({}, "form one NVL domain"),
    ({DOMAIN_ENV: "4"}, "all 4 ranks in one NVL domain"),
    ({DOMAIN_ENV: "8"}, "must divide the 4 ranks"),
    ({DOMAIN_ENV: "3"}, "must divide the 4 ranks"),
    ({DOMAIN_ENV: "0"}, "must divide the 4 ranks"),
    ({DOMAIN_ENV: "two"}, "not a number"),
])
def test_one_domain_is_refused_by_name(env, match):
    from turnout.bench.report import Refused

    with pytest.raises(Refused, match=match) as raised:
        declared_domain_size(4, env)
    assert f"{DOMAIN_ENV}=2 NVSHMEM_REMOTE_TRANSPORT=none python -m turnout.bench internode" in str(raised.value)


def test_declared_domains_are_taken():
    assert declared_domain_size(4, {DOMAIN_ENV: "2"}) == 2
    assert declared_domain_size(4, {DOMAIN_ENV: " 1 "}) == 1
    assert declared_domain_size(16, {DOMAIN_ENV: "8"}) == 8


def merged_rows(shared: bool):
    shape = SHAPE_OPTIONS["internode"]
    rows = [make_row("gpu", op, sms, time_us=100.0 + sms, gbps=50.0) for sms in (24, 12)
            for op in ("dispatch BF16", "dispatch FP8", "combine BF16")]
    rows += [make_row("wire", "dispatch FP8", 24, turnout_bytes=1 << 20, deepep_bytes=1 << 20,
                      per_rank_bytes=3 << 20)]
    return finish([dict(r, **shape) for r in rows], 4, 2, shared)


def test_gpu_times_carry_the_emulated_label():
    rows = merged_rows(shared=False)
    gpu = [r for r in rows if r["kind"] == "gpu"]
    assert all(r["label"] == EMULATED_LABEL for r in gpu)
    wire = [r for r in rows if r["kind"] == "wire"]
    assert all("label" not in r for r in wire)
    assert all((r["num_domains"], r["nvl_domain_size"], r["num_ranks"]) == (2, 2, 4) for r in rows)
    assert f"EP4 as 2 domains of 2 ranks, {EMULATED_LABEL}" in title(rows)
    assert not title(rows).endswith(SHARED_LABEL)
    times, network = plot_series(rows)
    assert EMULATED_LABEL in times["title"] and [label for label, _ in times["bars"]] == ["12 SMs", "24 SMs"]
    assert [label for label, _ in network["bars"]] == ["turnout", "DeepEP", "per rank, no forwarding"]


def test_shared_gpu_adds_its_label():
    rows = merged_rows(shared=True)
    assert all(r["label"] == f"{SHARED_LABEL}; {EMULATED_LABEL}" for r in rows if r["kind"] == "gpu")
    assert title(rows).endswith(SHARED_LABEL)
    assert SHARED_LABEL in plot_series(rows)[0]["title"]


def test_internode_runs_only_when_named():
    assert "internode" in ON_REQUEST and "internode" not in SUBCOMMANDS
    assert parse_args([]).subcommands == list(SUBCOMMANDS)
    args = parse_args(["internode", "--tokens", "1024", "--quick"])
    assert args.subcommands == ["internode"] and args.tokens == 1024
    with pytest.raises(SystemExit):
        parse_args(["internodes"])


def test_command_line_refuses_one_domain_without_a_traceback(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(DOMAIN_ENV, raising=False)
    # A host with a GPU: the refusal is the domain's, whatever GPUs the test host has.
    monkeypatch.setattr(report, "machine_info", lambda ranks: {
        "gpus": ["H100"], "count": 1, "torch": "x", "cuda": None, "ranks": ranks, "ranks_share_gpus": True,
        "gpus_label": "H100"})
    path = tmp_path / "out.json"
    assert main(["internode", "--ranks", "4", "--json", str(path)]) == 1
    err = capsys.readouterr().err
    assert "internode refused: internode: the 4 ranks of this host form one NVL domain" in err
    assert "Traceback" not in err
    import json

    doc = json.loads(path.read_text())
    assert "form one NVL domain" in doc["errors"]["internode"] and "internode" not in doc["results"]


def test_nvshmem_environment(monkeypatch):
    monkeypatch.setenv("TURNOUT_MPS_CONTROL", "/opt/mps/bin/nvidia-cuda-mps-control")
    env = {"PATH": "/usr/bin"}
    nvshmem_environment(env, shared=True)
    assert env == {"PATH": "/opt/mps/bin:/usr/bin", "NVSHMEM_REMOTE_TRANSPORT": "none"}
    nvshmem_environment(env, shared=True)
    assert env["PATH"] == "/opt/mps/bin:/usr/bin", "the folder goes on PATH once"
    # A transport the caller chose stays; a GPU per rank needs no MPS.
    env = {"PATH": "/usr/bin", "NVSHMEM_REMOTE_TRANSPORT": "ibgda"}
    nvshmem_environment(env, shared=False)
    assert env == {"PATH": "/usr/bin", "NVSHMEM_REMOTE_TRANSPORT": "ibgda"}
    monkeypatch.setenv("TURNOUT_MPS_CONTROL", "")
    env = {}
    nvshmem_environment(env, shared=True)
    assert env == {"NVSHMEM_REMOTE_TRANSPORT": "none"}
