"""Continuous batching (serving/engine/scheduler.py) on the hand-made cache model of test_generation: answers equal each
request alone, whenever it joins; limits, deadlines, cancellation, the static policy. Fast."""
import pytest
from test_generation import EOS, PAD, REQUESTS, ScriptedCache, batch

from serving.engine.scheduler import Job, Scheduler
from serving.protocol import GenerationSettings


def scheduler(cache=None, **options):
    cache = cache or ScriptedCache()
    return Scheduler(cache.prefill, cache.decode, EOS, [PAD], usable_vocab=10, max_length=64, pad_id=PAD, **options)


def drive(s: Scheduler, arrivals: dict[int, list[Job]], now=lambda step: 0.0, max_steps=200) -> dict[int, tuple]:
    """Add each job at its step; step until idle. {job id: (status, tokens, peak batch)}."""
    done, step = {}, 0
    while step < max_steps and (not s.idle or any(k >= step for k in arrivals)):
        for job in arrivals.get(step, []):
            s.add(job)
        for outcome in s.step(now(step)):
            done[outcome.job.id] = (outcome.status, outcome.job.new, outcome.job.peak_batch)
        step += 1
    return done


def jobs(requests, first_id=0):
    return [Job(first_id + i, list(p), s) for i, (p, s) in enumerate(requests)]


def test_requests_joining_mid_generation_answer_as_alone():
    alone = [batch([p], [s])[0] for p, s in REQUESTS]
    cache = ScriptedCache()
    everyone = jobs(REQUESTS)  # (2 generates 12 tokens, 3 eight: the others join while they run)
    arrivals = {0: [everyone[2]], 1: [everyone[3]], 2: everyone[:2], 4: [everyone[4]]}
    done = drive(scheduler(cache), arrivals)
    assert {i: d[1] for i, d in done.items()} == dict(enumerate(alone))
    assert all(d[0] == "done" for d in done.values())
    # they really were decoded together, joining mid-way
    assert max(cache.decode_batches) == 4 and done[2][2] == 4 and done[0][2] == 4


def test_batch_limit_and_the_static_policy():
    long = ([9], [5], [7], [8], [4, 4], [7, 7], [9, 9, 9])  # (prompts that never meet the end token)
    many = [(p, GenerationSettings(max_new_tokens=5 + i)) for i, p in enumerate(long)]
    alone = [batch([p], [s])[0] for p, s in many]
    cache = ScriptedCache()
    done = drive(scheduler(cache, max_batch_size=3), {0: jobs(many)})
    assert [done[i][1] for i in range(7)] == alone and max(cache.decode_batches) <= 3
    static = ScriptedCache()
    done = drive(scheduler(static, max_batch_size=8, policy="static"), {0: jobs(many[:2]), 1: jobs(many[2:], 2)})
    assert [done[i][1] for i in range(7)] == alone
    # static: the late arrivals waited for the first batch to finish, then ran as one batch of five
    # (5 and 6 new tokens: 4 decode steps together, one alone for the second; then the five)
    assert static.decode_batches[:6] == [2, 2, 2, 2, 1, 5] and max(static.decode_batches) == 5


def test_deadline_and_cancellation_leave_the_others_exact():
    alone = [batch([p], [s])[0] for p, s in REQUESTS]
    s = scheduler(max_batch_size=2)
    queued = jobs(REQUESTS)
    queued[4].deadline = 1.5  # waits behind a full batch, so it is still waiting at step 2
    for job in queued:
        s.add(job)
    done = {}
    for step in range(100):
        if step == 2:
            s.cancel(2)  # running by now (0 and 1 finished at step 0)
        for outcome in s.step(float(step)):
            done[outcome.job.id] = (outcome.status, outcome.job.new)
        if s.idle:
            break
    assert done[2][0] == "cancelled" and 0 < len(done[2][1]) < len(alone[2]) and done[4] == ("deadline", [])
    assert {i: done[i] for i in (0, 1, 3)} == {i: ("done", alone[i]) for i in (0, 1, 3)}


def test_the_cache_is_trimmed_to_what_running_sequences_need():
    s = scheduler()
    s.add(Job(0, [5] * 20, GenerationSettings(max_new_tokens=1)))
    s.add(Job(1, [9], GenerationSettings(max_new_tokens=10)))
    s.step()  # both prefilled (width 20); the long one finishes at once
    assert [job.id for job in s.running] == [1]
    assert s.cache.mask.shape[1] == 2  # its prompt and the token just fed: the 19 padding columns are gone
    while not s.idle:
        s.step()


def test_a_prompt_at_the_maximum_length_gets_nothing():
    s = Scheduler(ScriptedCache().prefill, ScriptedCache().decode, EOS, [PAD], 10, max_length=4)
    s.add(Job(0, [5] * 4, GenerationSettings()))
    assert [(o.job.id, o.status, o.job.new) for o in s.step()] == [(0, "done", [])]


