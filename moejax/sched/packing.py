"""Pack scoring sequences into rows of token trees (forests) for moejax.steps.phases.score.

Sequences (context + candidate tokens) that share a prefix share its tokens: they are inserted into a radix
trie, whose nodes are laid out in DFS preorder; each node spans [pre, post) over its subtree, which is all the
attention mask needs (moejax.models.attention.TreeMask). Tokens whose KV is in the prefix cache are not
recomputed: their cached blocks become prior keys. Every token whose next-token distribution is read is
recomputed, so its logits exist."""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import numpy as np

from moejax.buckets import bucket, fine_bucket, rows_bucket
from moejax.kernels.attention import blocked
from moejax.models.kv_pool import BLOCK
from moejax.sched.prefix_cache import PrefixCache, block_hashes

PAD_NODE = 1 << 30  # pad tokens form their own node: they see only each other
HIDDEN = (1 << 31) - 1  # a prior key nobody sees (unused slot, or a token supplied by another key)
MIN_ROW = 16


@dataclasses.dataclass(frozen=True)
class ScoreSeq:
    tokens: tuple[int, ...]
    context_len: int  # leading tokens that are the prompt (cacheable); the rest are candidate tokens
    context_tag: Hashable  # identifies the context, for usage accounting
    reads: tuple[tuple[int, int, Hashable], ...]  # (position, next token, tag): logprob of token after position


class _Node:
    __slots__ = ("tokens", "start", "children", "pre", "post")

    def __init__(self, tokens: list[int], start: int):
        self.tokens, self.start = tokens, start
        self.children: dict[int, _Node] = {}  # by first token
        self.pre = self.post = 0


def _insert(root: _Node, seq: Sequence[int]) -> None:
    node, i = root, 0
    while i < len(seq):
        child = node.children.get(seq[i])
        if child is None:
            node.children[seq[i]] = _Node(list(seq[i:]), i)
            return
        n = _lcp(child.tokens, seq[i: i + len(child.tokens)])
        if n < len(child.tokens):  # split: child keeps its first n tokens, the rest moves below it
            rest = _Node(child.tokens[n:], child.start + n)
            rest.children, child.children, child.tokens = child.children, {rest.tokens[0]: rest}, child.tokens[:n]
        node, i = child, i + n


def _chain(root: _Node, seq: Sequence[int]) -> tuple[list[_Node], list[int]]:
    """The nodes an inserted sequence runs through and the position each starts at (node.start)."""
    nodes: list[_Node] = []
    node, i = root, 0
    while i < len(seq):
        node = node.children[seq[i]]
        nodes.append(node)
        i += len(node.tokens)
    return nodes, [n.start for n in nodes]


def _at(chain: tuple[list[_Node], list[int]], pos: int) -> tuple[_Node, int]:
    """(node, offset) of the sequence's token at `pos`."""
    nodes, starts = chain
    node = nodes[bisect.bisect_right(starts, pos) - 1]
    return node, pos - node.start


def _number(root: _Node) -> list[_Node]:
    """DFS preorder list of nodes, with pre/post spans set."""
    order: list[_Node] = []
    stack = [(root, False)]
    while stack:
        node, closing = stack.pop()
        if closing:
            node.post = len(order)
            continue
        node.pre = len(order)
        order.append(node)
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(list(node.children.values())))
    return order


@dataclasses.dataclass
class Row:
    tokens: list[int]
    positions: list[int]
    pre: list[int]
    post: list[int]
    prior_slots: list[int]  # pool slots gathered as prior keys
    prior_pos: list[int]  # per prior key (BLOCK per slot)
    prior_pre: list[int]
    prior_post: list[int]
    reads: list[int]  # row index of each read token
    targets: list[tuple[int, int, Hashable]]  # (read index, token, tag)
    stores: list[tuple[int, list[tuple[str, int]]]]  # (slot, key of each token: ("prior"|"new", index))
    cached: dict  # context_tag -> context tokens taken from the prefix cache


