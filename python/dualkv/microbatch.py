"""Group-aware micro-batching under a packed-token budget, balanced over data-parallel ranks.

A group (prompt P, responses R_1..R_N) costs P + sum R_i packed tokens. Groups are never split
unless one alone exceeds the budget; then it is split into response subsets, each carrying its own
copy of the prompt (the fewest subsets first-fit-decreasing finds). The plan is made in three
steps, each O(n log n) in the number of groups:

1. items: whole groups, or the response subsets of a group over the budget (the step where another
   way of cutting a large group, e.g. running its prompt once, plugs in);
2. ranks: every group, with all its items, goes to one rank, longest-processing-time first on the
   balancing cost (packed tokens unless a cost function is given);
3. micro-batches: each rank packs its items first-fit decreasing under the budget (so one rank gets
   exactly as many micro-batches as first-fit decreasing), and every rank is padded with empty
   micro-batches to the largest count, so that collectives line up.

Pure host code, deterministic.
"""

from __future__ import annotations

import heapq
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

    @property
    def response_tokens(self) -> int:
        """Response tokens (the tokens a token-mean loss averages over)."""
        return sum(sum(r) for r in self.response_lens)

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

    @property
    def response_tokens(self) -> int:
        """Response tokens over all ranks: the denominator of a global token-mean loss."""
        return sum(mb.response_tokens for mbs in self.ranks for mb in mbs)

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


class _FirstFit:
    """First-fit bin packing in O(log n) per item: a max tree over the free room of the bins.

    Leaves are bins, in opening order; a bin not opened yet has the whole capacity free, so the
    leftmost leaf with enough room is exactly the bin first-fit picks (an open one, or the next new
    one). ``capacity`` bounds every item; ``max_items`` bounds the number of bins.
    """

    def __init__(self, capacity: int, max_items: int):
        self.size = 1 << max(0, (max_items - 1).bit_length())
        self.room = [capacity] * (2 * self.size)
        self.num_bins = 0

    def add(self, need: int) -> int:
        """Put an item of ``need`` (<= capacity) into the first bin with room; returns the bin."""
        room, i = self.room, 1
        while i < self.size:
            i = 2 * i if room[2 * i] >= need else 2 * i + 1
        b = i - self.size
        room[i] -= need
        i //= 2
        while i:
            room[i] = max(room[2 * i], room[2 * i + 1])
            i //= 2
        self.num_bins = max(self.num_bins, b + 1)
        return b


def _first_fit_decreasing(sizes: Sequence[int], capacity: int) -> List[List[int]]:
    """Indices of ``sizes`` per bin, first-fit decreasing (ties by index); every size <= capacity."""
    bins: List[List[int]] = []
    packer = _FirstFit(capacity, len(sizes))
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = packer.add(sizes[i])
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
    return bins


def _split_group(g: int, p: int, rs: List[int], max_tokens: int) -> List[Tuple[int, ...]]:
    """Response subsets of one group, each fitting with its prompt: first-fit decreasing."""
    longest = max(range(len(rs)), key=lambda i: (rs[i], -i))
    if p + rs[longest] > max_tokens:
        raise ValueError(f"plan_micro_batches: group {g} cannot fit: prompt ({p}) + response {longest} "
                         f"({rs[longest]}) = {p + rs[longest]} tokens > max_tokens={max_tokens}")
    return [tuple(sorted(b)) for b in _first_fit_decreasing(rs, max_tokens - p)]


def _balance_groups(costs: Sequence[float], num_ranks: int) -> List[List[int]]:
    """Groups per rank: longest-processing-time first (largest cost to the least-loaded rank, ties
    by index), O(n log n) with a heap."""
    heap = [(0.0, r) for r in range(num_ranks)]
    ranks: List[List[int]] = [[] for _ in range(num_ranks)]
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        load, r = heapq.heappop(heap)
        ranks[r].append(g)
        heapq.heappush(heap, (load + costs[g], r))
    return ranks


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

    # 1. items: whole groups, or response subsets of groups over the budget (each with its prompt)
    items: List[Tuple[int, Tuple[int, ...]]] = []
    group_items: List[List[int]] = []
    split: List[int] = []
    added = 0
    for g, (p, rs) in enumerate(gs):
        first = len(items)
        if p + sum(rs) <= max_tokens:
            items.append((g, tuple(range(len(rs)))))
        else:
            pieces = _split_group(g, p, rs, max_tokens)
            split.append(g)
            added += p * (len(pieces) - 1)
            items.extend((g, piece) for piece in pieces)
        group_items.append(list(range(first, len(items))))
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

    # 2. ranks: every group (all pieces of a split one) on one rank, balanced by cost
    group_costs = [sum(costs[k] for k in ks) for ks in group_items]
    rank_items = [[k for g in sorted(gs_r) for k in group_items[g]]
                  for gs_r in _balance_groups(group_costs, num_ranks)]

    # 3. micro-batches of each rank: first-fit decreasing under the budget; then every rank is
    #    padded with empty micro-batches to the largest count
    rank_bins = [[[ks[i] for i in b] for b in _first_fit_decreasing([tokens[k] for k in ks], max_tokens)]
                 for ks in rank_items]
    per_rank = max(1, max(len(bins) for bins in rank_bins))
    ranks = []
    num_empty = 0
    for bins in rank_bins:
        num_empty += per_rank - len(bins)
        mbs = []
        for ks in bins + [[] for _ in range(per_rank - len(bins))]:
            # items are numbered in (group, piece) order, and two pieces of one group never share
            # a micro-batch (the second would have fitted into the first), so this sorts entries
            # by group
            entries = tuple(items[k] for k in sorted(ks))
            mbs.append(MicroBatch(
                entries=entries,
                prompt_lens=tuple(gs[g][0] for g, _ in entries),
                response_lens=tuple(tuple(gs[g][1][i] for i in idx) for g, idx in entries),
                num_tokens=sum(tokens[k] for k in ks),
                cost=sum(costs[k] for k in ks)))
        # largest first on every rank, so that the micro-batches run in lockstep (FSDP, SP
        # collectives) have similar sizes
        mbs.sort(key=lambda mb: (-mb.num_tokens, mb.entries))
        ranks.append(tuple(mbs))
    rank_tokens = tuple(sum(mb.num_tokens for mb in mbs) for mbs in ranks)
    rank_costs = tuple(sum(mb.cost for mb in mbs) for mbs in ranks)
    mean = sum(rank_costs) / num_ranks
    imbalance = (max(rank_costs) / mean - 1.0) if mean > 0 else 0.0
    return MicroBatchPlan(ranks=tuple(ranks), max_tokens=max_tokens, rank_tokens=rank_tokens,
                          rank_costs=rank_costs, imbalance=imbalance, num_empty=num_empty,
                          split_groups=tuple(split), prompt_tokens_added=added)
