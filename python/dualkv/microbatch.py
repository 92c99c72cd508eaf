"""Group-aware micro-batching under a packed-token budget, balanced over data-parallel ranks.

A group (prompt P, responses R_1..R_N) costs P + sum R_i packed tokens. Groups are never split
unless one alone exceeds the budget; then it is split into response subsets (the fewest subsets
first-fit-decreasing finds). Each subset carries its own copy of the prompt, or, with
``prompt_once=True``, the prompt runs once: its first P - 1 tokens in a *prompt phase* whose keys
and values are kept (:mod:`dualkv.schedule`), and each subset carries only the last prompt token
(which predicts every response's first token) and attends to the kept keys and values. The plan is
made in three steps, each O(n log n) in the number of groups:

1. items: whole groups, or the response subsets of a group over the budget (and its prompt phase);
2. ranks: every group, with all its items, goes to one rank, longest-processing-time first on the
   balancing cost (packed tokens unless a cost function is given);
3. micro-batches: each rank packs its items first-fit decreasing under the budget (so one rank gets
   exactly as many micro-batches as first-fit decreasing), and every rank is padded with empty
   micro-batches to the largest count, so that collectives line up. With prompt phases, a rank's
   split prompts are packed first-fit decreasing into phases of at most ``max_prompt_tokens``; each
   phase's response subsets into micro-batches of their own (run while the phase's keys and values
   are kept), then the other items first-fit into those micro-batches or new ones after the last
   phase. Ranks are padded phase by phase (phases, and micro-batches per phase), so that every rank
   runs the same sequence of forwards and backwards.

Pure host code, deterministic.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["MicroBatch", "MicroBatchPlan", "PromptPhase", "plan_micro_batches"]

CostFn = Callable[[int, Sequence[int]], float]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: ``entries[k] = (group index, response indices)``, groups in ascending order."""

    entries: Tuple[Tuple[int, Tuple[int, ...]], ...]
    prompt_lens: Tuple[int, ...]  #: prompt length of every entry (input of Layout.from_groups)
    response_lens: Tuple[Tuple[int, ...], ...]  #: response lengths of every entry
    num_tokens: int  #: packed tokens: sum over entries of P + sum R_i (1 + sum R_i for an external entry)
    cost: float  #: the balancing cost (num_tokens by default)
    #: per entry: its prompt ran in the prompt phase ``phase`` (only its last token runs here, attending
    #: to the phase's kept keys and values); empty or all False without prompt phases
    external: Tuple[bool, ...] = ()
    phase: int = -1  #: the prompt phase (index into ``MicroBatchPlan.prompt_phases[rank]``) it runs in, or -1

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
class PromptPhase:
    """The prompts (all but their last token) of split groups, run once: their keys and values are
    kept while the micro-batches ``micro_batches`` (indices into the rank's list, consecutive) run."""

    groups: Tuple[int, ...]  #: the split groups, ascending (prefix e of the phase is groups[e]'s prompt)
    prompt_lens: Tuple[int, ...]  #: their full prompt lengths P
    micro_batches: Tuple[int, ...]  #: the rank's micro-batches that run while the phase is kept

    @property
    def num_tokens(self) -> int:
        """Tokens of the prompt phase's forward: sum of P - 1."""
        return sum(p - 1 for p in self.prompt_lens)


