"""Generation as pure logic (fast): the smoke test compares served output with `generate`
itself, so `generate`'s own behaviour is pinned here against a hand-made model."""
import numpy as np

from serving.protocol import GenerationSettings
from serving.engine.generation import generate, generate_batch

VOCAB = 12  # ids 0..9 usable, 10..11 padding rows of the embedding
EOS, PAD = 3, 0


def scripted(next_token: dict[int, int], calls: list | None = None):
    """A model whose logits favour next_token[last id] (else id 9), with padding rows scoring highest of all."""
    def forward(ids):
        if calls is not None:
            calls.append(ids.copy())
        logits = np.zeros((1, ids.shape[1], VOCAB), dtype="float32")
        logits[0, -1, 10:] = 100.0  # padding rows must never be chosen
        logits[0, -1, PAD] = 50.0   # nor banned ids
        logits[0, -1, next_token.get(int(ids[0, -1]), 9)] = 10.0
        return logits
    return forward


def run(forward, prompt, max_length=64, **settings):
    return generate(forward, prompt, GenerationSettings(**settings), EOS, [PAD], usable_vocab=10,
                    max_length=max_length)


def test_greedy_follows_the_model_and_skips_padding_and_banned_ids():
    calls = []
    assert run(scripted({5: 6, 6: 7, 7: 8}, calls), [4, 5], max_new_tokens=4) == [6, 7, 8, 9]
    # each step feeds the whole sequence so far (no KV cache)
    assert [c.tolist() for c in calls] == [[[4, 5]], [[4, 5, 6]], [[4, 5, 6, 7]], [[4, 5, 6, 7, 8]]]


def test_stops_after_the_end_token_and_at_the_maximum_length():
    assert run(scripted({5: 6, 6: EOS}), [5], max_new_tokens=10) == [6, EOS]
    assert run(scripted({}), [5, 5, 5], max_new_tokens=10, max_length=5) == [9, 9]
    assert run(scripted({}), [5] * 5, max_new_tokens=10, max_length=5) == []


def test_sampling_depends_on_seed_and_top_k_limits_the_choices():
    def flat(ids):  # every usable token equally likely
        logits = np.zeros((1, ids.shape[1], VOCAB), dtype="float32")
        logits[0, -1, 10:] = -1e9
        return logits

    def sample(seed, top_k=0):
        return run(flat, [5], max_new_tokens=20, temperature=1.0, top_k=top_k, seed=seed)

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    assert PAD not in sample(1) + sample(2)
    def mild(ids):  # token 7 slightly ahead: plain sampling often picks another token, top_k=1 never does
        logits = flat(ids)
        logits[0, -1, 7] = 1.0
        return logits

    assert {run(mild, [5], max_new_tokens=1, temperature=1.0, top_k=1, seed=s)[0] for s in range(20)} == {7}
    assert len({run(mild, [5], max_new_tokens=1, temperature=1.0, seed=s)[0] for s in range(20)}) > 1


# ---------------------------------------------------------------------------------------------------------------------
# The key/value-cache path over a scripted cached model: it must produce what the full-sequence path produces, for
# every request, alone or in a batch of mixed prompt lengths and settings.

def history_logits(history):
    """Logits that depend on the whole (real) history: any pad leaking into it, or a lost token, changes them."""
    logits = np.zeros(VOCAB, dtype="float32")
    logits[10:] = 100.0
    logits[PAD] = 50.0
    logits[(sum(history) + len(history)) % 7 + 3] = 10.0  # ids 3 (EOS) .. 9
    logits[4] = 9.5  # runner-up, so that sampling has a choice
    return logits


def full_forward(ids):
    out = np.zeros((1, ids.shape[1], VOCAB), dtype="float32")
    out[0, -1] = history_logits([int(i) for i in ids[0]])
    return out


