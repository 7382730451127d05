import pytest
from deferline.topics import InvalidQueueName, TopicNames, validate_queue_name


def test_default_names_use_the_prefix():
    names = TopicNames("deferline.")
    assert names.defer() == "deferline.defer"
    assert names.resume() == "deferline.resume"
    assert names.tasks == "deferline.tasks"
    assert names.work() == "deferline.queue"
    assert names.resumes() == "deferline.queue.resumes"
    assert names.dead == "deferline.dead"
    assert names.task_events == "deferline.tasks.events"


def test_trigger_queues_get_their_own_pair_and_default_means_none():
    names = TopicNames("p.")
    assert (names.defer("fast"), names.resume("fast")) == ("p.defer.fast", "p.resume.fast")
    assert names.defer("default") == names.defer(None) == "p.defer"
    assert names.resume("default") == "p.resume"


def test_worker_queues():
    names = TopicNames("p.")
    assert names.work("gpu") == "p.queue.gpu"
    assert names.resumes("gpu") == "p.queue.gpu.resumes"
    assert names.work("default") == "p.queue"


@pytest.mark.parametrize("bad", ["", "a b", "a.b", "x/y", "é", "a" * 65])
def test_invalid_queue_names_are_rejected(bad):
    with pytest.raises(InvalidQueueName, match="queue name"):
        TopicNames().defer(bad)
    with pytest.raises(ValueError, match="queue name"):
        TopicNames().work(bad)


def test_worker_queue_resumes_is_reserved_because_it_would_collide():
    with pytest.raises(InvalidQueueName, match="reserved"):
        TopicNames().work("resumes")
    assert validate_queue_name("resumes") == "resumes"  # fine as a trigger queue


def test_partner_pairs_defer_with_resume_and_tasks_with_its_events():
    names = TopicNames("p.")
    assert names.partner("p.defer") == "p.resume"
    assert names.partner("p.resume") == "p.defer"
    assert names.partner("p.defer.fast") == "p.resume.fast"
    assert names.partner("p.resume.fast") == "p.defer.fast"
    assert names.partner("p.tasks") == "p.tasks.events"
    assert names.partner("p.tasks.events") == "p.tasks"
    assert names.partner("p.tasks.fast") is None
    assert names.partner("p.queue.resumes") is None
    assert names.partner("other.defer") is None
    assert names.partner("p.deferred") is None
