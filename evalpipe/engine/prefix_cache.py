"""The prefix cache: an index of full pages by the exact tokens before and in them, with LRU eviction.

A page is cached under the key (parent node, its P tokens); the parent node is the cached page before it (or the
root), so a key names the whole token prefix up to the page's end and a lookup compares tokens, never a hash alone.
Node ids are never reused, so a key whose parent was evicted can no longer be reached from the root (it ages out of
the LRU). Only full pages whose tokens are final are indexed: every entry of the page is complete and its tail
(cache.py) holds the rings' rows at the page's end, so a hit of k pages restores the exact state at k * P.

Reference counts live in StatePools.page_refs: a cached page that no sequence holds is *parked* in the LRU (oldest
first out); `evict` takes pages from there when `reserve` runs short. A sequence releases its pages last to first,
so its deepest pages are evicted before the shared prefix they hang from.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from evalpipe.engine.cache import StatePools

ROOT = 0


@dataclass
class Node:
    id: int
    page: int
    key: tuple


class PrefixCache:
    def __init__(self, pools: StatePools):
        if not pools.prefix_tails:
            raise ValueError("the prefix cache needs pools built with prefix_tails=True")
        self.pools = pools
        pools.cache = self
        self.page_tokens = pools.page_tokens
        self._ids = itertools.count(ROOT + 1)
        self._by_key: dict[tuple, Node] = {}
        self._by_page: dict[int, Node] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()
        self.stats = {"lookups": 0, "hits": 0, "hit_tokens": 0, "inserted_pages": 0, "evicted_pages": 0, "flushes": 0}

    # ---- lookup and insertion --------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> tuple[list[int], int]:
        """(pages, last node id) of the longest cached chain of full pages covering at most `limit` tokens."""
        P = self.page_tokens
        pages, parent = [], ROOT
        for i in range(max(0, limit) // P):
            node = self._by_key.get((parent, tuple(tokens[i * P : (i + 1) * P])))
            if node is None:
                break
            pages.append(node.page)
            parent = node.id
        self.stats["lookups"] += 1
        if pages:
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += len(pages) * P
            for page in pages:
                if page in self._parked:
                    self._parked.move_to_end(page)  # recently used
        return pages, parent

    def insert(self, tokens: list[int], pages: list[int], start: int, parent: int) -> tuple[int, int]:
        """Index the full pages `start..` of a sequence (`tokens` final over those pages). Continues the chain at
        node `parent` (the node of page start-1); returns (pages walked, last node id) to resume from. A page whose
        key is already indexed (another sequence computed the same tokens) stays private to its sequence."""
        P = self.page_tokens
        i = start
        while (i + 1) * P <= len(tokens) and i < len(pages):
            key = (parent, tuple(tokens[i * P : (i + 1) * P]))
            node = self._by_key.get(key)
            if node is None and pages[i] not in self._by_page:
                node = Node(next(self._ids), pages[i], key)
                self._by_key[key] = node
                self._by_page[pages[i]] = node
                self.stats["inserted_pages"] += 1
            elif node is None:  # cannot happen for a consistent chain; stop rather than alias a page
                break
            parent = node.id
            i += 1
        return i, parent

    # ---- page life cycle (called by StatePools) --------------------------------------------------------------
    def holds(self, page: int) -> bool:
        return page in self._by_page

    def park(self, page: int) -> None:
        self._parked[page] = None

    def unpark(self, page: int) -> None:
        self._parked.pop(page, None)

    @property
    def evictable(self) -> int:
        return len(self._parked)

    def evict(self, count: int) -> int:
        """Drop up to `count` least recently used idle pages from the index and free them."""
        done = 0
        while done < count and self._parked:
            page, _ = self._parked.popitem(last=False)
            self._forget(page)
            self.pools.release_page(page)
            done += 1
        self.stats["evicted_pages"] += done
        return done

    def flush(self) -> int:
        """Forget every cached page: idle ones are freed, held ones stay their sequences' (freed on release)."""
        count = len(self._by_page)
        for page in list(self._by_page):
            self._forget(page)
        while self._parked:
            page, _ = self._parked.popitem(last=False)
            self.pools.release_page(page)
        self.stats["flushes"] += 1
        return count

    def _forget(self, page: int) -> None:
        node = self._by_page.pop(page)
        del self._by_key[node.key]

    def describe(self) -> dict:
        return {
            "enabled": True,
            "page_tokens": self.page_tokens,
            "cached_pages": len(self._by_page),
            "idle_pages": len(self._parked),
            **self.stats,
        }