class ScriptedCache:
    """prefill/decode over caches that hold the token ids; checks the positions and masks it is given."""

    def __init__(self):
        self.decode_batches, self.buffers = [], set()

    def prefill(self, ids, positions, mask):
        for b in range(len(ids)):
            real = mask[b] == 1
            assert positions[b][real].tolist() == list(range(int(real.sum())))
            assert (ids[b][~real] == PAD).all() and not real[: int((~real).sum())].any()  # left padding
        keys = np.where(mask == 1, ids, -1).astype("float32")[None, :, None, :, None]
        return np.stack([history_logits([int(i) for i in ids[b][mask[b] == 1]]) for b in range(len(ids))]), keys, keys

    def decode(self, ids, cache):
        """As the decode programs do: the buffers and the widened mask in, the new token's column out."""
        self.decode_batches.append(len(ids))
        self.buffers.add(cache.step_inputs()[1].ctypes.data)  # (the key buffer fed: a new one is a whole-cache copy)
        positions, keys, values, mask = cache.step_inputs()
        keys = np.concatenate([keys, ids.astype("float32")[None, :, None, :, None]], axis=3)
        assert mask.shape == keys.shape[1:4:2] and keys.shape == values.shape[:3] + (keys.shape[3], 1)
        logits = []
        for b in range(len(ids)):
            history = [int(k) for k, m in zip(keys[0, b, 0, :, 0], mask[b]) if m == 1]
            assert positions[b, 0] == len(history) - 1
            logits.append(history_logits(history))
        column = ids.astype("float32")[None, :, None, :, None]
        cache.append(column, column)
        return np.stack(logits)


def batch(prompts, settings, max_length=64, cache=None):
    cache = cache or ScriptedCache()
    return generate_batch(cache.prefill, cache.decode, prompts, settings, EOS, [PAD], usable_vocab=10,
                          max_length=max_length)


REQUESTS = [([4], GenerationSettings(max_new_tokens=6)),
            ([5, 6, 7, 8, 9], GenerationSettings(max_new_tokens=3)),
            ([9, 9], GenerationSettings(max_new_tokens=12)),
            ([7, 4, 5], GenerationSettings(max_new_tokens=8, temperature=1.0, seed=11)),
            ([6] * 9, GenerationSettings(max_new_tokens=8, temperature=0.7, top_k=2, seed=3))]


def test_cached_path_equals_the_full_sequence_path_alone_and_batched():
    alone = [batch([p], [s])[0] for p, s in REQUESTS]
    assert alone == [generate(full_forward, p, s, EOS, [PAD], usable_vocab=10, max_length=64) for p, s in REQUESTS]
    assert any(EOS in out for out in alone) and any(len(out) > 3 for out in alone)  # the cases mean something
    assert batch([p for p, _ in REQUESTS], [s for _, s in REQUESTS]) == alone
    reordered = list(reversed(REQUESTS))
    assert batch([p for p, _ in reordered], [s for _, s in reordered]) == alone[::-1]


def test_finished_requests_leave_the_batch_and_limits_hold():
    cache = ScriptedCache()
    prompts = [[4], [5, 6], [9, 9, 9]]
    settings = [GenerationSettings(max_new_tokens=n) for n in (1, 4, 7)]
    out = batch(prompts, settings, cache=cache)
    assert [len(o) <= n for o, n in zip(out, (1, 4, 7))] == [True] * 3 and len(out[0]) == 1
    assert cache.decode_batches == sorted(cache.decode_batches, reverse=True) and cache.decode_batches[0] <= 2
    # the model's maximum length bounds prompt + new tokens; a full prompt gets nothing and is not run at all
    assert batch([[5] * 6, [5] * 8], [GenerationSettings(max_new_tokens=10)] * 2, max_length=8) == \
        [generate(full_forward, [5] * 6, GenerationSettings(max_new_tokens=10), EOS, [PAD], 10, 8), []]
    assert batch([[5] * 8], [GenerationSettings()], max_length=8) == [[]]


def test_choosing_for_a_batch_equals_choosing_row_by_row():
    from serving.engine.generation import choose, choose_rows

    logits = np.random.default_rng(0).normal(size=(6, VOCAB)).astype("float32")
    settings = [GenerationSettings(), GenerationSettings(temperature=1.0, seed=3),
                GenerationSettings(temperature=0.7, top_k=3, seed=4), GenerationSettings(temperature=2.0, seed=5),
                GenerationSettings(), GenerationSettings(temperature=0.5, top_k=1, seed=6)]
    for _ in range(5):  # (several draws: the generators advance identically)
        rows = [np.random.default_rng(s.seed) for s in settings]
        alone = [np.random.default_rng(s.seed) for s in settings]
        for _ in range(4):
            batched = choose_rows(logits, settings, rows, [PAD], usable_vocab=10)
            assert batched == [choose(logits[r], s, alone[r], [PAD], 10) for r, s in enumerate(settings)]
            assert PAD not in batched and max(batched) < 10


