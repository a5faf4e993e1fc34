"""Paged KV block allocation with prefix caching by chained block hashes.

Block 0 is reserved: padded graph rows and capture dummies write their KV there. A freed
block keeps its hash and stays findable until it is reused (LRU order), so a prompt prefix
seen before is not computed again. Blocks enter the cache only once their KV is written.

Block keys are SHA-256 digests chained over the parent's digest and the block's token ids (the
first block's parent is the request's `cache_salt` digest, if it names one), and
a hit is also checked against the tokens the block was registered with, so no crafted prompt
can make one request read another request's KV through a hash collision.

With the disk tier (docs/kv-cache.md) every newly registered block is also queued for the stages
to save as a page (`take_saves`), and a prompt's full blocks past its RAM hits are probed on disk
(`probe_disk`): blocks are booked for them, the stages read what pages they hold, and `loaded`
keeps the blocks every stage read (registered like computed ones) and gives back the rest.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from ..plan import KVPages
from ..request import Request

RESERVED_BLOCK = 0


def block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()


def salt_root(req: Request) -> bytes | None:
    """The parent digest of a request's first block: None, or its `cache_salt`'s (and LoRA adapter's)
    own digest, so requests with different salts or adapters never share a block, whatever their tokens."""
    salt, lora = req.params.cache_salt, req.lora_key or req.params.lora
    root = None if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    if lora is not None:    # a LoRA adapter changes every layer's KV: it roots a chain of its own
        root = hashlib.sha256(b"lora\0" + (root or b"") + lora.encode("utf-8", "surrogatepass")).digest()
    return root


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 disk_tier: bool = False):
        if num_blocks < 2:
            raise ValueError(f"The KV cache holds {num_blocks} blocks; it needs at least 2 — raise kv_cache_memory.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.hash_of: dict[int, bytes] = {}        # block -> digest (cached blocks)
        self.block_of: dict[bytes, int] = {}       # digest -> block
        self.key_of: dict[int, tuple] = {}         # block -> (parent digest, token ids) it was registered with
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0
        # the disk tier: probed tokens (RAM misses looked up on disk) and those read from it
        self.disk_tier = disk_tier and enable_prefix_caching
        self.pending_saves: list[tuple[int, bytes]] = []     # (block, digest) for the stages to save
        self.num_disk_queried_tokens = 0
        self.num_disk_hit_tokens = 0

    def fresh(self, num_blocks: int) -> "BlockManager":
        """A new, empty manager with these settings and counters (a rebuilt pipeline's empty cache)."""
        new = BlockManager(num_blocks, self.block_size, self.enable_prefix_caching, self.disk_tier)
        new.num_queried_tokens, new.num_hit_tokens = self.num_queried_tokens, self.num_hit_tokens
        new.num_disk_queried_tokens, new.num_disk_hit_tokens = self.num_disk_queried_tokens, self.num_disk_hit_tokens
        return new

    # capacity
    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(req.block_ids))

    # prefix cache
    def _block_key(self, req: Request, i: int, tokens: list[int]) -> tuple:
        """What block `i` of the request must hold to be shared: its parent's digest and its tokens."""
        bs = self.block_size
        return (req.block_hashes[i - 1] if i else salt_root(req), tuple(tokens[i * bs:(i + 1) * bs]))

    def _prefix_hashes(self, req: Request, num_full: int) -> list[bytes]:
        """Chained hashes of the request's first `num_full` blocks, extended incrementally
        (a request's tokens only grow, so earlier hashes never change)."""
        hashes, bs = req.block_hashes, self.block_size
        if len(hashes) < num_full:
            tokens = req.all_token_ids
            parent = hashes[-1] if hashes else salt_root(req)
            for i in range(len(hashes), num_full):
                parent = block_hash(parent, tuple(tokens[i * bs:(i + 1) * bs]))
                hashes.append(parent)
        return hashes[:num_full]

    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks for the longest known prefix; returns the cached token count.
        At least one prompt token is always left to compute (its logits start decoding)."""
        # NOTE: prompt logprobs need every prompt row's logits (and mean pooling every row's hidden
        # state), so such a request computes its prompt.
        if (not self.enable_prefix_caching or req.input_embeds is not None or req.block_ids
                or req.params.prompt_logprobs is not None or req.params.embed):
            return 0
        num_full = (req.num_tokens - 1) // self.block_size
        # NOTE: every token looked up counts, outputs too: a preempted request looks up its outputs
        # as well, and counting only its prompt let hits exceed queries
        self.num_queried_tokens += req.num_tokens
        tokens = req.all_token_ids
        for i, h in enumerate(self._prefix_hashes(req, num_full)):
            block = self.block_of.get(h)
            if block is None or self.key_of[block] != self._block_key(req, i, tokens):
                break
            self._ref(block)
            req.block_ids.append(block)
        cached = len(req.block_ids) * self.block_size
        self.num_hit_tokens += cached
        return cached

    def register_full_blocks(self, req: Request, num_written: int, save: bool = True) -> None:
        """Make the request's fully written blocks findable by later prompts (and, with the disk
        tier, queue them to be saved as pages unless `save` is False: they came from disk)."""
        # NOTE: an embedding request's blocks stay its own: they go back to the pool when it ends
        if not self.enable_prefix_caching or req.input_embeds is not None or req.params.embed:
            return
        num_full = min(num_written // self.block_size, len(req.block_ids))
        done = req.num_registered_blocks
        if num_full <= done:
            return
        req.num_registered_blocks = num_full
        hashes, tokens = self._prefix_hashes(req, num_full), req.all_token_ids
        for i in range(done, num_full):
            block, h = req.block_ids[i], hashes[i]
            if block not in self.hash_of and h not in self.block_of:
                self.hash_of[block] = h
                self.block_of[h] = block
                self.key_of[block] = self._block_key(req, i, tokens)
                if save and self.disk_tier:
                    self.pending_saves.append((block, h))

    # the disk tier
    def probe_disk(self, req: Request) -> KVPages | None:
        """Book blocks for the request's full blocks past its RAM hits, for the stages to read from
        their pages; None when there are none to look up (or the tier is off)."""
        if (not self.disk_tier or req.input_embeds is not None or req.params.prompt_logprobs is not None
                or req.params.embed):
            return None
        have = len(req.block_ids)
        want = min((req.num_tokens - 1) // self.block_size - have, len(self.free))
        if want <= 0:
            return None
        hashes = self._prefix_hashes(req, have + want)[have:]
        blocks = self.allocate(req, (have + want) * self.block_size)
        assert blocks is not None and len(blocks) == want, "the free blocks were counted"
        self.num_disk_queried_tokens += want * self.block_size
        return KVPages(blocks, [h.hex() for h in hashes])

    def loaded(self, req: Request, num_probed: int, num_read: int) -> int:
        """The stages read the first `num_read` of the request's `num_probed` probed blocks: keep and
        register those, give back the rest. Returns the tokens now cached."""
        keep = len(req.block_ids) - num_probed + num_read
        self.trim(req, keep * self.block_size)
        self.register_full_blocks(req, keep * self.block_size, save=False)
        self.num_disk_hit_tokens += num_read * self.block_size
        return keep * self.block_size

    def take_saves(self) -> KVPages | None:
        """The blocks the stages should save as pages before the next step runs (then forgotten here)."""
        if not self.pending_saves:
            return None
        saves = KVPages([b for b, _ in self.pending_saves], [h.hex() for _, h in self.pending_saves])
        self.pending_saves = []
        return saves

    def observe_tier(self, counters: list[list[int]]) -> None:
        """A stage whose tier could not open (counters[0] == 0) reads no pages: stop probing and saving."""
        if self.disk_tier and any(c and not c[0] for c in counters):
            self.disk_tier = False
            self.pending_saves = []

    # allocation
    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def allocate(self, req: Request, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens`; None (and no change) if blocks run out."""
        need = self.blocks_needed(req, num_tokens)
        if need > len(self.free):
            return None
        new = []
        for _ in range(need):
            block, _ = self.free.popitem(last=False)       # least recently freed first
            h = self.hash_of.pop(block, None)
            if h is not None:
                del self.block_of[h]
                del self.key_of[block]
            self.ref_counts[block] = 1
            new.append(block)
        req.block_ids.extend(new)
        return new

    def trim(self, req: Request, num_tokens: int) -> int | None:
        """Give back the request's blocks past those `num_tokens` need (blocks booked for drafts
        that were rejected); returns the blocks kept, or None if nothing was given back."""
        keep = -(-num_tokens // self.block_size)
        if len(req.block_ids) <= keep:
            return None
        for block in reversed(req.block_ids[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        del req.block_ids[keep:]
        req.num_registered_blocks = min(req.num_registered_blocks, keep)
        return keep

    def free_request(self, req: Request) -> None:
        # NOTE: free in reverse so a prompt's tail blocks are evicted before its head.
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        req.block_ids = []
        req.num_registered_blocks = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