def pack_row(seqs: Sequence[ScoreSeq], cache: PrefixCache | None = None,
             want_store: Callable[[bytes], bool] = lambda h: False) -> Row:
    root = _Node([], 0)
    for s in seqs:
        _insert(root, s.tokens)
    order = _number(root)[1:]  # drop the virtual root
    for node in order:
        node.pre -= 1
        node.post -= 1
    chains = [_chain(root, s.tokens) for s in seqs]
    # Where each token's KV comes from: ("prior", index) or ("new", index). Only tokens taken from the cache, and the
    # new ones of a node that has some, are listed; the others of a node are new, from new_base[id(node)] on.
    key_of: dict[tuple[int, int], tuple[str, int]] = {}
    new_base: dict[int, int] = {}
    must_compute = {(id(node), off) for s, c in zip(seqs, chains, strict=True)
                    for node, off in [_at(c, r[0]) for r in s.reads]}

    def key(node: _Node, off: int) -> tuple[str, int]:
        return key_of.get((id(node), off)) or ("new", new_base[id(node)] + off)

    row = Row([], [], [], [], [], [], [], [], [], [], [], {})
    # one entry per distinct context: (tag, chain, length)
    contexts: dict[tuple[int, ...], tuple[Hashable, tuple[list[_Node], list[int]], int]] = {}
    for s, c in zip(seqs, chains, strict=True):
        contexts.setdefault(s.tokens[: s.context_len], (s.context_tag, c, s.context_len))
    hashes = {ctx: block_hashes(ctx) for ctx in contexts}
    if cache is not None:  # prior keys: cached blocks, each token supplied once, read tokens recomputed
        for ctx, (_, chain, _) in contexts.items():
            for k, slot in enumerate(cache.match(hashes[ctx])):
                if slot in row.prior_slots:
                    continue
                used = False
                for t in range(BLOCK):
                    node, off = _at(chain, k * BLOCK + t)
                    tok = (id(node), off)
                    visible = tok not in key_of and tok not in must_compute
                    if visible:
                        key_of[tok] = ("prior", len(row.prior_pos))
                        used = True
                    row.prior_pos.append(node.start + off)
                    row.prior_pre.append(node.pre if visible else HIDDEN)
                    row.prior_post.append(node.post if visible else HIDDEN)
                if used:
                    row.prior_slots.append(slot)
                else:
                    del row.prior_pos[-BLOCK:], row.prior_pre[-BLOCK:], row.prior_post[-BLOCK:]
    partly_prior = {node_id for node_id, _ in key_of}
    for node in order:  # new tokens, DFS order
        n = len(node.tokens)
        if id(node) not in partly_prior:  # the whole node is new: one slice
            new_base[id(node)] = len(row.tokens)
            row.tokens.extend(node.tokens)
            row.positions.extend(range(node.start, node.start + n))
            row.pre.extend([node.pre] * n)
            row.post.extend([node.post] * n)
            continue
        for off, t in enumerate(node.tokens):
            if (id(node), off) not in key_of:
                key_of[(id(node), off)] = ("new", len(row.tokens))
                row.tokens.append(t)
                row.positions.append(node.start + off)
                row.pre.append(node.pre)
                row.post.append(node.post)
    read_index: dict[int, int] = {}
    for s, c in zip(seqs, chains, strict=True):
        for pos, token, tag in s.reads:
            r = key(*_at(c, pos))[1]
            u = read_index.setdefault(r, len(read_index))
            row.targets.append((u, token, tag))
    row.reads = list(read_index)
    for ctx, (tag, chain, length) in contexts.items():
        row.cached[tag] = sum(key(*_at(chain, pos))[0] == "prior" for pos in range(length)) if partly_prior else 0
        if cache is None:
            continue
        for k, h in enumerate(hashes[ctx]):
            if h not in cache and want_store(h):
                stored = cache.allocate(h)
                if stored is not None:
                    row.stores.append((stored, [key(*_at(chain, pos)) for pos in range(k * BLOCK, (k + 1) * BLOCK)]))
    return row