def _reference_choice(logits_row, settings, rng, banned, usable_vocab):
    """The sampling rule written row by row with numpy's own `Generator.choice(p=)` (what choose_rows replicates)."""
    logits = np.array(logits_row, dtype="float64")
    logits[usable_vocab:] = -np.inf
    logits[banned] = -np.inf
    if settings.temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / settings.temperature
    if settings.top_k > 0:
        logits[logits < np.sort(logits)[-min(settings.top_k, usable_vocab)]] = -np.inf
    probs = np.exp(logits - logits.max())
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def test_batched_sampling_draws_what_generator_choice_draws():
    from serving.engine.generation import choose_rows

    vocab, usable = 4608, 4600
    data = np.random.default_rng(1)
    settings = [GenerationSettings(temperature=float(t), top_k=int(k), seed=int(i))
                for i, (t, k) in enumerate(zip(data.choice([0.0, 0.3, 1.0, 1.7], 24), data.choice([0, 1, 5, 50], 24)))]
    ours = [np.random.default_rng(s.seed) for s in settings]
    theirs = [np.random.default_rng(s.seed) for s in settings]
    for step in range(30):  # sharp and flat distributions; every row's generator advances once a step
        logits = (data.normal(size=(24, vocab)) * data.choice([0.5, 4.0])).astype("float32")
        got = choose_rows(logits, settings, ours, [PAD], usable)
        assert got == [_reference_choice(logits[r], s, theirs[r], [PAD], usable) for r, s in enumerate(settings)]


def _choose_rows_as_before(logits, settings, rngs, banned_ids, usable_vocab):
    """choose_rows as it was: the whole batch copied to float64, padding and banned ids masked (the reference)."""
    from serving.engine.generation import _sample

    masked = np.array(logits, dtype="float64")
    masked[:, usable_vocab:] = -np.inf
    masked[:, banned_ids] = -np.inf
    greedy = masked.argmax(axis=1)
    return [int(greedy[r]) if s.temperature <= 0 else _sample(masked[r], s, rng.random())
            for r, (s, rng) in enumerate(zip(settings, rngs))]


def test_choosing_without_the_batch_copy_picks_the_same_tokens():
    """Greedy rows over the float32 logits (a banned or padded argmax falls back to the masked row) and sampled rows
    copied one at a time give the tokens of the whole-batch float64 copy, for the same seeds."""
    from serving.engine.generation import choose_rows

    rng = np.random.default_rng(0)
    usable, banned = 280, [0, 1, 5]
    kinds = [GenerationSettings(), GenerationSettings(temperature=0.8, seed=1),
             GenerationSettings(temperature=1.0, top_k=20, seed=2), GenerationSettings(temperature=0.7, top_p=0.9, seed=3)]
    for trial in range(50):
        logits = rng.standard_normal((12, 300)).astype("float32") * 3
        logits[0, 5] = logits[1, 290] = logits[2, 0] = 50.0  # (argmax banned, padded, banned: rows 0-2 greedy)
        settings = [kinds[0]] * 3 + [kinds[r % 4] for r in range(9)]
        seeds = [trial * 100 + r for r in range(12)]
        got = choose_rows(logits, settings, [np.random.default_rng(s) for s in seeds], banned, usable)
        expected = _choose_rows_as_before(logits, settings, [np.random.default_rng(s) for s in seeds], banned, usable)
        assert got == expected, trial
        assert not set(got) & set(banned) and max(got) < usable


