"""Config, its buffer size hints, and the per-group-size configs and hints of Buffer."""
import pytest

from turnout import Buffer, Config

HIDDEN_BYTES = 7168 * 2


def test_defaults_and_repr():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 256)
    assert repr(c) == ("Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, "
                       "num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)")


def test_fields_positional_and_by_name():
    c = Config(24, 8, 512, 16, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (24, 8, 512, 16, 128)
    c = Config(num_sms=12, num_max_nvl_chunked_send_tokens=4, num_max_nvl_chunked_recv_tokens=64)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (12, 4, 64)
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 256)


def test_fields_are_read_only():
    with pytest.raises(AttributeError):
        Config().num_sms = 22


@pytest.mark.parametrize("args, name", [
    ((21, 6, 256), "num_sms"),
    ((0, 6, 256), "num_sms"),
    ((20, 300, 256), "num_max_nvl_chunked_send_tokens"),
    ((20, 0, 256), "num_max_nvl_chunked_send_tokens"),
    ((20, 6, 256, 300, 256), "num_max_rdma_chunked_send_tokens"),
])
def test_invalid_config_raises(args, name):
    with pytest.raises(ValueError, match=name):
        Config(*args)


def test_nvl_size_hint_grows_with_hidden_and_ranks():
    c = Config()
    assert c.get_nvl_buffer_size_hint(256, 2) > 0
    by_hidden = [c.get_nvl_buffer_size_hint(h, 8) for h in (2048, 4096, 7168 * 2, 16384 * 2)]
    assert by_hidden == sorted(set(by_hidden)), f"not strictly growing with hidden: {by_hidden}"
    by_ranks = [c.get_nvl_buffer_size_hint(HIDDEN_BYTES, n) for n in (2, 4, 8)]
    assert by_ranks == sorted(set(by_ranks)), f"not strictly growing with ranks: {by_ranks}"
    all_ranks = [c.get_nvl_buffer_size_hint(HIDDEN_BYTES, n) for n in range(2, 161)]
    assert all_ranks == sorted(all_ranks), "the NVL hint must never shrink as ranks grow"


def test_nvl_size_hint_grows_with_the_config():
    small = Config(20, 6, 128).get_nvl_buffer_size_hint(HIDDEN_BYTES, 8)
    assert Config(20, 6, 256).get_nvl_buffer_size_hint(HIDDEN_BYTES, 8) > small
    assert Config(24, 6, 128).get_nvl_buffer_size_hint(HIDDEN_BYTES, 8) > small


def test_rdma_size_hint_is_zero_within_one_nvl_domain():
    c = Config()
    assert all(c.get_rdma_buffer_size_hint(HIDDEN_BYTES, n) == 0 for n in range(2, 9))
    assert all(c.get_rdma_buffer_size_hint(HIDDEN_BYTES, n) > 0 for n in (16, 24, 64, 160))


@pytest.mark.parametrize("hint", ["get_nvl_buffer_size_hint", "get_rdma_buffer_size_hint"])
def test_size_hints_reject_bad_arguments(hint):
    fn = getattr(Config(), hint)
    with pytest.raises(ValueError, match="hidden_bytes"):
        fn(0, 8)
    with pytest.raises(ValueError, match="num_ranks"):
        fn(HIDDEN_BYTES, 1)
    with pytest.raises(ValueError, match="num_ranks"):
        fn(HIDDEN_BYTES, 161)


@pytest.mark.parametrize("get", [Buffer.get_dispatch_config, Buffer.get_combine_config])
def test_buffer_configs_for_every_group_size(get):
    for n in range(2, 161):
        c = get(n)
        assert isinstance(c, Config) and c.num_sms == Buffer.num_sms, f"{n} ranks: {c}"
    Buffer.set_num_sms(24)
    assert get(8).num_sms == 24


@pytest.mark.parametrize("get", [Buffer.get_dispatch_config, Buffer.get_combine_config])
@pytest.mark.parametrize("n", [1, 161, 0])
def test_buffer_configs_reject_bad_group_sizes(get, n):
    with pytest.raises(ValueError, match="num_ranks"):
        get(n)


LL_BASE = dict(num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=16, num_experts=256)


def ll_hint(**changes):
    args = {**LL_BASE, **changes}
    return Buffer.get_low_latency_rdma_size_hint(args["num_max_dispatch_tokens_per_rank"], args["hidden"],
                                                 args["num_ranks"], args["num_experts"])


@pytest.mark.parametrize("name, values", [
    ("num_max_dispatch_tokens_per_rank", [1, 64, 128, 256, 1024]),
    ("hidden", [128, 2048, 4096, 7168, 8192]),
    ("num_ranks", [2, 4, 8, 16, 32, 64]),
    ("num_experts", [256, 512, 1024]),
])
def test_low_latency_hint_is_monotone(name, values):
    hints = [ll_hint(**{name: v}) for v in values]
    assert all(h > 0 for h in hints)
    assert hints == sorted(hints), f"{name} {values}: {hints}"
    if name != "num_experts":
        assert hints[-1] > hints[0], f"more {name} must need more bytes: {hints}"


@pytest.mark.parametrize("changes, name", [
    (dict(num_max_dispatch_tokens_per_rank=0), "num_max_dispatch_tokens_per_rank"),
    (dict(hidden=100), "hidden"),
    (dict(hidden=0), "hidden"),
    (dict(num_ranks=1), "num_ranks"),
    (dict(num_experts=100), "num_experts"),
    (dict(num_experts=0), "num_experts"),
])
def test_low_latency_hint_rejects_bad_arguments(changes, name):
    with pytest.raises(ValueError, match=name):
        ll_hint(**changes)


def test_low_latency_hint_goes_past_the_normal_modes_rank_limit():
    # One rank per expert at most (1024), past the 160 of the normal modes.
    assert ll_hint(num_ranks=256) < ll_hint(num_ranks=1024, num_experts=1024)
    with pytest.raises(ValueError, match="num_ranks"):
        ll_hint(num_ranks=2048, num_experts=1024)
