"""What each cloud's metadata answer means, decided without a socket."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from outlast.drain.cloud import (
    GCP_PREEMPTED_PATH,
    HttpAnswer,
    backoff_s,
    decide_aws_action,
    decide_aws_rebalance,
    decide_aws_token,
    decide_azure,
    decide_gcp,
    gcp_query,
    parse_azure_vm_name,
)

NOW = 1_700_000_000.0


def answer(status: int, body: str = "", **headers: str) -> HttpAnswer:
    return HttpAnswer(status, body, {k.lower(): v for k, v in headers.items()})


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


# ---- AWS ----------------------------------------------------------------------------------


def test_aws_token_is_the_body_of_a_200():
    assert decide_aws_token(answer(200, "AQAEAtoken==\n"), 5.0).token == "AQAEAtoken=="


@pytest.mark.parametrize("ans", [answer(403, "Forbidden"), answer(400), answer(200, ""),
                                 answer(200, "two\nlines"), answer(200, "caf\u00e9")])
def test_aws_token_refused_or_unusable_is_a_problem_retried_after_the_poll_interval(ans):
    step = decide_aws_token(ans, 5.0)
    assert step.token is None and step.problem and step.retry_after_s == 5.0


def test_aws_no_interruption_scheduled_is_a_404_and_means_ask_again_later():
    step = decide_aws_action(answer(404, "Not Found"), 5.0, fresh_token=False)
    assert step.notice is None and step.problem is None and step.retry_after_s == 5.0


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_aws_instance_action_gives_a_notice_with_its_time_as_deadline(action):
    body = f'{{"action": "{action}", "time": "2026-03-18T08:22:00Z"}}'
    step = decide_aws_action(answer(200, body), 5.0, fresh_token=False)
    assert step.notice is not None
    assert step.notice.source == "aws" and action in step.notice.reason
    assert step.notice.deadline_unix_s == utc(2026, 3, 18, 8, 22)
    assert step.notice.detail == body


def test_aws_expired_token_asks_for_a_new_one_at_once():
    step = decide_aws_action(answer(401), 5.0, fresh_token=False)
    assert step.refresh_token and step.retry_after_s == 0 and step.problem is None


def test_aws_refusing_a_fresh_token_is_a_problem_not_a_tight_loop():
    step = decide_aws_action(answer(401), 5.0, fresh_token=True)
    assert step.refresh_token and step.retry_after_s == 5.0 and "just issued" in step.problem


@pytest.mark.parametrize("ans", [answer(500, "oops"), answer(503), answer(429), answer(200, "<html>"),
                                 answer(200, '{"action": "terminate"}'), answer(200, "[1, 2]"),
                                 answer(200, '{"action": "x", "time": "2026-01-01T00:00:00Z"}'),
                                 answer(200, '{"action": "stop", "time": "soon"}')])
def test_aws_unusable_instance_action_is_a_problem_without_a_notice(ans):
    step = decide_aws_action(ans, 5.0, fresh_token=False)
    assert step.notice is None and step.problem and step.retry_after_s == 5.0


def test_aws_rebalance_recommendation_is_a_notice_without_deadline():
    step = decide_aws_rebalance(answer(200, '{"noticeTime": "2020-10-27T08:22:00Z"}'), 5.0, fresh_token=False)
    assert step.notice is not None and step.notice.deadline_unix_s is None
    assert "2020-10-27T08:22:00Z" in step.notice.reason


def test_aws_rebalance_absent_is_a_404_and_garbage_is_a_problem():
    assert decide_aws_rebalance(answer(404), 5.0, fresh_token=False).notice is None
    assert decide_aws_rebalance(answer(200, "{}"), 5.0, fresh_token=False).problem


# ---- GCP ----------------------------------------------------------------------------------


def test_gcp_first_read_is_plain_then_held_on_the_etag():
    assert gcp_query(None, 60) == GCP_PREEMPTED_PATH
    held = gcp_query("411261ca6c9e654e", 60)
    assert held.startswith(GCP_PREEMPTED_PATH + "?")
    assert "wait_for_change=true" in held and "last_etag=411261ca6c9e654e" in held and "timeout_sec=60" in held


def test_gcp_true_gives_a_notice_due_after_the_notice_period():
    step = decide_gcp(answer(200, "TRUE"), NOW, 30.0, 1.0)
    assert step.notice is not None and step.notice.source == "gcp"
    assert step.notice.deadline_unix_s == NOW + 30.0


def test_gcp_false_with_etag_holds_the_next_request_at_once():
    step = decide_gcp(answer(200, "FALSE", ETag="abc"), NOW, 30.0, 1.0)
    assert step.notice is None and step.problem is None and step.etag == "abc" and step.retry_after_s == 0


def test_gcp_false_without_etag_falls_back_to_polling():
    step = decide_gcp(answer(200, "FALSE"), NOW, 30.0, 1.0)
    assert step.etag is None and step.retry_after_s == 1.0 and step.problem is None


@pytest.mark.parametrize("ans", [answer(503), answer(500, "x"), answer(200, "maybe"), answer(404)])
def test_gcp_other_answers_are_problems_that_drop_the_etag(ans):
    step = decide_gcp(ans, NOW, 30.0, 1.0)
    assert step.notice is None and step.problem and step.etag is None and step.retry_after_s == 1.0


# ---- Azure --------------------------------------------------------------------------------


def event(kind="Preempt", resources=("vm-1",), not_before="Mon, 19 Sep 2016 18:29:47 GMT", status="Scheduled",
          event_id="602d9444-d2cd-49c7-8624-8643e7171297"):
    return {"EventId": event_id, "EventType": kind, "ResourceType": "VirtualMachine", "Resources": list(resources),
            "EventStatus": status, "NotBefore": not_before, "Description": "", "EventSource": "Platform",
            "DurationInSeconds": -1}


def events(*evs) -> HttpAnswer:
    return answer(200, json.dumps({"DocumentIncarnation": 2, "Events": list(evs)}))


def test_azure_no_events_means_ask_again_later():
    step = decide_azure(events(), NOW, "vm-1", ("Preempt",), 1.0)
    assert step.notice is None and step.problem is None and step.retry_after_s == 1.0


def test_azure_preempt_for_this_vm_is_a_notice_due_at_not_before():
    step = decide_azure(events(event()), NOW, "vm-1", ("Preempt",), 1.0)
    assert step.notice is not None and step.notice.source == "azure"
    assert step.notice.deadline_unix_s == utc(2016, 9, 19, 18, 29, 47)
    assert "Preempt" in step.notice.reason and "602d9444" in step.notice.reason


def test_azure_events_for_other_vms_and_other_types_are_ignored():
    step = decide_azure(events(event(resources=["vm-2"]), event(kind="Freeze"), event(kind="Reboot")),
                        NOW, "vm-1", ("Preempt",), 1.0)
    assert step.notice is None and step.problem is None


def test_azure_with_the_vm_name_unknown_every_preempt_counts():
    assert decide_azure(events(event(resources=["vm-2"])), NOW, None, ("Preempt",), 1.0).notice is not None


def test_azure_terminate_counts_only_when_asked_for():
    assert decide_azure(events(event(kind="Terminate")), NOW, "vm-1", ("Preempt",), 1.0).notice is None
    assert decide_azure(events(event(kind="Terminate")), NOW, "vm-1", ("Preempt", "Terminate"), 1.0).notice


def test_azure_started_event_has_a_blank_not_before_and_is_due_now():
    step = decide_azure(events(event(not_before="", status="Started")), NOW, "vm-1", ("Preempt",), 1.0)
    assert step.notice.deadline_unix_s == NOW


def test_azure_earliest_of_several_events_wins():
    late = event(event_id="late", not_before="Mon, 19 Sep 2016 18:40:00 GMT")
    early = event(event_id="early", not_before="Mon, 19 Sep 2016 18:30:00 GMT")
    step = decide_azure(events(late, early), NOW, "vm-1", ("Preempt",), 1.0)
    assert "early" in step.notice.reason and step.notice.deadline_unix_s == utc(2016, 9, 19, 18, 30)


@pytest.mark.parametrize("ans", [answer(400, "Bad Request"), answer(500), answer(200, "not json"),
                                 answer(200, '{"DocumentIncarnation": 1}'), answer(200, "[]")])
def test_azure_unusable_answers_are_problems(ans):
    step = decide_azure(ans, NOW, "vm-1", ("Preempt",), 1.0)
    assert step.notice is None and step.problem and step.retry_after_s == 1.0


def test_azure_vm_name_is_taken_only_when_it_looks_like_one():
    assert parse_azure_vm_name(answer(200, "worker_3\n")) == "worker_3"
    for ans in [answer(200, "\x00garbage{{{"), answer(200, "<html><body>hi</body></html>"), answer(200, ""),
                answer(404, "worker_3"), answer(200, "x" * 200)]:
        assert parse_azure_vm_name(ans) is None


# ---- back-off -----------------------------------------------------------------------------


def test_backoff_doubles_from_the_poll_interval_up_to_the_cap():
    assert [backoff_s(1.0, n, 4.0) for n in range(6)] == [1.0, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff_s(5.0, 3, 1.0) == 5.0  # a cap below the poll interval never shortens it
