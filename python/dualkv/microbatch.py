"""Group-aware micro-batching under a packed-token budget, balanced over data-parallel ranks.

A group (prompt P, responses R_1..R_N) costs P + sum R_i packed tokens. Groups are never split
unless one alone exceeds the budget; then it is split into response subsets, each carrying its own
copy of the prompt (the fewest subsets first-fit-decreasing finds). Every rank gets the same number
of micro-batches (so collectives line up); ranks are balanced by total cost (packed tokens unless a
cost function is given), longest-processing-time first. Pure host code, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["MicroBatch", "MicroBatchPlan", "plan_micro_batches"]

CostFn = Callable[[int, Sequence[int]], float]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: ``entries[k] = (group index, response indices)``, groups in ascending order."""

    entries: Tuple[Tuple[int, Tuple[int, ...]], ...]
    prompt_lens: Tuple[int, ...]  #: prompt length of every entry (input of Layout.from_groups)
    response_lens: Tuple[Tuple[int, ...], ...]  #: response lengths of every entry
    num_tokens: int  #: packed tokens: sum over entries of P + sum R_i
    cost: float  #: the balancing cost (num_tokens by default)

    @property
    def num_responses(self) -> int:
        return sum(len(r) for _, r in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def rows(self, group_rows: Sequence[Sequence[int]]) -> List[int]:
        """Batch rows of this micro-batch given ``group_rows[g][i]`` = row of response i of group g
        (e.g. :attr:`dualkv.PackedBatch.group_rows`), in entry order."""
        return [int(group_rows[g][i]) for g, idx in self.entries for i in idx]


@dataclass(frozen=True)
class MicroBatchPlan:
    """``ranks[r]`` is the list of micro-batches of rank r; every rank has the same number."""

    ranks: Tuple[Tuple[MicroBatch, ...], ...]
    max_tokens: int
    rank_tokens: Tuple[int, ...]  #: packed tokens per rank
    rank_costs: Tuple[float, ...]  #: balancing cost per rank
    imbalance: float  #: max(rank cost) / mean(rank cost) - 1
    num_empty: int  #: empty micro-batches added so that every rank has the same count
    split_groups: Tuple[int, ...]  #: groups that exceeded the budget and were split
    prompt_tokens_added: int  #: extra prompt copies caused by splitting, in tokens

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def total_tokens(self) -> int:
        return sum(self.rank_tokens)

    def summary(self) -> str:
        lines = [f"{self.num_ranks} rank(s) x {self.micro_batches_per_rank} micro-batch(es), budget "
                 f"{self.max_tokens} tokens, {self.total_tokens} packed tokens, imbalance "
                 f"{100 * self.imbalance:.2f}%, {self.num_empty} empty micro-batch(es), "
                 f"{len(self.split_groups)} split group(s) (+{self.prompt_tokens_added} prompt tokens)"]
        for r, mbs in enumerate(self.ranks):
            sizes = ", ".join(str(mb.num_tokens) for mb in mbs)
            lines.append(f"  rank {r}: {self.rank_tokens[r]} tokens [{sizes}]")
        return "\n".join(lines)


def _normalise(groups: Sequence[Any]) -> List[Tuple[int, List[int]]]:
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__len__"):
        raise TypeError("plan_micro_batches: groups must be a list of (prompt_len, [response_lens])")
    out = []
    for g, item in enumerate(groups):
        if hasattr(item, "prompt_len") and hasattr(item, "response_lens"):
            p, rs = item.prompt_len, item.response_lens
        else:
            try:
                p, rs = item
            except (TypeError, ValueError):
                raise TypeError(f"plan_micro_batches: group {g} must be (prompt_len, [response_lens]) or have "
                                f".prompt_len and .response_lens, got {item!r}")
        if hasattr(rs, "tolist"):
            rs = rs.tolist()
        if isinstance(p, bool) or not hasattr(p, "__index__"):
            raise TypeError(f"plan_micro_batches: group {g}: prompt_len must be an int, got {p!r}")
        if isinstance(rs, (str, bytes)) or not hasattr(rs, "__iter__"):
            raise TypeError(f"plan_micro_batches: group {g}: response_lens must be a list of ints, got {rs!r}")
        rs = list(rs)
        for i, r in enumerate(rs):
            if isinstance(r, bool) or not hasattr(r, "__index__"):
                raise TypeError(f"plan_micro_batches: group {g}: response {i} length must be an int, got {r!r}")
        p, rs = int(p), [int(r) for r in rs]
        if p < 1:
            raise ValueError(f"plan_micro_batches: group {g} has prompt length {p}; need >= 1")
        if not rs:
            raise ValueError(f"plan_micro_batches: group {g} has no responses")
        for i, r in enumerate(rs):
            if r < 1:
                raise ValueError(f"plan_micro_batches: group {g}, response {i} has length {r} (responses of "
                                 "length 0 are not allowed)")
        out.append((p, rs))
    return out


def _split_group(g: int, p: int, rs: List[int], max_tokens: int) -> List[Tuple[int, ...]]:
    """Response subsets of one group, each fitting with its prompt: first-fit decreasing."""
    cap = max_tokens - p
    order = sorted(range(len(rs)), key=lambda i: (-rs[i], i))
    longest = order[0]
    if rs[longest] > cap:
        raise ValueError(f"plan_micro_batches: group {g} cannot fit: prompt ({p}) + response {longest} "
                         f"({rs[longest]}) = {p + rs[longest]} tokens > max_tokens={max_tokens}")
    bins: List[List[int]] = []
    loads: List[int] = []
    for i in order:
        for b in range(len(bins)):
            if loads[b] + rs[i] <= cap:
                bins[b].append(i)
                loads[b] += rs[i]
                break
        else:
            bins.append([i])
            loads.append(rs[i])
    return [tuple(sorted(b)) for b in bins]


def _ffd_bins(sizes: List[int], cap: int) -> int:
    """Number of bins first-fit decreasing uses (a lower bound for the search below)."""
    loads: List[int] = []
    for s in sorted(sizes, reverse=True):
        for b in range(len(loads)):
            if loads[b] + s <= cap:
                loads[b] += s
                break
        else:
            loads.append(s)
    return len(loads)


def _assign(items, tokens, costs, num_ranks: int, per_rank: int, max_tokens: int):
    """LPT over ranks with a token capacity per micro-batch; None if some item fits nowhere."""
    rank_cost = [0.0] * num_ranks
    bin_tokens = [[0] * per_rank for _ in range(num_ranks)]
    bin_cost = [[0.0] * per_rank for _ in range(num_ranks)]
    bin_items: List[List[List[int]]] = [[[] for _ in range(per_rank)] for _ in range(num_ranks)]
    order = sorted(range(len(items)), key=lambda k: (-costs[k], -tokens[k], k))
    for k in order:
        best = None
        for r in sorted(range(num_ranks), key=lambda r: (rank_cost[r], r)):
            fits = [j for j in range(per_rank) if bin_tokens[r][j] + tokens[k] <= max_tokens]
            if fits:
                j = min(fits, key=lambda j: (bin_cost[r][j], bin_tokens[r][j], j))
                best = (r, j)
                break
        if best is None:
            return None
        r, j = best
        rank_cost[r] += costs[k]
        bin_tokens[r][j] += tokens[k]
        bin_cost[r][j] += costs[k]
        bin_items[r][j].append(k)
    return bin_items


def plan_micro_batches(groups: Sequence[Any], max_tokens: int, num_ranks: int = 1,
                       cost_fn: Optional[CostFn] = None) -> MicroBatchPlan:
    """Plan micro-batches of whole groups under ``max_tokens`` packed tokens, over ``num_ranks`` ranks.

    ``groups``: ``[(prompt_len, [response_len, ...]), ...]`` (or objects with ``.prompt_len`` and
    ``.response_lens``; :meth:`dualkv.PackedBatch.groups` returns this format). ``cost_fn(P, [R_i])``
    optionally replaces packed tokens as the quantity balanced over ranks (e.g. to weight attention
    FLOPs); the budget is always in tokens.

    Raises ValueError if a group's prompt plus one of its responses exceeds ``max_tokens``.
    """
    if isinstance(max_tokens, bool) or not hasattr(max_tokens, "__index__"):
        raise TypeError(f"plan_micro_batches: max_tokens must be an int, got {max_tokens!r}")
    if isinstance(num_ranks, bool) or not hasattr(num_ranks, "__index__"):
        raise TypeError(f"plan_micro_batches: num_ranks must be an int, got {num_ranks!r}")
    max_tokens, num_ranks = int(max_tokens), int(num_ranks)
    if max_tokens < 2:
        raise ValueError(f"plan_micro_batches: max_tokens={max_tokens}; a micro-batch needs at least one prompt "
                         "and one response token")
    if num_ranks < 1:
        raise ValueError(f"plan_micro_batches: num_ranks must be >= 1, got {num_ranks}")
    gs = _normalise(groups)
    if not gs:
        raise ValueError("plan_micro_batches: no groups")

    # 1. items: whole groups, or response subsets of groups over the budget
    items: List[Tuple[int, Tuple[int, ...]]] = []
    split: List[int] = []
    added = 0
    for g, (p, rs) in enumerate(gs):
        if p + sum(rs) <= max_tokens:
            items.append((g, tuple(range(len(rs)))))
        else:
            pieces = _split_group(g, p, rs, max_tokens)
            split.append(g)
            added += p * (len(pieces) - 1)
            items.extend((g, piece) for piece in pieces)
    tokens = [gs[g][0] + sum(gs[g][1][i] for i in idx) for g, idx in items]
    if cost_fn is None:
        costs = [float(t) for t in tokens]
    else:
        costs = []
        for (g, idx), t in zip(items, tokens):
            c = float(cost_fn(gs[g][0], [gs[g][1][i] for i in idx]))
            if not (c >= 0.0) or c == float("inf"):
                raise ValueError(f"plan_micro_batches: cost_fn returned {c} for group {g}; need a finite cost >= 0")
            costs.append(c)

    # 2. fewest micro-batches per rank that LPT can fill, starting from the FFD count
    per_rank = max(1, -(-_ffd_bins(tokens, max_tokens) // num_ranks))
    while True:
        bins = _assign(items, tokens, costs, num_ranks, per_rank, max_tokens)
        if bins is not None:
            break
        per_rank += 1  # terminates: with one micro-batch per item everything fits

    # 3. materialise, deterministic order
    ranks = []
    num_empty = 0
    for r in range(num_ranks):
        mbs = []
        for ks in bins[r]:
            ks = sorted(ks, key=lambda k: (items[k][0], items[k][1]))
            entries = tuple(items[k] for k in ks)
            mbs.append(MicroBatch(
                entries=entries,
                prompt_lens=tuple(gs[g][0] for g, _ in entries),
                response_lens=tuple(tuple(gs[g][1][i] for i in idx) for g, idx in entries),
                num_tokens=sum(tokens[k] for k in ks),
                cost=sum(costs[k] for k in ks)))
            num_empty += not ks
        mbs.sort(key=lambda mb: (-mb.num_tokens, mb.entries))
        ranks.append(tuple(mbs))
    rank_tokens = tuple(sum(mb.num_tokens for mb in mbs) for mbs in ranks)
    rank_costs = tuple(sum(mb.cost for mb in mbs) for mbs in ranks)
    mean = sum(rank_costs) / num_ranks
    imbalance = (max(rank_costs) / mean - 1.0) if mean > 0 else 0.0
    return MicroBatchPlan(ranks=tuple(ranks), max_tokens=max_tokens, rank_tokens=rank_tokens,
                          rank_costs=rank_costs, imbalance=imbalance, num_empty=num_empty,
                          split_groups=tuple(split), prompt_tokens_added=added)