def test_rows_sampled_together_draw_the_float64_rule_s_tokens_and_its_distribution():
    """_sample_together (float32, block sums) against _sample (float64, row by row) at the same uniform numbers:
    the same token in all but rounding's few; banned and padding ids never; and 40,000 draws from one distribution
    fit its probabilities (chi-square)."""
    from scipy.stats import chisquare

    from serving.engine.generation import _sample, _sample_together

    rng = np.random.default_rng(7)
    rows, vocab, banned = 2000, 300, [0, 5]  # (300: not a multiple of the 64-token blocks)
    scores = (rng.standard_normal((rows, vocab)) * rng.choice([0.5, 3.0, 8.0], (rows, 1))).astype("float32")
    temperatures, uniforms = rng.uniform(0.3, 2.0, rows), rng.random(rows)
    ours = _sample_together(scores, temperatures, uniforms, banned)
    theirs = []
    for r in range(rows):
        row = scores[r].astype("float64")
        row[banned] = -np.inf
        theirs.append(_sample(row, GenerationSettings(temperature=float(temperatures[r])), float(uniforms[r])))
    assert (ours == -1).sum() + (ours != np.array(theirs)).sum() <= 2
    assert not set(ours.tolist()) & set(banned) and ours.max() < vocab
    # top-k rows (their k-th largest score the floor) draw _sample's top-k tokens
    ks = rng.choice([1, 5, 40], rows)
    unbanned = scores.copy()
    unbanned[:, banned] = -np.inf
    floors = np.array([np.sort(unbanned[r])[-k] for r, k in enumerate(ks)], "float32")
    ours = _sample_together(scores, temperatures, uniforms, banned, floors)
    theirs = []
    for r in range(rows):
        row = scores[r].astype("float64")
        row[banned] = -np.inf
        theirs.append(_sample(row, GenerationSettings(temperature=float(temperatures[r]), top_k=int(ks[r])),
                              float(uniforms[r])))
    assert (ours != np.array(theirs)).sum() <= 2
    assert all(scores[r, t] >= floors[r] for r, t in enumerate(ours))

    one = (rng.standard_normal(vocab) * 2).astype("float32")
    draws = _sample_together(np.tile(one, (40000, 1)), np.full(40000, 0.8), rng.random(40000), banned)
    exact = np.exp(one.astype("float64") / 0.8 - (one.max() / 0.8))
    exact[banned] = 0.0
    exact /= exact.sum()
    counts = np.bincount(draws[draws >= 0], minlength=vocab)
    common = exact * 40000 >= 5  # (the rest pooled into one bin)
    observed = np.append(counts[common], counts[~common].sum())
    expected = np.append(exact[common], exact[~common].sum()) * 40000
    assert chisquare(observed, expected).pvalue > 1e-3
    assert chisquare(np.roll(observed, 1), expected).pvalue < 1e-6  # (the test can tell a shifted draw)


def test_a_greedy_batch_of_format_4_reads_the_argmax_and_never_fetches_the_logits():
    """StepLogits (the decode program's argmax output, its logits left in the predictor): greedy rows take the
    argmax; a sampled row, or an argmax that is a banned or padding id, fetches the logits once, and every row's
    token is what the plain array gives."""
    from serving.engine.generation import StepLogits, choose_rows

    logits = np.random.default_rng(3).standard_normal((4, 300)).astype("float32")
    fetches = []

    def step(argmax=None):
        return StepLogits(logits.argmax(axis=1) if argmax is None else argmax,
                          lambda: fetches.append(1) or logits)

    greedy = [GenerationSettings()] * 4
    assert choose_rows(step(), greedy, [None] * 4, [PAD], 300) == logits.argmax(axis=1).tolist() and not fetches
    banned_argmax = logits.argmax(axis=1)
    banned_argmax[1], banned_argmax[2] = PAD, 299  # (a banned id; a padding id past the usable vocabulary)
    expected = choose_rows(logits, greedy, [None] * 4, [PAD], 290)
    assert choose_rows(step(banned_argmax), greedy, [None] * 4, [PAD], 290) == expected and len(fetches) == 1
    mixed = [GenerationSettings(), GenerationSettings(temperature=0.8, seed=1), GenerationSettings(),
             GenerationSettings(temperature=0.8, seed=2)]
    rngs = lambda: [np.random.default_rng(i) for i in range(4)]  # noqa: E731
    assert choose_rows(step(), mixed, rngs(), [PAD], 300) == choose_rows(logits, mixed, rngs(), [PAD], 300)
    assert len(fetches) == 2
