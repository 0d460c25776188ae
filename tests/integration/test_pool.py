"""Two real wrappers, two real servers, one pool (`degrade.pool`): the task model's long request is answered
with memory the main model gives up (its projector, then its draft) and gets back once the task is idle; both
conversations come back; a member killed is noticed and its share taken."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tests import pooled
from tests.helpers import Wrapper, http, wait_for

TURN = [{"role": "user", "content": "Remember this story. " + pooled.STORY * 30}]


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pooled.make_projector(tmp_path_factory.mktemp("mmproj"))


def test_the_task_grows_on_what_the_main_gives_up_and_the_main_gets_it_back(
        tmp_path: Path, server_bin: str, demo_path: str, projector: Path) -> None:
    pair = pooled.start_pair(tmp_path, server_bin, demo_path, projector)
    try:
        pair.watch()
        for wrapper in (pair.main, pair.task):  # the first member and the one that joined say the same budget
            said = wrapper.status()["degrade"]
            assert said["budget"] == pair.total and 0 < said["pool"]["available"] <= pair.total, said
            assert pooled.memory(wrapper)["budget"]["bytes"] == pair.total
        pooled.load_projector(pair.main)
        status, first = pooled.chat(pair.main.url, TURN)
        assert status == 200, first
        main_history = [*TURN, first["choices"][0]["message"]]
        long_turn = [{"role": "user", "content": pooled.LONG}]
        answers: dict[str, Any] = {}

        def task_request() -> None:
            answers["task"] = pooled.chat(pair.task.url, long_turn)

        asking = threading.Thread(target=task_request)
        asking.start()
        wait_for(lambda: any(a for a in pair.main.events("pool.gave")) or not asking.is_alive(), 120,
                 "the main to give")
        status, meanwhile = pooled.chat(pair.main.url, [{"role": "user", "content": "Say hello."}])
        assert status == 200, meanwhile  # the main answered while (or right after) it gave
        asking.join(300)
        status, long_answer = answers["task"]
        assert status == 200, long_answer
        assert long_answer["timings"]["prompt_n"] > pooled.TASK_CONTEXT  # it did not fit the task's own context

        gave = pair.main.events("pool.gave")
        assert gave and "the projector" in gave[0]["what"] and "disable-spec" in gave[0]["what"], gave
        main_argv = pooled.argv_of(pair.main)
        assert "--mmproj" not in main_argv and "-md" not in main_argv
        moved = pooled.memory(pair.task)["pool"]["moves"]
        assert moved and moved[-1]["given"] >= moved[-1]["asked"] > 0, moved
        assert pair.sums and max(pair.sums) <= pair.total, (max(pair.sums), pair.total)

        # the task idle: it gives back what it grew for, the main climbs back to its projector and its draft
        wait_for(lambda: pair.task.events("pool.back"), 60, "the task to give back its context")
        wait_for(lambda: "--mmproj" in pooled.argv_of(pair.main) and "-md" in pooled.argv_of(pair.main), 60,
                 "the main to get its projector and draft back")
        assert max(pair.sums) <= pair.total

        # the next turn of each conversation reuses its history
        main_history.append({"role": "user", "content": "Who wrote the names?"})
        status, again = pooled.chat(pair.main.url, main_history)
        assert status == 200 and again["timings"]["cache_n"] >= 0.95 * first["timings"]["prompt_n"], again
        task_history = [*long_turn, long_answer["choices"][0]["message"], {"role": "user", "content": "Shorter."}]
        status, task_again = pooled.chat(pair.task.url, task_history)
        assert status == 200, task_again
        assert task_again["timings"]["cache_n"] >= 0.95 * long_answer["timings"]["prompt_n"], task_again
        assert max(pair.sums) <= pair.total
    finally:
        pair.close()


def test_a_member_killed_frees_its_share_for_the_other(
        tmp_path: Path, server_bin: str, demo_path: str, projector: Path) -> None:
    pair = pooled.start_pair(tmp_path, server_bin, demo_path, projector)
    try:
        main_pid = pair.main.process.pid
        answers: dict[str, Any] = {}
        threading.Thread(target=lambda: answers.update(task=pooled.chat(
            pair.task.url, [{"role": "user", "content": pooled.LONG}])), daemon=True).start()
        wait_for(lambda: pair.main.events("reload.begin"), 60, "the main to begin its move")
        os.killpg(main_pid, signal.SIGKILL)  # in the middle of its move: its reload has begun
        wait_for(lambda: "task" in answers, 300, "the task's answer")
        status, answer = answers["task"]
        assert status == 200, answer
        assert answer["timings"]["prompt_n"] > pooled.TASK_CONTEXT
        assert [r["pid"] for r in pooled.records(pair.pool)] == [pair.task.process.pid]
    finally:
        pair.close()


def test_two_members_growing_at_once_are_both_answered_and_never_overcommit(
        tmp_path: Path, server_bin: str, demo_path: str, projector: Path) -> None:
    _, task_argv = pooled.argvs(server_bin, demo_path, projector)
    rest, long = pooled.share_of(task_argv, pooled.TASK_CONTEXT), pooled.share_of(task_argv, pooled.LONG_NEEDS)
    total = 2 * rest + (long - rest) * 3 // 2  # room for one long request, not for two
    pool = tmp_path / "pool"
    members = []
    for name in ("a", "b"):
        config = pooled.config(tmp_path / f"slots-{name}", pool, total, pooled.TASK_CONTEXT)
        members.append(Wrapper(tmp_path, task_argv, config))
    pair = pooled.Pair(members[0], members[1], pool, total)
    try:
        for member in members:
            member.wait_ready(180)
        pair.watch()
        answers: dict[int, tuple[int, dict[str, Any]]] = {}
        threads = [threading.Thread(target=lambda i=i, m=m: answers.update({i: pooled.chat(
            m.url, [{"role": "user", "content": f"Report {i}. " + pooled.LONG}])})) for i, m in enumerate(members)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert sorted(answers) == [0, 1]  # both answered: nobody waited on the other
        statuses = sorted(status for status, _ in answers.values())
        assert statuses[0] == 200, answers  # one grew into the room there is
        for status, answer in answers.values():
            if status != 200:  # the other one is told why, with what the pool had for it
                assert status == 400 and "pool" in answer["error"]["message"], answer
        assert pair.sums and max(pair.sums) <= total, (max(pair.sums), total)
    finally:
        pair.close()


def test_an_idle_members_long_conversation_gives_its_context_and_comes_back_restored(
        tmp_path: Path, server_bin: str, demo_path: str, projector: Path) -> None:
    """A main with no ladder (`ladder: []`): context is all it can give. Its long conversation, idle, is held by
    the conversation cache while the context shrinks for the task; at its next turn the main grows back (the
    task idle by then) and the conversation is restored."""
    _, plain = pooled.argvs(server_bin, demo_path, projector)
    main_share, task_share = pooled.share_of(plain, pooled.MAIN_CONTEXT), pooled.share_of(plain, pooled.TASK_CONTEXT)
    long_share = pooled.share_of(plain, pooled.LONG_NEEDS)
    total = main_share + task_share + (long_share - task_share) // 3  # the task's long request needs the main's
    pool = tmp_path / "pool"
    main = Wrapper(tmp_path, plain, pooled.config(tmp_path / "slots-main", pool, total, pooled.MAIN_CONTEXT,
                                                  extra=", ladder: []"))
    task = Wrapper(tmp_path, plain, pooled.config(tmp_path / "slots-task", pool, total, pooled.TASK_CONTEXT, "3s"))
    pair = pooled.Pair(main, task, pool, total)
    try:
        main.wait_ready(180)
        task.wait_ready(180)
        pair.watch()
        story = [{"role": "user", "content": "Remember this story. " + pooled.STORY * 80}]  # ~1.5k tokens
        status, first = pooled.chat(main.url, story)
        assert status == 200, first
        assert first["timings"]["prompt_n"] > pooled.TASK_CONTEXT
        status, long_answer = pooled.chat(task.url, [{"role": "user", "content": pooled.LONG}])
        assert status == 200, long_answer
        gave = main.events("pool.gave")
        assert gave and "n_ctx 2048 ->" in gave[0]["what"], gave
        assert pooled.memory(main)["n_ctx"] < first["timings"]["prompt_n"]  # the conversation no longer fits
        wait_for(lambda: task.events("pool.back"), 60, "the task to give back its context")
        history = [*story, first["choices"][0]["message"], {"role": "user", "content": "Who kept the ledger?"}]
        status, again = pooled.chat(main.url, history)
        assert status == 200, again
        assert again["timings"]["cache_n"] >= 0.95 * first["timings"]["prompt_n"], again["timings"]
        assert max(pair.sums) <= total
    finally:
        pair.close()


def test_a_pool_members_budget_is_the_pools(tmp_path: Path, server_bin: str, demo_path: str,
                                            projector: Path) -> None:
    _, plain = pooled.argvs(server_bin, demo_path, projector)
    config = pooled.config(tmp_path / "slots", tmp_path / "pool", 600 << 20, pooled.TASK_CONTEXT)
    config += "admin: {token_file: %s}\n" % (tmp_path / "token")
    (tmp_path / "token").write_text("s3cret\n")
    member = Wrapper(tmp_path, plain, config)
    try:
        member.wait_ready(120)
        status, _, raw = http("POST", f"{member.url}/wrapper/budget", {"budget": "1GiB"},
                              headers={"Authorization": "Bearer s3cret"})
        assert status == 409 and b"shares the pool" in raw, raw
        assert pooled.records(tmp_path / "pool")[0]["share"] > 0  # nothing changed
    finally:
        member.kill()
