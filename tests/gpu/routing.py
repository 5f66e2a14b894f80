"""Random top-k routings the tests draw from: uniform, skewed, with empty
ranks and -1 slots. All return int64 [T, K] on the given device."""
import torch


def uniform(num_tokens: int, num_experts: int, num_topk: int, gen: torch.Generator, device) -> torch.Tensor:
    # The benchmark's routing: top-k of |randn| + 1 scores.
    scores = torch.randn(num_tokens, num_experts, generator=gen).abs() + 1
    return scores.topk(num_topk, dim=-1).indices.to(device)


def one_expert(num_tokens: int, num_experts: int, num_topk: int, gen: torch.Generator, device) -> torch.Tensor:
    """Every token's first slot is the same expert; the other slots empty."""
    e = int(torch.randint(num_experts, (1,), generator=gen))
    idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
    idx[:, 0] = e
    return idx.to(device)


def skip_rank(num_tokens: int, num_experts: int, num_topk: int, num_ranks: int, gen: torch.Generator,
              device) -> torch.Tensor:
    """No token goes to one (random) rank."""
    per_rank = num_experts // num_ranks
    skipped = int(torch.randint(num_ranks, (1,), generator=gen))
    scores = torch.randn(num_tokens, num_experts, generator=gen).abs() + 1
    scores[:, skipped * per_rank:(skipped + 1) * per_rank] = -1
    return scores.topk(num_topk, dim=-1).indices.to(device)


def holes(num_tokens: int, num_experts: int, num_topk: int, gen: torch.Generator, device,
          fraction: float = 0.6) -> torch.Tensor:
    """Uniform, then `fraction` of the slots set to -1 (some tokens reach no rank)."""
    idx = uniform(num_tokens, num_experts, num_topk, gen, "cpu")
    idx[torch.rand(idx.shape, generator=gen) < fraction] = -1
    return idx.to(device)


def one_rank(num_tokens: int, num_experts: int, num_topk: int, num_ranks: int, gen: torch.Generator,
             device) -> torch.Tensor:
    """Every token's experts all live on one (random) rank."""
    per_rank = num_experts // num_ranks
    target = int(torch.randint(num_ranks, (1,), generator=gen))
    scores = torch.full((num_tokens, num_experts), -1.0)
    scores[:, target * per_rank:(target + 1) * per_rank] = torch.rand(num_tokens, per_rank, generator=gen) + 1
    k = min(num_topk, per_rank)
    idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
    idx[:, :k] = scores.topk(k, dim=-1).indices
    return idx.to(device)