def test_top_p_logprobs_and_stop_are_per_sequence_and_batch_invariant():
    """top_p=0.01 is greedy; logprobs are the log-softmax of the model's row (banned and padding ids out) with the
    most likely alternatives; a stop check ends a sequence at once; and every sequence answers the same alone as
    among the others with mixed options."""
    import numpy as np

    from test_generation import history_logits

    mixed = [([4], GenerationSettings(max_new_tokens=6, temperature=1.0, top_p=0.01, seed=5)),
             ([7, 4, 5], GenerationSettings(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=11, logprobs=2)),
             ([9, 9], GenerationSettings(max_new_tokens=12, logprobs=0)),
             ([6] * 9, GenerationSettings(max_new_tokens=8, temperature=0.7, top_k=3, top_p=0.5, seed=3)),
             ([5, 6], GenerationSettings(max_new_tokens=10, stop=("x",)))]
    stop_after = lambda job: len(job.new) >= 2  # noqa: E731  (the worker's check looks at the decoded text)

    def alone(i):
        done = drive(scheduler(stop_check=stop_after), {0: jobs([mixed[i]], i)})
        return done[i][1]

    s = scheduler(stop_check=stop_after)
    queued = jobs(mixed)
    arrivals = {0: queued[:2], 1: queued[2:4], 3: queued[4:]}
    done, step = {}, 0
    while step < 100 and (not s.idle or any(k >= step for k in arrivals)):
        for job in arrivals.get(step, []):
            s.add(job)
        for outcome in s.step(0.0):
            done[outcome.job.id] = outcome.job
        step += 1
    assert {i: done[i].new for i in done} == {i: alone(i) for i in range(5)}
    greedy = drive(scheduler(), {0: jobs([([4], GenerationSettings(max_new_tokens=6))])})[0][1]
    assert done[0].new == greedy  # top_p 0.01: only the most likely token is left to sample
    assert len(done[4].new) == 2  # the stop check ended it
    history = [9, 9]
    for token, entry in zip(done[2].new, done[2].logprobs):  # greedy with logprobs=0: the chosen token only
        row = history_logits(history).astype("float64")
        row[10:], row[PAD] = -np.inf, -np.inf
        logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert entry["token"] == token and entry["logprob"] == pytest.approx(logp[token]) and entry["top"] == []
        history.append(token)
    assert all(len(e["top"]) == 2 and e["top"][0][1] >= e["top"][1][1] for e in done[1].logprobs)
    assert not done[0].logprobs and len(done[1].logprobs) == len(done[1].new)


def test_a_stop_string_completed_by_the_last_allowed_token_is_cut_and_reported_as_stop():
    """The step that reaches max_new_tokens also completes the stop string: the scheduler's stop check still runs,
    so the answer stops there and says so."""
    from types import SimpleNamespace

    from serving.engine.worker import job_result, stop_position

    model = SimpleNamespace(decode=lambda ids: "".join(chr(ord("a") + i) for i in ids), eos_id=EOS)
    free = drive(scheduler(), {0: jobs([([5], GenerationSettings(max_new_tokens=6))])})[0][1]
    stop = model.decode(free[1:2])  # the second token's text (not the first's, not the end token)
    s = scheduler(stop_check=lambda job: stop_position(model, job) is not None)
    job = Job(1, [5], GenerationSettings(max_new_tokens=2, stop=(stop,)))
    s.add(job)
    while not s.idle:
        s.step(0.0)
    assert job.new == free[:2]
    result = job_result(model, job)
    assert (result["text"], result["finish_reason"]) == (model.decode(free[:1]), "stop")
    plain = Job(2, [5], GenerationSettings(max_new_tokens=2))
    plain.new = free[:2]
    assert (job_result(model, plain)["text"], job_result(model, plain)["finish_reason"]) == (model.decode(free[:2]),
                                                                                           "length")


def test_decode_steps_write_into_the_cache_and_copy_it_only_when_the_batch_changes():
    """The scheduler owns the running batch's DecodeCache (serving/engine/kv_cache.py): a decode step writes one column
    into its buffers; the whole cache is copied only when sequences join or leave, or the buffers fill (every GROW
    steps). A scheduler that rebuilt the cache each step (np.concatenate, or a fresh DecodeCache) fails here."""
    from serving.engine import kv_cache

    cache = ScriptedCache()
    s = scheduler(cache)
    s.add(Job(0, [9, 9], GenerationSettings(max_new_tokens=60)))
    s.add(Job(1, [7], GenerationSettings(max_new_tokens=60)))  # (neither meets the end token in 60)
    s.step()  # prefill both (one DecodeCache: one copy) and the first decode step
    held = s.cache
    for _ in range(39):
        s.step()
    assert s.cache is held and len(cache.decode_batches) == 40
    # 40 steps from 2 columns, room for GROW at a time: one growth, so two buffers were ever fed
    assert held.copies == 2 and len(cache.buffers) == 2, (held.copies, len(cache.buffers))
    s.add(Job(2, [5, 5, 5], GenerationSettings(max_new_tokens=3)))
    s.step()  # the join: one copy
    assert held.copies == 3 and len(cache.buffers) == 3 and cache.decode_batches[-1] == 3
    for _ in range(3):
        s.step()  # job 2 leaves after its third token: one copy
    assert held.copies == 4 and len(cache.buffers) == 4 and s.cache.rows == 2
    assert kv_cache.GROW == 32