@dataclass(frozen=True)
class MicroBatchPlan:
    """``ranks[r]`` is the list of micro-batches of rank r; every rank has the same number."""

    ranks: Tuple[Tuple[MicroBatch, ...], ...]
    max_tokens: int
    rank_tokens: Tuple[int, ...]  #: packed tokens per rank (prompt phases included)
    rank_costs: Tuple[float, ...]  #: balancing cost per rank
    imbalance: float  #: max(rank cost) / mean(rank cost) - 1
    num_empty: int  #: empty micro-batches added so that every rank has the same count
    split_groups: Tuple[int, ...]  #: groups that exceeded the budget and were split
    #: tokens of a prompt run more than once because of splitting: P per extra copy, or with prompt
    #: phases 1 (the last prompt token) per micro-batch after the first
    prompt_tokens_added: int
    #: ``prompt_phases[r]``: rank r's prompt phases in run order (empty without ``prompt_once``); every
    #: rank has the same number, and the same number of micro-batches in its j-th phase
    prompt_phases: Tuple[Tuple[PromptPhase, ...], ...] = ()
    #: token-equivalents one kept prompt token costs against its phase's micro-batches (the plan's
    #: ``prompt_state_factor``; 0: the kept state is not budgeted)
    prompt_state_factor: float = 0.0

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
        phases = self.prompt_phases[0] if self.prompt_phases else ()
        lines = [f"{self.num_ranks} rank(s) x {self.micro_batches_per_rank} micro-batch(es), budget "
                 f"{self.max_tokens} tokens, {self.total_tokens} packed tokens, imbalance "
                 f"{100 * self.imbalance:.2f}%, {self.num_empty} empty micro-batch(es), "
                 f"{len(self.split_groups)} split group(s) (+{self.prompt_tokens_added} prompt tokens)"
                 + (f", {len(phases)} prompt phase(s) per rank" if phases else "")]
        for r, mbs in enumerate(self.ranks):
            sizes = ", ".join(str(mb.num_tokens) for mb in mbs)
            lines.append(f"  rank {r}: {self.rank_tokens[r]} tokens [{sizes}]")
            for j, ph in enumerate(self.prompt_phases[r] if self.prompt_phases else ()):
                lines.append(f"    prompt phase {j}: groups {list(ph.groups)}, {ph.num_tokens} tokens, "
                             f"micro-batches {list(ph.micro_batches)}")
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

    def preload(self, loads: Sequence[int]) -> None:
        """Open the first ``len(loads)`` bins holding ``loads`` (before any ``add``)."""
        for b, load in enumerate(loads):
            i = self.size + b
            self.room[i] -= load
            i //= 2
            while i:
                self.room[i] = max(self.room[2 * i], self.room[2 * i + 1])
                i //= 2
        self.num_bins = max(self.num_bins, len(loads))

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


def _first_fit_decreasing(sizes: Sequence[int], capacity: int, loads: Sequence[int] = ()) -> List[List[int]]:
    """Indices of ``sizes`` per bin, first-fit decreasing (ties by index); every size <= capacity.
    ``loads``: bins already open (holding that much) before the new ones; they come first in the
    result, possibly empty."""
    bins: List[List[int]] = [[] for _ in loads]
    packer = _FirstFit(capacity, len(loads) + len(sizes))
    packer.preload(loads)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = packer.add(sizes[i])
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
    return bins


def _split_group(g: int, p: int, rs: List[int], max_tokens: int) -> List[Tuple[int, ...]]:
    """Response subsets of one group, each fitting with ``p`` prompt tokens: first-fit decreasing."""
    longest = max(range(len(rs)), key=lambda i: (rs[i], -i))
    if p + rs[longest] > max_tokens:
        raise ValueError(f"plan_micro_batches: group {g} cannot fit: prompt ({p}) + response {longest} "
                         f"({rs[longest]}) = {p + rs[longest]} tokens > max_tokens={max_tokens}")
    return [tuple(sorted(b)) for b in _first_fit_decreasing(rs, max_tokens - p)]


def _balanced(pieces: List[Tuple[int, ...]], rs: List[int], capacity: int) -> List[Tuple[int, ...]]:
    """The responses of ``pieces`` (first-fit decreasing subsets of one group) spread over as many
    subsets as evenly as they go: longest first, each to the least-loaded subset with room (ties to
    the first); ``pieces`` itself where that fails. First-fit leaves a short last subset (16 x 1K
    into 15 + 1), and a response micro-batch that small runs at the host's speed (its ~0.2 s of
    Python, autograd and launches, measured on the H200 at 1.7B, exceeds its GPU time), while an
    even split keeps every micro-batch's GPU time above it."""
    n = len(pieces)
    if n < 2:
        return pieces
    loads, bins = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(rs)), key=lambda i: (-rs[i], i)):
        b = min((b for b in range(n) if loads[b] + rs[i] <= capacity), key=lambda b: (loads[b], b), default=None)
        if b is None:
            return pieces
        loads[b] += rs[i]
        bins[b].append(i)
    return [tuple(sorted(b)) for b in bins]


