"""Job planning (run/jobs.py): phases of one batch size, resume keys; jobs dealt to slots."""

from __future__ import annotations

from pipespec_mpi.config import compose_config
from pipespec_mpi.data.requests import RowSettings
from pipespec_mpi.run.jobs import Prompt, count_jobs, phases, plan_jobs
from pipespec_mpi.stage.deal import END, InTurn, JobQueue

PROMPTS = [Prompt(f"p{i}", [1, 2 + i], i) for i in range(5)]


def test_a_batch_sweep_runs_batch_1_interleaved_then_one_phase_per_method_and_size():
    cfg = compose_config(["hierarchy=tiny", "run.mode=benchmark", "run.methods=[ar,pipespec]",
                          "run.batch_sizes=[1,2]"])  # fmt: skip
    jobs = plan_jobs(cfg, PROMPTS, set())
    groups = phases(jobs)
    assert [(g[0].phase, g[0].batch_size, {j.method for j in g}, len(g)) for g in groups] == [
        (0, 1, {"ar", "pipespec"}, 2),  # warm-up
        (3, 1, {"ar", "pipespec"}, 10),  # A B A B ... (a phase: its first job's number)
        (13, 2, {"ar"}, 5),
        (18, 2, {"pipespec"}, 5),
    ]
    assert [j.method for j in groups[1][:4]] == ["ar", "pipespec", "ar", "pipespec"]
    assert len({j.seq for j in jobs}) == len(jobs)  # the tag of every header and message
    # a later round's phases (numbered on from this round's jobs) are told apart from these
    later = plan_jobs(cfg, PROMPTS, set(), warmups=False, first_seq=len(jobs))
    assert not {j.phase for j in later} & {j.phase for j in jobs}


def test_single_mode_decodes_at_decode_batch_size_and_resume_skips_by_batch_size():
    cfg = compose_config(["hierarchy=tiny", "method=sd", "decode.batch_size=3"])
    jobs = plan_jobs(cfg, PROMPTS, set())
    assert {(j.method, j.batch_size, j.phase) for j in jobs} == {("sd", 3, 1)}  # job 1 begins it
    assert len(phases(jobs)) == 1
    done = {("p0", "sd", 0, 3), ("p1", "sd", 0, 1)}  # p1 was decoded at another batch size
    assert [j.prompt_id for j in plan_jobs(cfg, PROMPTS, done)] == ["p1", "p2", "p3", "p4"]


def test_no_job_drafts_from_its_prompts_output_in_another_phase():
    """A benchmark decodes every prompt in its warm-up and once per (method, batch size): each of
    those jobs has its own drafter job store, so no prompt is drafted from its own earlier output;
    a single-mode job, which decodes each prompt once, keeps one store for the whole job."""
    cfg = compose_config(["hierarchy=tiny", "run.mode=benchmark", "run.methods=[sd,pipespec]",
                          "run.batch_sizes=[1,4]"])  # fmt: skip
    jobs = plan_jobs(cfg, PROMPTS, set())
    for pid in {j.prompt_id for j in jobs}:
        keys = [j.store_key for j in jobs if j.prompt_id == pid]
        assert len(keys) == len(set(keys)), (pid, keys)
    assert {j.store_key for j in jobs} == {
        "sd:warmup", "pipespec:warmup", "sd:b1", "pipespec:b1", "sd:b4", "pipespec:b4"
    }  # fmt: skip
    single = plan_jobs(compose_config(["hierarchy=tiny"]), PROMPTS, set())
    assert {j.store_key for j in single} == {"online:b1"}  # every plan the online plan picks shares it


def test_a_rows_own_budget_rides_with_each_of_its_jobs():
    cfg = compose_config(["hierarchy=tiny", "run.mode=benchmark", "run.methods=[ar,pipespec]"])
    prompts = [Prompt("short", [1, 2], 0, RowSettings(max_tokens=3)), Prompt("plain", [1, 3], 1)]
    jobs = plan_jobs(cfg, prompts, set())
    assert {(j.prompt_id, j.max_new_tokens) for j in jobs} == {("short", 3), ("plain", None)}


def test_rounds_number_their_jobs_as_one_plan_would_and_the_count_is_known_before():
    """A job plans a round of rows at a time (run/rows.py): numbering continues across rounds,
    warm-ups come from the first round only, and ``count_jobs`` (the replica's total, for the
    progress line) equals what the rounds plan."""
    for over in (["method=pipespec"], ["run.mode=benchmark", "run.methods=[ar,sd]", "run.batch_sizes=[1,2]",
                                       "sampling.num_samples=2", "sampling.temperature=0.7"]):  # fmt: skip
        cfg = compose_config(["hierarchy=tiny", *over])
        whole = plan_jobs(cfg, PROMPTS, set())
        assert len(whole) == count_jobs(cfg, len(PROMPTS))
        seq, rounds = 0, []
        for chunk in (PROMPTS[:2], PROMPTS[2:]):
            rounds += plan_jobs(cfg, chunk, set(), warmups=seq == 0, first_seq=seq)
            seq += count_jobs(cfg, len(chunk), warmups=seq == 0)
        assert len({j.seq for j in rounds}) == len(rounds) == count_jobs(cfg, len(PROMPTS))
        assert sum(j.warmup for j in rounds) == sum(j.warmup for j in whole)
        assert seq == max(j.seq for j in rounds)


def test_a_shared_queue_hands_each_job_once_in_order_then_end():
    q = JobQueue(3)
    assert [q.claim() for _ in range(5)] == [0, 1, 2, END, END]


def test_in_turn_deals_a_slot_every_slots_th_job():
    for slot, want in ((0, [0, 2, 4]), (1, [1, 3])):
        d, got = InTurn(5, slot, 2), []
        while True:
            d.open()
            if (i := d.dealt()) == END:
                break
            got.append(i)
        assert got == want