def tree_size(seqs: Sequence[ScoreSeq]) -> int:
    """Tokens of the trie of `seqs` (before any prefix-cache hit)."""
    ordered = sorted(s.tokens for s in seqs)
    return sum(len(b) - _lcp(a, b) for a, b in zip([()] + ordered[:-1], ordered, strict=True))


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences, compared a slice at a time (in C, not token by token
    in Python): slices of doubling length until one differs, then halving inside it."""
    n = min(len(a), len(b))
    if type(a) is not type(b):
        a, b = tuple(a[:n]), tuple(b[:n])
    lo, step = 0, 8
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, 2 * step
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TreeSpan(NamedTuple):
    """Static key ranges of a batch's blocked tree attention (moejax.models.attention.TreeMask): every new key a
    query sees is in the row's head [0, head) or within `window` keys before its query block's end."""
    head: int = 0
    window: int | None = None  # None: anywhere before the block's end (the causal triangle)


HEAD_QUANTUM = 64  # heads are rounded up to this, so prefixes of similar length share a compiled shape


def tree_span(rows: Sequence[Row], T: int, block: int = blocked.BLOCK) -> TreeSpan:
    """The cheapest span that holds every key any query of `rows` (padded to T) can see: with no head, or with a
    head covering the rows' common root node (a prefix every token of every row descends from)."""
    heads = {0}
    common = min(_root_tokens(r) for r in rows)
    if common:
        heads.add(min(T, -(-common // HEAD_QUANTUM) * HEAD_QUANTUM))
    best = None
    for head in sorted(heads):
        need = max(_reach(r, head, T, block) for r in rows)
        window = None if need >= T else -(-max(need, block) // block) * block
        cost = sum(hi - lo for _, _, ranges in blocked.tree_blocks(T, 0, head, window) for lo, hi in ranges)
        if best is None or cost < best[0]:
            best = cost, TreeSpan(head, window)
    assert best is not None  # heads holds 0 at least
    return best[1]


def _root_tokens(row: Row) -> int:
    """New tokens of the row's first node if every token of the row descends from it, else 0."""
    if not row.tokens or max(row.pre) >= row.post[0]:
        return 0
    return row.pre.count(row.pre[0])


def _reach(row: Row, head: int, T: int, block: int) -> int:
    """max over query blocks [qs, qe) of qe - (the lowest key >= head that a query of the block sees)."""
    pre, post = np.asarray(row.pre), np.asarray(row.post)
    if pre.size == 0:
        return 0
    ids, first = np.unique(pre, return_index=True)  # nodes (by DFS number) and their first row index
    last = pre.size - 1 - np.unique(pre[::-1], return_index=True)[1]
    ancestor = (ids[None, :] <= ids[:, None]) & (ids[:, None] < post[first][None, :])  # [node, ancestor-or-self]
    never = np.iinfo(np.int64).max
    reach = np.where(last >= head, np.maximum(first, head), never)  # the lowest key >= head of each node
    lowest = np.where(ancestor, reach[None, :], never).min(axis=1)
    per_token = lowest[np.searchsorted(ids, pre)]
    per_token[: min(head, pre.size)] = never  # queries inside the head see only the head
    need = 0
    for qs in range(0, min(pre.size, T), block):
        lo = per_token[qs: qs + block].min()
        if lo != never:
            need = max(need, min(qs + block, T) - int(lo))
    return need


def assemble(rows: Sequence[Row], pool_size: int = 0, row_multiple: int = 1
             ) -> tuple[dict[str, np.ndarray], list[list[Hashable]], TreeSpan]:
    """Rows -> (host arrays for moejax.steps.phases.score with bucketed shapes, target tags [row][g], TreeSpan); the row
    count is padded to a multiple of `row_multiple` (Engine.row_multiple)."""
    B = rows_bucket(len(rows), row_multiple)
    T = fine_bucket(max(len(r.tokens) for r in rows), MIN_ROW)
    U = bucket(max(len(r.reads) for r in rows), 8)
    G = bucket(max(len(r.targets) for r in rows), 8)
    NP = max(len(r.prior_slots) for r in rows)
    NS = max(len(r.stores) for r in rows)
    NP, NS = (bucket(NP) if NP else 0), (bucket(NS) if NS else 0)
    P = NP * BLOCK
    i32 = np.int32
    a = {"tokens": np.zeros((B, T), i32), "positions": np.zeros((B, T), i32),
         "q_pre": np.full((B, T), PAD_NODE, i32), "q_post": np.full((B, T), PAD_NODE + 1, i32),
         "read_idx": np.zeros((B, U), i32), "tgt_u": np.zeros((B, G), i32), "tgt_tok": np.zeros((B, G), i32)}
    if NP:
        a.update(prior_ids=np.zeros((B, NP), i32), prior_pos=np.zeros((B, P), i32),
                 prior_pre=np.full((B, P), HIDDEN, i32), prior_post=np.full((B, P), HIDDEN, i32))
    if NS:
        a.update(store_ids=np.full((B, NS), pool_size, i32), store_src=np.zeros((B, NS, BLOCK), i32))
    for b, r in enumerate(rows):
        n = len(r.tokens)
        a["tokens"][b, :n], a["positions"][b, :n] = r.tokens, r.positions
        a["q_pre"][b, :n], a["q_post"][b, :n] = r.pre, r.post
        a["read_idx"][b, : len(r.reads)] = r.reads
        if r.targets:
            u, tok, _ = zip(*r.targets, strict=True)
            a["tgt_u"][b, : len(u)], a["tgt_tok"][b, : len(tok)] = u, tok
        if r.prior_slots:
            m = len(r.prior_pos)
            a["prior_ids"][b, : len(r.prior_slots)] = r.prior_slots
            a["prior_pos"][b, :m], a["prior_pre"][b, :m], a["prior_post"][b, :m] = \
                r.prior_pos, r.prior_pre, r.prior_post
        for j, (slot, keys) in enumerate(r.stores):
            a["store_ids"][b, j] = slot
            a["store_src"][b, j] = [i if kind == "prior" else P + i for kind, i in keys]
    return a, [[tag for _, _, tag in r.targets] for r in rows], tree_span(rows, T)
