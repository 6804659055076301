"""A lent request's borrowed prefix stays host-locked until the request is gone (issue 44).

Under ``--hot-set-prefix host`` a running request borrows the radix tree's host copies of
its matched prefix (``RequestPages.lend_prefix``; the tree node host-locked, ``PrefixHold``)
and, once it reads none of the tree's device pages, gives up its device lock, so the tree
may evict the prefix's device pages. Issue 44: a finishing request gave the host lock back
before the rest of ``release_with_pages`` ran; when the device could not take its released
pages back, the host insert copied its resident pages out, the full host pool made room
with ``evict_host``, which freed the now unlocked prefix node's host slots, still the
request's borrowed copies; the insert then handed them to the tree again and a later
eviction freed them twice (SGLang: "Double-free detected").

SGLang's real pieces on torch_cpu, in an interpreter with the plugin's hooks (``support.hooked``)
under ``SGLANG_PLATFORM=torch_cpu`` and with the host-slot ledger on (the suite's checks,
``env.CHECKS_ENV``): a ``UnifiedRadixCache`` (the ``importance`` policy's
Python core) with HiCache attached by ``init_hicache`` (the plugin's ``TorchMHAHostPool``,
SGLang's ``HybridCacheController``), the paged allocator over an ``MHATokenToKVPool``, a
``ReqToTokenPool`` and SGLang's ``Req``. The scheduler's hooks run as the scheduler calls
them: admission through ``checkpoint_kv_cache``, each decode step's ``admit_grown``
(``hold_prefixes``: lend, then drop the device lock) and the release through
``release_kv_cache``; the test plays the decoder, releasing pages its plan leaves out
(``RequestPages.release``). The ledger fails the first move of a slot by someone not
holding it, naming both. A retracted request (the same release, unfinished, no checkpoint)
enters the tree host-only, as a finished one the device cannot take back does.

The ledger is shown to fire (the servers' tests rely on its message being absent from their
logs): issue 44's early host unlock, made on purpose, and a pool's free of a request's own host
slots, then of slots already free, each raise ``HostSlotError`` naming the mover and the holder.
"""

from __future__ import annotations

import pytest
import torch

from sgl_importance.env import CHECKS_ENV, PLATFORM_ENV
from sgl_importance.hot_set.pages.host_ledger import HostSlotError, HostSlotLedger
from support.hooked import Hooked

