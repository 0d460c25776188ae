"""The degradation ladder on the H200 table's model: rungs, their contexts under a budget, the choice."""

from __future__ import annotations

from hooks.degrade.ladder import Planner, build, choose
from hooks.degrade.memory import Choices, plan
from hooks.degrade.settings import Rung
from hooks.degrade.state import context_for
from tests.unit.degrade.test_memory import h200_model

LADDER = tuple(Rung(n) for n in ("disable-spec", "mmproj-to-cpu", "quantize-kv-q8", "quantize-kv-q4", "swa-window"))


def planner(budget: int) -> Planner:
    return Planner(h200_model(), gpu=True, budget=budget, ceiling=131072)


def test_each_rung_fits_more_context_under_the_same_budget() -> None:
    budget = plan(h200_model(), Choices(n_ctx=32768, gpu_layers=99)).total("GPU")
    argv = ["llama-server", "-m", "m.gguf", "-ngl", "99", "-c", "32768"]
    rungs = build(argv, (*LADDER, Rung("small-batch", {"-ub": "256"})), planner(budget), None, argv, False)
    by_name = {r.name: r for r in rungs}
    assert by_name["as-given"].max_ctx == 32768
    assert by_name["disable-spec"].skipped and by_name["mmproj-to-cpu"].skipped and by_name["swa-window"].skipped
    q8, q4 = by_name["quantize-kv-q8"], by_name["quantize-kv-q4"]
    assert q8.changes == ["-ctk (unset) -> q8_0", "-ctv (unset) -> q8_0"] and "q8_0" in q8.argv
    assert 32768 < q8.max_ctx < q4.max_ctx <= by_name["small-batch"].max_ctx
    assert "-ub" in by_name["small-batch"].argv and "q4_0" in by_name["small-batch"].argv  # cumulative
    assert choose(rungs, 20000) is by_name["as-given"]
    assert choose(rungs, q8.max_ctx) is q8
    assert choose(rungs, 10**7) is None


def test_the_users_cache_type_is_the_floor_and_spec_and_mmproj_rungs_apply() -> None:
    argv = ["llama-server", "-m", "m.gguf", "-ngl", "99", "-ctk", "q8_0", "-ctv", "q8_0", "-md", "draft.gguf",
            "--mmproj", "mm.gguf"]
    rungs = build(argv, LADDER, planner(8 << 30), None, argv, False)
    by_name = {r.name: r for r in rungs}
    assert "the floor" in (by_name["quantize-kv-q8"].skipped or "")
    assert "-md" not in by_name["disable-spec"].argv
    assert "--no-mmproj-offload" in by_name["mmproj-to-cpu"].argv


def test_a_sliding_window_model_can_drop_the_full_window() -> None:
    argv = ["llama-server", "-m", "m.gguf", "--swa-full"]
    rungs = build(argv, LADDER, Planner(h200_model(), gpu=False, budget=8 << 30, ceiling=8192), None, argv, True)
    swa = next(r for r in rungs if r.name == "swa-window")
    assert swa.skipped is None and "--swa-full" not in swa.argv


def test_the_context_a_burst_of_requests_needs() -> None:
    held = [3000, 500, 100]  # what each slot holds (the slot book)
    one_slot = ["llama-server", "-np", "1"]
    assert context_for(one_slot, held, [2000, 4000]) == 4000  # one at a time
    unified = ["llama-server", "-np", "3", "-kvu"]
    # two requests run at once in one KV: their tokens add up, with the conversation they do not replace
    assert context_for(unified, held, [2000, 4000]) == 6000 + 100
    assert context_for(unified, held, [1000, 1000, 1000, 1000]) == 3000  # three run at once
    per_slot = ["llama-server", "-np", "2"]  # every slot its own -c / -np cells
    assert context_for(per_slot, held, [2000, 1500]) == 4000
