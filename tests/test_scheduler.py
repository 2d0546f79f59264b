"""Block accounting of the scheduler and of rounds launched behind an unread one (no model)."""
from types import SimpleNamespace

from ddtree.engine.block_manager import BlockManager
from ddtree.engine.llm_engine import LLMEngine
from ddtree.engine.sampling_params import SamplingParams
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.sequence import Sequence, Status


def _seqs(lengths, lookahead):
    seqs = []
    for n in lengths:
        s = Sequence(list(range(n)), SamplingParams(max_tokens=8))
        s.lookahead = lookahead
        seqs.append(s)
    return seqs


def test_decode_preempts_the_newest_when_blocks_run_out():
    blocks = BlockManager(num_blocks=7, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = _seqs([5, 5, 5], lookahead=3)  # each needs ceil((5 - 1 + 3) / 4) = 2 blocks
    for s in (a, b, c):
        sched.add(s)
    assert sched.schedule()[0] == "prefill"
    assert blocks.num_free == 1
    for s in (a, b, c):
        s.token_ids += [1, 1]  # two more tokens: 6 + 3 slots = 3 blocks each
        s.num_cached = len(s) - 1
    kind, ready, _ = sched.schedule()
    assert kind == "decode" and ready == [a, b]  # c gave its blocks up for a and b
    assert c.status is Status.WAITING and c.block_table == [] and list(sched.waiting) == [c]
    assert [len(s.block_table) for s in ready] == [3, 3] and blocks.num_free == 1


def test_round_behind_an_unread_one_reserves_for_every_sequence_or_none():
    """Each sequence alone fits the free blocks, all together do not: no round is launched behind
    (before, each was checked alone and the reservation ran out of blocks half way)."""
    blocks = BlockManager(num_blocks=9, block_size=4)
    seqs = _seqs([4, 4, 4], lookahead=4)
    for s in seqs:
        blocks.reserve(s, len(s) - 1 + s.lookahead)  # 2 blocks each, as the scheduler did
    assert blocks.num_free == 3
    launched = []
    engine = LLMEngine.__new__(LLMEngine)
    engine.scheduler = SimpleNamespace(admits=lambda: False, running=list(seqs))
    engine.runner = SimpleNamespace(lookahead=lambda method, budget: 4, can_launch_after=lambda seqs: True)
    engine.blocks, engine.max_model_len, engine.overlapped_rounds = blocks, 64, 0
    engine._launch = lambda seqs, method, budget, after=None: launched.append(seqs) or "round"
    prev = SimpleNamespace(seqs=seqs, kind=SimpleNamespace(method="ddtree", budget=3))
    # Both rounds need 4 - 1 + 4 + 4 = 11 slots: 3 blocks, one more per sequence (3 in all).
    assert engine._launch_after(prev) == "round" and blocks.num_free == 0
    for s in seqs:
        s.token_ids += [1, 1]  # 13 slots now: one more block each, 3 in all, and none is free
        blocks.free.append(s.block_table.pop())  # give back one each: 3 free, 2 needed each
    assert engine._launch_after(prev) is None
    assert blocks.num_free == 3 and [len(s.block_table) for s in seqs] == [2, 2, 2]


def test_joins_wait_for_a_group_or_the_wait_limit():
    """Under load a waiting request joins once ceil(running / 16) can join (free slots, not more)
    or it has waited join_wait_rounds rounds; an empty batch, or a light one, takes it at once;
    one that does not fit the free blocks never stops the batch."""
    blocks = BlockManager(num_blocks=200, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=40, max_num_batched_tokens=4096, join_wait_rounds=8)
    first = _seqs([5] * 32, lookahead=1)
    for s in first:
        sched.add(s)
    assert sched.admits()  # nothing running: at once
    assert sched.schedule()[0] == "prefill" and len(sched.running) == 32 and sched.joins == 0
    for s in first:
        s.num_cached = len(s) - 1
    sched.rounds = 10
    late = _seqs([5, 5], lookahead=1)
    sched.add(late[0])
    assert not sched.admits()  # 32 running want a group of 2
    kind, ready, _ = sched.schedule()
    assert kind == "decode" and len(ready) == 32 and list(sched.waiting) == [late[0]]
    sched.rounds = 17
    assert not sched.admits()
    sched.rounds = 18  # waited 8 rounds
    assert sched.admits()
    sched.rounds = 11
    sched.add(late[1])  # a group of two
    assert sched.admits()
    assert sched.schedule()[0] == "prefill" and len(sched.running) == 34 and sched.joins == 1
    # Free slots bound the group: 38 of 40 running, two free, a group of ceil(38 / 16) = 3 waits.
    more = _seqs([5] * 8, lookahead=1)
    for s in more[:4]:
        sched.add(s)
    sched.schedule()
    for s in more[4:7]:
        sched.add(s)
    assert len(sched.running) == 38 and not sched.admits()
    sched.max_num_seqs = 41
    assert sched.admits()  # three free slots now
    # A light batch (at most 16 running) takes a request at once.
    light = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=40, max_num_batched_tokens=4096,
                      join_wait_rounds=8)
    for s in _seqs([5] * 16, lookahead=1):
        light.add(s)
    light.schedule()
    light.add(more[7])
    assert light.admits()
    # One that does not fit waits without stopping the batch, however long it waited.
    light.blocks.free = light.blocks.free[:1]
    light.rounds += 100
    assert not light.admits()