_SCRIPT = r"""
import json, traceback
from array import array
from types import SimpleNamespace

import torch
import msgspec
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sgl_importance import runtime
from sgl_importance.config import ImportanceConfig
from sgl_importance.hot_set.pages.state import PageMoves, RequestMoves
from sgl_importance.scheduler import hot_set_release

P, LAYERS, DEVICE_TOKENS = 4, 2, 40
PREFIX = array("q", range(100, 108))  # 2 pages an earlier request left in the tree
PROMPT = PREFIX + array("q", range(300, 312))  # R's: the prefix, then 3 pages of its own
OUTPUT = array("q", range(500, 505))  # the prefill's token, then 4 decode steps: 24 tokens of KV, 6 pages


class World:
    # One scheduler's worth of SGLang's pools and tree, built as create_unified_radix_cache
    # and the scheduler's hooks build them, on a host pool of host_pages pages.
    def __init__(self, host_pages):
        config = ImportanceConfig(hot_set_policy="importance", hot_set_threshold=8, hot_set_prefix="host")
        self.override = get_context().override_server_args(
            page_size=P, device="cpu", radix_eviction_policy="importance",
            enable_hierarchical_cache=True, hicache_write_policy="write_through",
            hicache_mem_layout="layer_first", hicache_io_backend="direct",
            # SGLang sizes the host pool as int(ratio x device tokens) rounded down to
            # pages, plus one page.
            hicache_ratio=((host_pages - 1) * P + P / 2) / DEVICE_TOKENS,
            _importance=config,
        )
        server_args = self.override.install()
        # --attention-backend importance_torch, as a launch names it (the override drops it;
        # the runtime refuses a hot set without one of the plugin's decode backends).
        msgspec.Struct.__setattr__(server_args, "attention_backend", "importance_torch")
        self.rt = runtime.start(None, server_args)  # as before Scheduler.__init__
        self.kv = MHATokenToKVPool(DEVICE_TOKENS, page_size=P, dtype=torch.float32, head_num=1, head_dim=8,
                                   layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        self.alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, page_size=P, dtype=torch.float32, device="cpu",
                                                 kvcache=self.kv, need_sort=False)
        self.r2t = ReqToTokenPool(size=2, max_context_len=32, device="cpu", enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                                 page_size=P, eviction_policy="importance", tree_components=(ComponentType.FULL,))
        self.cache = UnifiedRadixCache(params)
        self.cache.init_hicache(server_args, params)
        # After Scheduler.__init__: release on, its pools (and ledger) over this cache.
        hot_set_release.enable(self.rt.residency, self.rt.hot_set_params, self.rt.config,
                               SimpleNamespace(tree_cache=self.cache))
        self.releases = self.rt.residency
        self.pools = self.releases.pools
        self.host = self.pools.host_pool
        assert type(self.host).__name__ == "TorchMHAHostPool", type(self.host)
        assert self.pools.ledger is not None and self.host.ledger is self.pools.ledger, "the ledger is off"
        assert self.host.size == host_pages * P, self.host.size
        assert self.releases.prefix_on_host and self.releases.host_insert
        self.start = {"device": self.alloc.available_size(), "host": self.host.available_size()}
        for layer in range(LAYERS):
            self.kv.k_buffer[layer].normal_()
            self.kv.v_buffer[layer].normal_()
        self.other = None  # device slots another request holds

    def cache_prefix(self):
        # An earlier request's prompt, inserted; its write-through lands on the host.
        slots = self.alloc.alloc(len(PREFIX)).to(torch.int64)
        self.prefix_kv = [(self.kv.k_buffer[i][slots].clone(), self.kv.v_buffer[i][slots].clone())
                          for i in range(LAYERS)]
        self.cache.insert(InsertParams(key=RadixKey(PREFIX), value=slots))
        self.cache.check_hicache_events()

    def prefill(self):
        # R matches the prefix, locks it and prefills its own 3 pages; a long prompt, so
        # the checkpoint admits it to release instead of inserting it.
        req = Req("R", "", PROMPT[:], SamplingParams(max_new_tokens=len(OUTPUT)))
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(PROMPT)))
        assert match.device_prefix_len == len(PREFIX), match
        self.node = match.last_device_node
        req.lock = self.cache.lock(self.node)
        self.r2t.alloc([req])
        self.row = self.r2t.req_to_token[req.kv.req_pool_idx]
        self.row[: len(PREFIX)] = self.cache.path_device_indices(self.node).to(self.row.dtype)
        own = len(PROMPT) - len(PREFIX)
        self.row[len(PREFIX) : len(PROMPT)] = self.alloc.alloc(own).to(self.row.dtype)
        req.kv.cache_protected_len = len(PREFIX)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(PROMPT)
        req.refresh_fill_ids()
        req.extend_end = len(PROMPT)
        common.checkpoint_kv_cache(req, self.cache)
        assert self.releases.admitted("R")
        req.output_ids.append(OUTPUT[0])  # the prefill's token
        self.req, self.batch = req, SimpleNamespace(reqs=[req], tree_cache=self.cache)

    def decode_step(self, unplanned=()):
        # The step writes the KV of the last token (a new page when it starts one): the
        # scheduler's hook after prepare_for_decode, then the decoder's moves.
        req = self.req
        pos = len(PROMPT) + len(req.output_ids) - 1
        if pos % P == 0:
            self.row[pos : pos + P] = self.alloc.alloc(P).to(self.row.dtype)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
        req.output_ids.append(OUTPUT[len(req.output_ids)])
        hot_set_release.admit_grown(self.releases, self.batch)
        self.pages = self.releases.peek("R")
        if unplanned:
            self.releases.apply(PageMoves([RequestMoves("R", release=torch.tensor(unplanned))]))

    def lend(self, drop_device_lock=True):
        self.prefill()
        self.decode_step(unplanned=[2, 3])  # two of R's own pages leave the device
        self.decode_step(unplanned=[0, 1])  # lent: the prefix pages it plans no more
        assert self.pages.hold is not None and self.pages.lent_pages == 2
        if drop_device_lock:
            self.decode_step()
            self.decode_step()  # the step after: R gives up its device lock
            assert self.pages.hold.unlocked and self.req.lock is None
            assert len(self.req.output_ids) == len(OUTPUT) and self.req.kv.kv_committed_len == 24

    def fill_device(self):
        # Another request takes every device page, the prefix's unlocked ones included.
        self.other = self.alloc.alloc(self.alloc.available_size())
        common.evict_from_tree_cache(self.cache, len(PREFIX))
        self.other = torch.cat([self.other, self.alloc.alloc(len(PREFIX))])
        assert self.cache.tree_core.is_full_device_evicted(self.node)
        assert self.alloc.available_size() == 0

    def leave(self, reason, checkpoint, out):
        self.req.finished_reason = reason
        out["held_before"] = self.pools.ledger.held_by_requests()
        common.release_kv_cache(self.req, self.cache, checkpoint=checkpoint)
        out["counts"] = {k: v for k, v in vars(self.releases.counts).items() if v}

    def prefix_host_kv_intact(self):
        try:
            node = self.cache.tree_core.node_by_id(self.node)
        except KeyError:
            return False  # host-evicted: gone from the tree
        host = node.component_data[ComponentType.FULL].host_value
        copies = [self.pools.host_layer(i, host.to(torch.int64)) for i in range(LAYERS)]
        return all(torch.equal(hk, k) and torch.equal(hv, v) for (hk, hv), (k, v) in zip(copies, self.prefix_kv))

    def host_match(self, tokens):
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        return {"device": match.device_prefix_len, "host": match.host_hit_length}

    def empty(self):
        # The other request leaves; the tree evicts everything, slot by slot, then the
        # flush empties the host pool at once (the ledger: no request may hold a slot).
        if self.other is not None:
            self.alloc.free(self.other)
        self.cache.evict(EvictParams(num_tokens=DEVICE_TOKENS))
        self.cache.evict_host(self.host.size)
        out = {"start": self.start, "free": {"device": self.alloc.available_size(), "host": self.host.available_size()}}
        out["held_by_requests"] = self.pools.ledger.held_by_requests()
        out["tree_protected"] = self.cache.protected_size()
        self.cache.reset()
        return out

    def close(self):
        self.override.restore()
        runtime.reset()


def scenario(host_pages, run):
    # What it observed up to the first error (the ledger's, SGLang's), and that error.
    world, out = World(host_pages), {}
    try:
        world.cache_prefix()
        run(world, out)
        out["empty"] = world.empty()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        world.close()
    return out


def finish(world, out):
    world.lend()
    world.fill_device()
    world.leave(FINISH_LENGTH(length=len(OUTPUT)), checkpoint=True, out=out)
    out["prefix_host_kv_intact"] = world.prefix_host_kv_intact()
    out["next_turn"] = world.host_match(PROMPT + OUTPUT)


def abort(drop_device_lock):
    def run(world, out):
        world.lend(drop_device_lock)
        if drop_device_lock:
            world.fill_device()
        else:
            # A promotion of a lent page: a device copy of R's own, from the borrowed host copy.
            world.releases.apply(PageMoves([RequestMoves("R", promote=torch.tensor([0]))]))
            assert 0 not in world.pages.released_pages().tolist()
        world.leave(FINISH_ABORT(), checkpoint=False, out=out)
        out["prefix_host_kv_intact"] = world.prefix_host_kv_intact()
        out["tree_match"] = world.host_match(PREFIX)
    return run


def retract(world, out):
    # SGLang's retract_decode: release_kv_cache without a checkpoint, the request unfinished
    # (it is prefilled again later from its prompt and what it generated).
    world.lend()
    world.leave(None, checkpoint=False, out=out)
    out["prefix_host_kv_intact"] = world.prefix_host_kv_intact()
    out["resume"] = world.host_match(PROMPT + OUTPUT)


def returning(world, out):
    # The prefix's device pages evicted: a returning turn matches its history on the host only,
    # borrows it there (scheduler/returning.py: the host part as prefix, the node host-locked,
    # the row's history showing the released slot, the record lent it) and finishes after one
    # decode step, its hold still taking the history over: its own pages go in host-only, under
    # the history's node.
    from sgl_importance.hot_set.pages.state import RELEASED_SLOT
    from sgl_importance.hot_set.pages.prefix_hold import HistoryLoan
    from sgl_importance.scheduler.returning import lend_history, settle

    world.cache.evict(EvictParams(num_tokens=len(PREFIX)))
    req = Req("R", "", PROMPT[:], SamplingParams(max_new_tokens=len(OUTPUT)))
    match = world.cache.match_prefix(MatchPrefixParams(key=RadixKey(PROMPT)))
    assert match.device_prefix_len == 0 and match.host_hit_length == len(PREFIX), match
    node = match.best_match_node
    req.lock = world.cache.lock(match.last_device_node)  # as SGLang locks the device part (the root here)
    host = hot_set_release.path_host_slots(world.cache, node)
    receipt = world.cache.inc_host_lock_ref(node).to_dec_params()
    req.prefix_len = len(PREFIX)
    settle(world.rt, req, world.cache, HistoryLoan(node, receipt, host, 0, len(PREFIX)), admitted=True)
    world.r2t.alloc([req])
    world.row = world.r2t.req_to_token[req.kv.req_pool_idx]
    world.row[: len(PREFIX)] = RELEASED_SLOT
    world.row[len(PREFIX) : len(PROMPT)] = world.alloc.alloc(len(PROMPT) - len(PREFIX)).to(world.row.dtype)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = len(PROMPT)
    req.refresh_fill_ids()
    req.extend_end = len(PROMPT)
    world.req, world.batch = req, SimpleNamespace(reqs=[req], tree_cache=world.cache, req_to_token_pool=world.r2t)
    lend_history(world.rt, world.batch)  # after prepare_for_extend
    common.checkpoint_kv_cache(req, world.cache)
    req.output_ids.append(OUTPUT[0])
    world.decode_step()
    assert world.pages.hold.history_unheld
    world.leave(FINISH_LENGTH(length=2), checkpoint=True, out=out)
    out["next_turn"] = world.host_match(PROMPT + OUTPUT[:2])


def early_host_unlock(world, out):
    # Issue 44 brought back (a mutant): R gives the prefix's host lock back while it still
    # borrows the copies, and the full host pool's eviction frees them under it.
    world.lend()
    hold = world.pages.hold
    world.cache.dec_host_lock_ref(hold.node, hold.host_receipt)
    world.fill_device()
    world.cache.evict_host(world.host.size)


def own_slots_freed(world, out):
    # A free of the pool's (the tree's, HiCache's) of host slots R took for its own released
    # pages, then the same slots freed again (a mutant of any of them).
    world.lend()
    own = world.pages.host_slots(torch.nonzero(world.pages.own_host()).flatten())
    out["own_slots"] = own.numel()
    try:
        world.host.free(own)
    except Exception as exc:
        out["first"] = f"{type(exc).__name__}: {exc}"
    world.pools.ledger.release(own, "R")  # as if R had freed them itself
    world.host.free(own)
    world.host.free(own)


# 4 host pages: the prefix's 2 and R's 2 released ones fill it. 6: room for R's last 2.
print("RESULT " + json.dumps({
    "finish_history_on_host": scenario(6, returning),
    "early_host_unlock": scenario(4, early_host_unlock),
    "own_slots_freed": scenario(4, own_slots_freed),
    "finish_host_full": scenario(4, finish),
    "finish_host_room": scenario(6, finish),
    "abort_prefix_on_host": scenario(4, abort(drop_device_lock=True)),
    "abort_prefix_locked_on_device": scenario(4, abort(drop_device_lock=False)),
    "retract_host_room": scenario(6, retract),
}))
"""


