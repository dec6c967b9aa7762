"""Worker.poll and Member.take_news without a cluster: a poll reply the driver never received
(a timeout under load) loses no record, and no record is delivered twice."""
from __future__ import annotations

from hybrid_ray.cluster.status import Member
from hybrid_ray.cluster.worker import Worker


def test_records_survive_a_lost_reply_and_arrive_once():
    worker, member = Worker(), Member(handle=None, index=0)
    worker._report({"step": 1})
    worker._report({"step": 2})
    lost = worker.poll(member.acked)  # the driver's ray.get timed out: the reply is gone
    assert [r for _, r in lost["records"]] == [{"step": 1}, {"step": 2}]

    first = member.take_news(worker.poll(member.acked))
    assert list(first.records) == [{"step": 1}, {"step": 2}] and member.acked == 2
    worker._report({"step": 3})
    again = worker.poll(0)  # a stale ack (say, a retried call) re-sends, the member filters
    assert list(member.take_news(again).records) == [{"step": 3}]
    assert list(member.take_news(worker.poll(member.acked)).records) == []
    assert worker._records == []  # acknowledged records are dropped on the worker


def test_errors_pass_through():
    member = Member(handle=None, index=0)
    err = TimeoutError("no reply")
    assert member.take_news(err) is err and member.acked == 0


def test_flush_waits_until_the_driver_acknowledged_every_record():
    import threading

    worker, member = Worker(), Member(handle=None, index=0)
    assert worker._flush(0.0)  # nothing reported: nothing to wait for
    worker._report({"step": 1})
    worker._report({"step": 2})
    assert not worker._flush(0.05)  # not polled yet
    done = []
    t = threading.Thread(target=lambda: done.append(worker._flush(5.0)))
    t.start()
    member.take_news(worker.poll(member.acked))  # delivered, not yet acknowledged
    assert t.is_alive() and member.acked == 2
    worker.ack(member.acked)  # the acknowledgement the driver sends right after the reply
    t.join(5)
    assert done == [True] and worker._records == []
    worker._report({"step": 3})
    worker.poll(3)  # an acknowledgement that rides on the next poll works as well
    assert worker._flush(0.0)