def _sorted_micro_batches(mbs: List[MicroBatch]) -> List[MicroBatch]:
    """Largest first, so that the micro-batches run in lockstep by the ranks (FSDP, SP collectives)
    have similar sizes."""
    return sorted(mbs, key=lambda mb: (-mb.num_tokens, mb.entries))


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
                       cost_fn: Optional[CostFn] = None, prompt_once: bool = False,
                       max_prompt_tokens: Optional[int] = None, prompt_state_factor: float = 0.0,
                       prompt_state_credit: float = 0.0) -> MicroBatchPlan:
    """Plan micro-batches of whole groups under ``max_tokens`` packed tokens, over ``num_ranks`` ranks.

    ``groups``: ``[(prompt_len, [response_len, ...]), ...]`` (or objects with ``.prompt_len`` and
    ``.response_lens``; :meth:`dualkv.PackedBatch.groups` returns this format). ``cost_fn(P, [R_i])``
    optionally replaces packed tokens as the quantity balanced over ranks (e.g. to weight attention
    FLOPs; a prompt phase costs ``cost_fn(P - 1, [])``); the budget is always in tokens.

    ``prompt_once``: a group over the budget runs its prompt once, in a prompt phase
    (:class:`PromptPhase`, at most ``max_prompt_tokens`` prompt tokens, default ``max_tokens``, which
    bounds the state a phase keeps), and its response subsets carry only the last prompt token;
    :func:`dualkv.schedule.micro_batches` runs such a plan. Without it each subset carries a copy
    of the prompt.

    ``prompt_state_factor`` (with ``prompt_once``): what a prompt phase keeps through its
    micro-batches (keys, values, their gradient sums), in micro-batch tokens per prompt token
    (:func:`dualkv.schedule.prompt_state_factor` derives it from the model): a phase of S prompt
    tokens leaves its micro-batches ``max_tokens - ceil(factor * S)`` tokens, so that the kept
    state plus a micro-batch's activations stay within what one micro-batch of ``max_tokens``
    tokens holds (the split path's peak). Each such group then has a phase of its own (two prompts
    in one phase would shrink both groups' micro-batches), and a group whose prompt state leaves
    no room for its longest response is split with its prompt copied instead, as without
    ``prompt_once``. 0 (default): the kept state is not budgeted. ``prompt_state_credit`` (tokens,
    with a factor: :func:`dualkv.schedule.prompt_state_credit`, the parameter gradients' bytes in
    micro-batch tokens): a group whose responses fit in one micro-batch with the last prompt token
    runs them in one, unbudgeted, when its state is at most the credit plus the tokens that
    micro-batch leaves free: the split path's second micro-batch holds every parameter gradient,
    which a once phase of one micro-batch never does while its activations live.

    Raises ValueError if a group's prompt plus one of its responses exceeds ``max_tokens`` (with
    ``prompt_once``: if one response plus one token does, or the prompt exceeds ``max_prompt_tokens``).
    """
    plan = _plan(groups, max_tokens, num_ranks, cost_fn, prompt_once, max_prompt_tokens, prompt_state_factor,
                 prompt_state_credit, balance=False)
    if prompt_once and plan.prompt_phases and any(plan.prompt_phases):
        # the response subsets of a prompt-once group spread evenly (_balanced) where that costs no
        # micro-batch (fuller subsets leave less room for other groups)
        even = _plan(groups, max_tokens, num_ranks, cost_fn, prompt_once, max_prompt_tokens, prompt_state_factor,
                     prompt_state_credit, balance=True)
        if even.micro_batches_per_rank <= plan.micro_batches_per_rank:
            return even
    return plan