@pytest.fixture(scope="module")
def result() -> dict:
    # Its own interpreter: the platform hook (TorchMHAHostPool) is applied only under
    # SGLANG_PLATFORM=torch_cpu, as in a server; the ledger switch is read in that process.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PLATFORM_ENV, "torch_cpu")
        env.setenv(CHECKS_ENV, "1")
        interpreter = Hooked()
    try:
        return interpreter.run(_SCRIPT).result
    finally:
        interpreter.close()


def ran(outcome: dict) -> dict:
    """The scenario's observations, once it ran to its end without an error."""
    assert "error" not in outcome, outcome["error"]
    return outcome


def test_a_finished_request_the_device_cannot_take_back_never_frees_its_borrowed_prefix(result):
    # Host pool full: the host insert's copy-out must not take the borrowed prefix's room.
    finished = ran(result["finish_host_full"])
    assert finished["counts"]["promotions_refused"] == 4  # the device had no room
    assert finished["counts"]["finished_uncached"] == 1
    assert finished["prefix_host_kv_intact"], "the prefix's host copies were overwritten"
    assert finished["next_turn"] == {"device": 0, "host": 8}  # the prefix, still on the host


def test_with_host_room_it_enters_the_tree_on_the_host_behind_its_prefix(result):
    finished = ran(result["finish_host_room"])
    assert finished["counts"]["finished_on_host"] == 1
    assert finished["prefix_host_kv_intact"]
    assert finished["next_turn"] == {"device": 0, "host": 24}  # all 6 pages, on the host


