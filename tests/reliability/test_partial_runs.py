"""rollout.partial in real runs (the searching policy, the scripted retriever; tests/reliability/conftest.py): at
over-sampling 1 a run trains what the synchronous run trains, bit for bit; a SIGTERM among the updates of a step
that resumes carried conversations saves the carry from before it, and the resumed run equals an uninterrupted
one bit for bit (params and every metric); on two hosts, each resumes its own carry and data position."""

import numpy as np
import pytest

from tests.e2e.runs import comparable, finish, host_args, read_metrics, steps_saved
from tests.reliability.scripted_retriever import ScriptedRetriever
from tests.reliability.test_stops import TIMEOUT_S, final_params, stopped_during_updates
from tests.servers import free_port

TIS = {"objective__tis_cap": 2.0}  # rollout.partial needs the behaviour correction
# A run whose cut leaves conversations mid-way: every conversation of a step in one session (sessions would
# complete whole sessions, carrying only prompts not started), groups of one sample and 4 turns (the searching
# policy seldom answers before its last turn), 8 x 4 started for 4 trained: step 1's cut comes before its last turn
# round, step 2 resumes what it carried, step 3 drops what step 1 left (2 versions old).
CARRYING = {**TIS, "rollout__partial": True, "rollout__max_batch_size": 0, "data__prompts_per_step": 4,
            "data__samples_per_prompt": 1, "rollout__over_sampling": 8.0, "rollout__max_turns": 3}


def result(searching_runs, name, model_dir):
    run_dir = searching_runs.run_dir(name)
    return (read_metrics(run_dir), *final_params(run_dir, model_dir))


def assert_same_run(got, want, ignore=()):
    (records, step, params), (want_records, want_step, want_params) = got, want
    strip = lambda r: {k: v for k, v in comparable(r).items() if not k.startswith(ignore)}  # noqa: E731
    assert [strip(r) for r in records] == [strip(r) for r in want_records]
    assert step == want_step and params.keys() == want_params.keys()
    for key in params:
        np.testing.assert_array_equal(params[key], want_params[key], err_msg=str(key))


@pytest.mark.slow
def test_over_sampling_1_trains_what_the_synchronous_run_trains(searching_runs, policy):
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), "sync_tis", **TIS)], TIMEOUT_S)
        finish([searching_runs.start(server.config(), "partial_1", **TIS, rollout__partial=True,
                                     rollout__over_sampling=1.0, rollout__max_staleness=0)], TIMEOUT_S)
    sync, partial = (result(searching_runs, name, policy[0]) for name in ("sync_tis", "partial_1"))
    assert all(r["rollout/partial/carried"] == r["rollout/partial/dropped"] == 0 for r in partial[0])
    assert_same_run(partial, sync, ignore=("rollout/partial/",))


@pytest.mark.slow
def test_sigterm_while_carrying_conversations_saves_the_carry_and_resumes_bitwise(searching_runs, policy):
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), "partial_reference", **CARRYING)], TIMEOUT_S)
        reference = result(searching_runs, "partial_reference", policy[0])
        first, second, third = reference[0]
        assert first["rollout/partial/carried"] > 0 and second["rollout/partial/resumed"] > 0
        assert second["rollout/partial/stale_token_share"] > 0 and third["rollout/partial/dropped"] > 0

        run_dir = searching_runs.run_dir("partial_update_stop")
        # SIGTERM once 2 of step 2's 4 updates are done (tests/reliability/sigterm_at_update.py): the state, data
        # position and carry from before step 2 are saved; the rerun resumes step 1's carried conversations again.
        stopped_during_updates(searching_runs, server, "partial_update_stop", 2, 2, **CARRYING)
        assert steps_saved(run_dir) == [1]
        finish([searching_runs.start(server.config(), "partial_update_stop", **CARRYING)], TIMEOUT_S)
    assert_same_run(result(searching_runs, "partial_update_stop", policy[0]), reference)


@pytest.mark.slow
def test_two_hosts_each_resume_their_own_carry_as_the_uninterrupted_run(searching_runs, policy):
    """Two processes (one CPU device each), 2 prompts of the step per host: each host carries its own conversations
    and draws its own prompts, so each resumes its own record of step 1's checkpoint (before, every host resumed
    host 0's carry and data position) and step 2 equals the uninterrupted two-host run's, bit for bit."""
    two_hosts = {**CARRYING, "mesh__fsdp": -1, "optim__mini_batch_size": 2, "optim__micro_batch_size": 2,
                 "train__checkpoint_every": 1}

    def run(server, name: str, steps: int) -> list[str]:
        port = free_port()
        return finish([searching_runs.start(server.config(), name, *host_args(port, pid), **two_hosts,
                                            train__total_steps=steps) for pid in (0, 1)], TIMEOUT_S)

    with ScriptedRetriever() as server:
        run(server, "partial_two_hosts", 2)
        run(server, "partial_two_hosts_resumed", 1)
        outputs = run(server, "partial_two_hosts_resumed", 2)
    assert all("resumed from step 1" in output for output in outputs)
    reference = result(searching_runs, "partial_two_hosts", policy[0])
    assert reference[0][0]["rollout/partial/carried"] > 0 and reference[0][1]["rollout/partial/resumed"] > 0
    assert_same_run(result(searching_runs, "partial_two_hosts_resumed", policy[0]), reference)


@pytest.mark.slow
def test_a_resume_with_another_group_size_drops_the_carried_conversations_with_a_count_and_a_warning(searching_runs):
    """Issue 66: a partial run resumed with another data.samples_per_prompt lost 28 of 64 carried conversations,
    counted nowhere (its groups of the old size were laid out as groups of the new one). A started group of the old
    size cannot be trained as a group of the new one: each of its started conversations is dropped and counted
    (`partial/dropped_group_size`, on the budget line), in one warning line."""
    saved = {**CARRYING, "data__samples_per_prompt": 2, "train__checkpoint_every": 1}
    run_dir = searching_runs.run_dir("partial_group_size")
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), "partial_group_size", **saved, train__total_steps=1)],
               TIMEOUT_S)
        (output,) = finish([searching_runs.start(server.config(), "partial_group_size",
                                                 **{**saved, "data__samples_per_prompt": 1}, train__total_steps=2)],
                           TIMEOUT_S)
    first, second = read_metrics(run_dir)
    carried, groups = int(first["rollout/partial/carried"]), int(first["rollout/partial/carried_groups"])
    assert carried > groups > 0  # groups of 2 carried, some with both samples started
    assert (second.get("rollout/partial/dropped_group_size"), second["rollout/partial/resumed"],
            second["rollout/partial/dropped"]) == (carried, 0, 0)
    assert output.count("carried conversation(s)") == 1
    assert (f"step 2: dropped {carried} carried conversation(s) of {groups} group(s) sampled as groups of another "
            "size than data.samples_per_prompt = 1") in output
    assert (f"{carried} conversations dropped (sampled in groups of another data.samples_per_prompt)"
            in output.split("step 2 budget: ")[1].splitlines()[0])