def _plan(groups, max_tokens, num_ranks, cost_fn, prompt_once, max_prompt_tokens, prompt_state_factor,
          prompt_state_credit, balance: bool) -> MicroBatchPlan:
    """plan_micro_batches; ``balance``: a prompt-once group's response subsets spread evenly."""
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
    if max_prompt_tokens is None:
        max_prompt_tokens = max_tokens
    elif isinstance(max_prompt_tokens, bool) or not hasattr(max_prompt_tokens, "__index__") or max_prompt_tokens < 1:
        raise ValueError(f"plan_micro_batches: max_prompt_tokens must be an int >= 1, got {max_prompt_tokens!r}")
    max_prompt_tokens = int(max_prompt_tokens)
    if isinstance(prompt_state_factor, bool) or not isinstance(prompt_state_factor, (int, float)) \
            or not (0.0 <= float(prompt_state_factor) < float("inf")):
        raise ValueError(f"plan_micro_batches: prompt_state_factor must be a finite number >= 0, got "
                         f"{prompt_state_factor!r}")
    factor = float(prompt_state_factor)
    if isinstance(prompt_state_credit, bool) or not isinstance(prompt_state_credit, (int, float)) \
            or not (0.0 <= float(prompt_state_credit) < float("inf")):
        raise ValueError(f"plan_micro_batches: prompt_state_credit must be a finite number >= 0, got "
                         f"{prompt_state_credit!r}")
    credit = float(prompt_state_credit)
    single = set()  # budgeted groups whose phase runs one response micro-batch, on the credit

    def state_tokens(prompt_tokens: int) -> int:
        """Budget tokens a phase of ``prompt_tokens`` kept prompt tokens takes from each of its
        micro-batches."""
        return math.ceil(factor * prompt_tokens) if factor > 0 else 0
    gs = _normalise(groups)
    if not gs:
        raise ValueError("plan_micro_batches: no groups")

    # 1. items: whole groups, or response subsets of groups over the budget (each with its prompt,
    #    or with prompt_once its last prompt token, the rest of the prompt in a prompt phase)
    items: List[Tuple[int, Tuple[int, ...]]] = []
    external: List[bool] = []
    group_items: List[List[int]] = []
    split: List[int] = []
    phased: List[int] = []  # groups whose prompt runs in a prompt phase
    added = 0
    for g, (p, rs) in enumerate(gs):
        first = len(items)
        if p + sum(rs) <= max_tokens:
            items.append((g, tuple(range(len(rs)))))
            external.append(False)
        else:
            once = prompt_once and p > 1
            if once and p - 1 > max_prompt_tokens:
                raise ValueError(f"plan_micro_batches: group {g}: its prompt phase ({p - 1} tokens) exceeds "
                                 f"max_prompt_tokens={max_prompt_tokens}")
            room = max_tokens - state_tokens(p - 1) if once else max_tokens
            if once and factor > 0 and 1 + sum(rs) <= max_tokens \
                    and state_tokens(p - 1) <= credit + max_tokens - (1 + sum(rs)):
                # one response micro-batch: no micro-batch of the phase runs with every parameter
                # gradient alive (the split path's second one does), so that credit pays for the state
                room = max_tokens
                single.add(g)
            elif once and factor > 0 and 1 + max(rs) > room:
                once, room = False, max_tokens  # its kept prompt would outgrow a split micro-batch
            pieces = _split_group(g, 1 if once else p, rs, room)
            if once and balance:  # the split path's subsets stay first-fit (today's path, the baseline)
                pieces = _balanced(pieces, rs, room - 1)
            split.append(g)
            if once:
                phased.append(g)
            added += (1 if once else p) * (len(pieces) - 1)
            items.extend((g, piece) for piece in pieces)
            external.extend([once] * len(pieces))
        group_items.append(list(range(first, len(items))))
    tokens = [(1 if ext else gs[g][0]) + sum(gs[g][1][i] for i in idx) for (g, idx), ext in zip(items, external)]
    phase_cost = {g: float(gs[g][0] - 1) for g in phased}
    if cost_fn is None:
        costs = [float(t) for t in tokens]
    else:
        def checked(c, g):
            c = float(c)
            if not (c >= 0.0) or c == float("inf"):
                raise ValueError(f"plan_micro_batches: cost_fn returned {c} for group {g}; need a finite cost >= 0")
            return c
        costs = [checked(cost_fn(gs[g][0], [gs[g][1][i] for i in idx]), g) for g, idx in items]
        phase_cost = {g: checked(cost_fn(gs[g][0] - 1, []), g) for g in phased}

    # 2. ranks: every group (all pieces of a split one, and its prompt phase) on one rank, by cost
    group_costs = [sum(costs[k] for k in ks) + phase_cost.get(g, 0.0) for g, ks in enumerate(group_items)]
    rank_groups = [sorted(gs_r) for gs_r in _balance_groups(group_costs, num_ranks)]

    # 3. micro-batches of each rank (and its prompt phases); then every rank is padded to the same
    #    counts
    def micro_batch(ks: List[int], phase: int) -> MicroBatch:
        # items are numbered in (group, piece) order, and two pieces of one group never share a
        # micro-batch (the second would have fitted into the first), so this sorts entries by group
        ks = sorted(ks)
        entries = tuple(items[k] for k in ks)
        return MicroBatch(entries=entries, prompt_lens=tuple(gs[g][0] for g, _ in entries),
                          response_lens=tuple(tuple(gs[g][1][i] for i in idx) for g, idx in entries),
                          num_tokens=sum(tokens[k] for k in ks), cost=sum(costs[k] for k in ks),
                          external=tuple(external[k] for k in ks), phase=phase if ks else -1)

    # per rank: [phase groups], [micro-batch items of each phase], [trailing micro-batch items]
    layouts = []
    phased_set = set(phased)
    for gs_r in rank_groups:
        ph_groups = [g for g in gs_r if g in phased_set]
        if factor > 0:  # a phase per group, largest prompt first (the order FFD gives)
            phases = [[g] for g in sorted(ph_groups, key=lambda g: (-gs[g][0], g))]
        else:
            phases = [[ph_groups[i] for i in b]
                      for b in _first_fit_decreasing([gs[g][0] - 1 for g in ph_groups], max_prompt_tokens)]
        phases = [sorted(b) for b in phases]
        bins: List[List[int]] = []  # item lists; the first ones belong to phases
        phase_of_bin: List[int] = []
        loads: List[int] = []  # budget tokens each bin uses: its tokens and its phase's kept state
        for j, groups_j in enumerate(phases):
            ks = [k for g in groups_j for k in group_items[g]]
            credited = factor > 0 and all(g in single for g in groups_j)
            state = 0 if credited else state_tokens(sum(gs[g][0] - 1 for g in groups_j))
            for b in _first_fit_decreasing([tokens[k] for k in ks], max_tokens - state):
                bins.append([ks[i] for i in b])
                phase_of_bin.append(j)
                # a credited micro-batch takes nothing more: the credit was for its group alone
                loads.append(max_tokens if credited else state + sum(tokens[k] for k in bins[-1]))
        rest = [k for g in gs_r if g not in phased_set for k in group_items[g]]
        for i, b in enumerate(_first_fit_decreasing([tokens[k] for k in rest], max_tokens, loads)):
            if i >= len(bins):
                bins.append([])
                phase_of_bin.append(-1)
            bins[i].extend(rest[x] for x in b)
        per_phase: List[List[List[int]]] = [[] for _ in phases]
        trailing: List[List[int]] = []
        for b, j in zip(bins, phase_of_bin):
            (per_phase[j] if j >= 0 else trailing).append(b)
        layouts.append((phases, per_phase, trailing))

    num_phases = max(len(ph) for ph, _, _ in layouts)
    per_phase_count = [max((len(pp[j]) if j < len(pp) else 0) for _, pp, _ in layouts) for j in range(num_phases)]
    trailing_count = max(len(t) for _, _, t in layouts)
    if num_phases == 0:
        trailing_count = max(1, trailing_count)
    ranks, rank_phases = [], []
    num_empty = 0
    for phases, per_phase, trailing in layouts:
        mbs: List[MicroBatch] = []
        ph_out = []
        for j in range(num_phases):
            bins_j = per_phase[j] if j < len(per_phase) else []
            num_empty += per_phase_count[j] - len(bins_j)
            run = _sorted_micro_batches([micro_batch(b, j) for b in bins_j])
            run += [micro_batch([], j)] * (per_phase_count[j] - len(bins_j))
            groups_j = phases[j] if j < len(phases) else []
            ph_out.append(PromptPhase(groups=tuple(groups_j), prompt_lens=tuple(gs[g][0] for g in groups_j),
                                      micro_batches=tuple(range(len(mbs), len(mbs) + len(run)))))
            mbs.extend(run)
        num_empty += trailing_count - len(trailing)
        mbs.extend(_sorted_micro_batches([micro_batch(b, -1) for b in trailing]))
        mbs.extend([micro_batch([], -1)] * (trailing_count - len(trailing)))
        ranks.append(tuple(mbs))
        rank_phases.append(tuple(ph_out))
    rank_tokens = tuple(sum(mb.num_tokens for mb in mbs) + sum(ph.num_tokens for ph in phs)
                        for mbs, phs in zip(ranks, rank_phases))
    rank_costs = tuple(sum(mb.cost for mb in mbs) + sum(phase_cost[g] for ph in phs for g in ph.groups)
                       for mbs, phs in zip(ranks, rank_phases))
    mean = sum(rank_costs) / num_ranks
    imbalance = (max(rank_costs) / mean - 1.0) if mean > 0 else 0.0
    return MicroBatchPlan(ranks=tuple(ranks), max_tokens=max_tokens, rank_tokens=rank_tokens,
                          rank_costs=rank_costs, imbalance=imbalance, num_empty=num_empty,
                          split_groups=tuple(split), prompt_tokens_added=added,
                          prompt_phases=tuple(rank_phases) if prompt_once else (),
                          prompt_state_factor=factor if prompt_once else 0.0)
