"""Issue 43 item 1, the scheduler's side of /health_generate (seed 000's return_health_check_ct):
a probe that reaches a busy scheduler is not queued behind its work; the output processor answers
it with a HealthCheckOutput once the next batch's results are in. An idle scheduler runs the probe
as the one-token request it is."""

from __future__ import annotations

from typing import Any, List

from radixserve.engine import Engine
from radixserve.protocol import BatchTokenIDOutput, GenerateReqInput, HealthCheckOutput

LONG = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}


def _record_outputs(engine: Engine) -> List[Any]:
    """Everything the scheduler sends, recorded before the engine routes it."""
    sent: List[Any] = []
    proc = engine.scheduler.output_processor
    forward = proc.send_fn

    def send(obj: Any) -> None:
        sent.append(obj)
        forward(obj)

    proc.send_fn = send
    return sent


def _submit_probe(engine: Engine, rid: str) -> None:
    probe = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=rid,
                             is_health_check=True)
    engine._inbox.extend(engine.frontend.tokenize(probe))


def test_busy_scheduler_answers_the_probe_from_its_loop(loop):
    engine = Engine(max_total_tokens=4096, max_running_requests=2, **loop)
    states = engine.submit(input_ids=[[5 + i, 6, 7] for i in range(6)], sampling_params=LONG)
    engine.step()
    sched = engine.scheduler
    sent = _record_outputs(engine)
    _submit_probe(engine, "HEALTH_CHECK_busy")
    engine.step()
    assert all(r.rid != "HEALTH_CHECK_busy" for r in sched.waiting_queue + sched.running_batch.reqs)
    for _ in range(3):  # the overlap loop processes a batch's results one iteration late
        if any(isinstance(o, HealthCheckOutput) for o in sent):
            break
        engine.step()
    assert [o for o in sent if isinstance(o, HealthCheckOutput)] == [HealthCheckOutput("HEALTH_CHECK_busy")]
    assert not any(s.finished for s in states)  # answered while all six requests still had work
    engine.frontend.rid_to_state.pop("HEALTH_CHECK_busy")
    engine.wait_until_idle()
    assert all(len(s.output_ids) == LONG["max_new_tokens"] for s in states)
    sched.check_memory()


def test_idle_scheduler_runs_the_probe(loop):
    engine = Engine(max_total_tokens=4096, **loop)
    sent = _record_outputs(engine)
    _submit_probe(engine, "HEALTH_CHECK_idle")
    engine.wait_until_idle()
    assert not any(isinstance(o, HealthCheckOutput) for o in sent)
    finished = [o.finished_reasons[o.rids.index("HEALTH_CHECK_idle")] for o in sent
                if isinstance(o, BatchTokenIDOutput) and "HEALTH_CHECK_idle" in o.rids]
    assert finished[-1] == {"type": "length", "length": 1}
    engine.scheduler.check_memory()


def test_a_stale_heartbeat_is_healthy_only_while_weights_load_from_disk():
    """Issue 45: an update from disk holds the scheduler's loop while the checkpoint loads, so its
    heartbeat goes stale; /health stays 200 during that load (a busy scheduler, not a dead one),
    and says the heartbeat is stale otherwise (a distributed update waiting on a dead trainer
    included). A dead child is reported either way."""
    import time
    from types import SimpleNamespace

    from radixserve.managers.tokenizer_manager import ServerStatus, TokenizerManager

    updates = SimpleNamespace(loading_from_disk=False)
    tm = SimpleNamespace(dead_reason=None, draining=False, server_status=ServerStatus.Up, last_heartbeat={0: time.monotonic() - 100.0},
                         server_args=SimpleNamespace(health_check_timeout=20.0), weight_updates=updates)
    assert "has not reported" in TokenizerManager.health_problem(tm)
    updates.loading_from_disk = True
    assert TokenizerManager.health_problem(tm) is None
    tm.dead_reason = "The scheduler exited."
    assert TokenizerManager.health_problem(tm) == "The scheduler exited."
    tm.dead_reason, updates.loading_from_disk = None, False
    assert "has not reported" in TokenizerManager.health_problem(tm)
