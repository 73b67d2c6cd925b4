"""Prefix caching (serving/engine/prefix_cache.py, the scheduler's extend path): chained block keys scoped by model
and consumer, the last token always computed, LRU eviction within the budget tail first, and the scheduler's answers
with the cache equal to those without it, on the hand-made cache model of test_generation. Fast."""
import numpy as np
from test_engine import drive, jobs
from test_generation import EOS, PAD, REQUESTS, ScriptedCache, history_logits

from serving.engine.prefix_cache import PrefixCache
from serving.engine.scheduler import Job, Scheduler
from serving.protocol import GenerationSettings


def blocks(ids, block=4):
    """Keys/values [1 layer, 1 head, n, 1] of blocks first..stop-1 that hold the ids themselves (as ScriptedCache's
    caches do)."""
    array = np.asarray(ids, "float32")[None, None, :, None]
    return lambda first, stop: (array[:, :, first * block:stop * block].copy(),) * 2


def insert(cache, ids, consumer=""):
    return cache.insert(cache.chain(ids, consumer), blocks(ids, cache.block))


def lookup(cache, ids, consumer=""):
    return cache.lookup(ids, cache.chain(ids, consumer))


def test_a_prefix_is_found_in_whole_blocks_behind_the_same_whole_prefix_and_scope():
    cache = PrefixCache(1 << 20, block=4, scope="model-1")
    ids = list(range(10, 20))  # (10 tokens: blocks [0,4) and [4,8) whole)
    assert insert(cache, ids) == 2
    n, keys, values = lookup(cache, ids + [7, 7])
    assert n == 8 and keys[0, 0, :, 0].tolist() == ids[:8] and values.shape == (1, 1, 8, 1)
    assert lookup(cache, ids[:8])[0] == 4  # (its last token is computed: only the first block is used)
    assert lookup(cache, ids[:4] + [99] + ids[5:])[0] == 4  # (the second block behind another first token's block)
    assert lookup(cache, [99] + ids[1:])[0] == 0
    assert lookup(cache, ids, consumer="b")[0] == 0  # (another consumer's)
    assert PrefixCache(1 << 20, block=4, scope="model-2").chain(ids) != cache.chain(ids)  # (another model's)
    assert cache.queried == 12 + 8 + 10 + 10 + 10 and cache.hits == 8 + 4 + 4
    assert insert(cache, ids) == 0  # (held already)
    assert cache.chain(ids + [1, 2], known=cache.chain(ids[:5])) == cache.chain(ids + [1, 2])


def test_the_budget_holds_and_a_chain_loses_its_tail_before_its_head():
    one = 2 * 4 * 4  # bytes of a block of 4 tokens (keys + values, float32)
    cache = PrefixCache(3 * one, block=4)
    a = list(range(100, 112))  # three blocks
    insert(cache, a)
    assert len(cache) == 3 and cache.bytes == 3 * one
    b = list(range(200, 208))
    insert(cache, b)
    assert cache.bytes <= 3 * one and cache.evictions == 2
    assert lookup(cache, a + [1])[0] == 4  # (a's head kept, its tail gone first)
    assert lookup(cache, b + [1])[0] == 8
    for start in range(0, 4000, 8):  # (many distinct prompts: never over the budget)
        ids = list(range(start + 1000, start + 1008))
        insert(cache, ids)
        assert cache.bytes <= 3 * one
    assert cache.bytes == 3 * one and len(cache) == 3


class ScriptedExtend(ScriptedCache):
    """ScriptedCache with the extend program: the new tokens over a past that holds the cached ids."""

    def __init__(self):
        super().__init__()
        self.extended = []  # (new tokens, past width) of each call

    def extend(self, ids, positions, mask, past_keys, past_values):
        past = past_keys.shape[3]
        self.extended.append((ids.shape[1], past))
        logits, keys = [], np.where(mask[:, past:] == 1, ids, -1).astype("float32")[None, :, None, :, None]
        for b in range(len(ids)):
            history = [int(k) for k, m in zip(past_keys[0, b, 0, :, 0], mask[b, :past]) if m == 1]
            assert np.array_equal(past_keys[0, b], past_values[0, b])
            real = mask[b, past:] == 1
            assert positions[b][real].tolist() == list(range(len(history), len(history) + int(real.sum())))
            logits.append(history_logits(history + [int(i) for i in ids[b][real]]))
        return np.stack(logits), keys, keys


def scheduler(cache, prefix_mb=1, block=2, **options):
    return Scheduler(cache.prefill, cache.decode, EOS, [PAD], usable_vocab=10, max_length=64, pad_id=PAD,
                     extend=cache.extend, prefix_cache=PrefixCache(prefix_mb << 20, block) if prefix_mb else None,
                     **options)


SHARED = [4, 5, 6, 7, 8, 9, 4, 5]  # (a "system prompt" of 8 tokens: 4 blocks of 2)


def test_answers_with_the_prefix_cache_equal_those_without_it_and_count_what_was_cached():
    requests = [(SHARED + list(p), s) for p, s in REQUESTS] + REQUESTS
    off = drive(scheduler(ScriptedExtend(), prefix_mb=0), {0: jobs(requests)})
    cache = ScriptedExtend()
    s = scheduler(cache)
    # the first wave fills the cache; the second (its prompts and the first's prompt + answer + more) hits it
    first = drive(s, {0: jobs(requests[:3])})
    answer = first[0][1]
    turn = SHARED + list(REQUESTS[0][0]) + answer + [6, 7]
    later = [Job(10 + i, list(p), st) for i, (p, st) in enumerate(requests[3:])]
    conversation = Job(99, turn, GenerationSettings(max_new_tokens=5))
    done = drive(s, {0: later, 2: [conversation]})
    got = {**first, **done}
    assert {i: got[i][1] for i in range(3)} == {i: off[i][1] for i in range(3)}
    assert {i: got[10 + i - 3][1] for i in range(3, len(requests))} == {i: off[i][1] for i in range(3, len(requests))}
    alone = drive(scheduler(ScriptedExtend(), prefix_mb=0), {0: [Job(0, turn, GenerationSettings(max_new_tokens=5))]})
    assert got[99][1] == alone[0][1]
    # (SHARED found; the bare prompts, never seen, prefilled in the same extend call over masked past columns)
    assert [job.cached for job in later] == [8, 8, 0, 0, 0, 0, 0]
    fed = len(SHARED) + 1 + len(answer) - 1  # (the prompt and the answer's fed tokens, in whole blocks)
    assert conversation.cached == fed // 2 * 2 and any(past >= fed // 2 * 2 for _, past in cache.extended)


def test_without_an_extend_program_or_a_budget_nothing_is_cached():
    cache = ScriptedExtend()
    s = Scheduler(cache.prefill, cache.decode, EOS, [PAD], usable_vocab=10, max_length=64, pad_id=PAD,
                  extend=None, prefix_cache=PrefixCache(1 << 20, 2))
    drive(s, {0: jobs([(SHARED + [4], GenerationSettings(max_new_tokens=2))] * 2)})
    assert s.prefix is None and not cache.extended
