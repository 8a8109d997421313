"""The data-parallel router: least load (waiting x 4 + running, requests sent since a report counted as
waiting), prefix affinity that yields to overload, dead replicas out of the choice."""
from __future__ import annotations

from tokenmill.distributed.dp_router import ReplicaLoad, Router


def test_least_load_counts_waiting_four_times():
    r = Router(3, block_size=0)
    r.report(0, ReplicaLoad(waiting=1, running=0))     # load 4
    r.report(1, ReplicaLoad(waiting=0, running=3))     # load 3
    r.report(2, ReplicaLoad(waiting=0, running=5))     # load 5
    assert r.choose([1, 2, 3], [0, 1, 2]) == 1
    r.admitted(1, [1, 2, 3])                           # now 7: pending counts as waiting
    assert r.choose([1, 2, 3], [0, 1, 2]) == 0


def test_a_shared_prefix_goes_to_its_replica_unless_that_overloads_it():
    r = Router(2, block_size=4)
    prefix = list(range(16))
    r.admitted(1, prefix + [99])
    r.report(1, ReplicaLoad(waiting=0, running=5))     # 5 <= 1.5 x 0 + 4? no: overloaded
    assert r.choose(prefix + [7], [0, 1]) == 0
    r.report(1, ReplicaLoad(waiting=0, running=4))     # 4 <= 4: affinity holds
    assert r.choose(prefix + [7], [0, 1]) == 1
    assert r.choose(list(range(100, 116)), [0, 1]) == 0          # another prefix: least load
    assert r.choose(prefix[:3], [0, 1]) == 0                    # shorter than a block: no key


def test_only_candidates_are_chosen():
    r = Router(2, block_size=4)
    r.admitted(1, list(range(8)))
    assert r.choose(list(range(8)), [0]) == 0            # replica 1 is not a candidate (dead)
    r.remove(1)
    assert r.prefixes == {}