def test_a_returning_turn_that_finishes_holding_its_history_enters_the_tree_on_the_host_after_it(result):
    # Its row never showed a device page of its history: its own pages go in host-only, under
    # the history's host node, so the next turn matches them too (it was left out of the tree).
    finished = ran(result["finish_history_on_host"])
    assert finished["counts"]["finished_on_host"] == 1 and "finished_uncached" not in finished["counts"]
    assert finished["next_turn"] == {"device": 0, "host": len_prompt_pages() * 4}


def len_prompt_pages() -> int:
    return (8 + 12) // 4  # the history's 2 pages and its own 3 (the first decode token's page is partial)


@pytest.mark.parametrize("state", ["abort_prefix_on_host", "abort_prefix_locked_on_device"])
def test_an_aborted_lent_request_inserts_nothing_and_leaves_the_prefix_to_the_tree(result, state):
    aborted = ran(result[state])
    assert not {"finished_on_host", "finished_uncached", "finished_reinserted"} & aborted["counts"].keys()
    assert aborted["prefix_host_kv_intact"]
    # On the host only once R had given up its device lock and the tree evicted the pages.
    on_device = 8 if state == "abort_prefix_locked_on_device" else 0
    assert aborted["tree_match"] == {"device": on_device, "host": 8 - on_device}


def test_a_retracted_request_enters_the_tree_on_the_host_so_its_prefill_again_loads_it_back(result):
    retracted = ran(result["retract_host_room"])
    assert retracted["counts"]["retracted_to_host"] == 1
    assert not {"finished_on_host", "finished_uncached", "finished_reinserted"} & retracted["counts"].keys()
    assert retracted["prefix_host_kv_intact"]
    # All 6 pages of its KV match: the prefix still on the device (unlocked, not evicted), its
    # own 4 on the host (without this, its own pages were dropped: a match of 8).
    assert retracted["resume"] == {"device": 8, "host": 16}


def test_the_ledger_stops_the_tree_freeing_a_prefix_a_request_borrows(result):
    """The check the soak and streamed-prefill servers rely on (a log free of "host slot
    ledger") fires: issue 44's early host unlock, made on purpose, raises at the tree's free."""
    error = result["early_host_unlock"]["error"]
    assert error.startswith("HostSlotError: host slot ledger: a free of the tree's"), error
    assert "while request R borrows them" in error.splitlines()[0]


def test_the_ledger_names_who_frees_a_requests_host_slots_and_a_slot_freed_twice(result):
    outcome = result["own_slots_freed"]
    assert outcome["own_slots"] == 2 * 4  # R's 2 released pages' own host copies
    assert outcome["first"].startswith("HostSlotError: host slot ledger: a free of the tree's")
    assert "held by request R (expected the tree)" in outcome["first"]
    # Freed once by the pool, the second free finds them free.
    assert outcome["error"].startswith("HostSlotError: host slot ledger: a free of the tree's")
    assert "held by free (expected the tree)" in outcome["error"].splitlines()[0]


@pytest.mark.parametrize(
    "state",
    [
        "finish_history_on_host",
        "finish_host_full",
        "finish_host_room",
        "abort_prefix_on_host",
        "abort_prefix_locked_on_device",
        "retract_host_room",
    ],
)
def test_every_device_and_host_slot_comes_back_once_the_tree_is_emptied(result, state):
    outcome = ran(result[state])
    assert outcome["held_before"] > 0  # R held host slots while it ran
    empty = outcome["empty"]
    assert empty["held_by_requests"] == 0
    assert empty["tree_protected"] == 0
    # Catches issue 44 without the ledger too: a slot twice in one host node passes
    # SGLang's double-free check when the node is freed, and the pool counts it free twice.
    assert empty["free"] == empty["start"]


def test_every_move_by_someone_not_holding_the_slots_raises_naming_both():
    """The ledger's table, move by move (the rows a server run cannot easily reach)."""
    ledger = HostSlotLedger(8)
    a, b = torch.arange(0, 4), torch.arange(4, 8)
    with pytest.raises(HostSlotError, match="request R took 4 slots .* held by free"):
        ledger.take(a, "R")  # not allocated first
    ledger.allocated(a)
    ledger.take(a, "R")
    with pytest.raises(HostSlotError, match="request S gave the tree 4 slots .* held by request R"):
        ledger.give(a, "S")
    with pytest.raises(HostSlotError, match="the pool was cleared while request R held 4 slots"):
        ledger.cleared()
    ledger.allocated(b)
    ledger.borrow(b, "S")
    with pytest.raises(HostSlotError, match="request S borrowed a prefix twice"):
        ledger.borrow(b, "S")
    with pytest.raises(HostSlotError, match="request T borrowed 4 slots .* held by request R, not the tree"):
        ledger.borrow(a, "T")
    assert ledger.held_by_requests() == 8
    ledger.unborrow("S")
    ledger.release(a, "R")
    ledger.freed(torch.cat([a, b]))
    assert ledger.held_by_requests() == 0
    ledger.cleared()
