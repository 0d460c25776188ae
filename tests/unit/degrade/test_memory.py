"""The planner against what a server reported: the H200 table (tests/data, a copy of ../shared/data); and the
calibration from the server's own buffer lines."""

from __future__ import annotations

import csv
import re
from dataclasses import replace
from pathlib import Path

import pytest

from hooks.degrade.calibration import Measured, calibrated, device_of, load, remember
from hooks.degrade.memory import Choices, MiB, ModelShape, Plan, largest_ctx, plan

DATA = Path(__file__).resolve().parents[2] / "data" / "h200-kv-sweep.csv"  # a copy of ../shared/data


def h200_model() -> ModelShape:
    """The table's model: LLaMA, 24 layers, embedding 2048, 4 KV heads of 128, feed-forward 5632, f16."""
    embd, ff, vocab, f16, f32 = 2048, 5632, 32000, 1, 0
    tensors = [("token_embd.weight", embd * vocab * 2, f16), ("output.weight", embd * vocab * 2, f16),
               ("output_norm.weight", embd * 4, f32)]
    for il in range(24):
        for name, values in (("attn_q", embd * embd), ("attn_k", embd * 512), ("attn_v", embd * 512),
                             ("attn_output", embd * embd), ("ffn_gate", embd * ff), ("ffn_up", embd * ff),
                             ("ffn_down", embd * ff)):
            tensors.append((f"blk.{il}.{name}.weight", values * 2, f16))
        tensors += [(f"blk.{il}.attn_norm.weight", embd * 4, f32), (f"blk.{il}.ffn_norm.weight", embd * 4, f32)]
    return ModelShape("llama", 24, embd, ff, vocab, 131072, 128, 128, (4,) * 24, None, (False,) * 24,
                      tuple(tensors))


def mib(text: str, buffer: str) -> float:
    found = re.search(rf"{buffer}=([\d.]+)", text)
    assert found, (buffer, text)
    return float(found.group(1))


def h200_rows() -> list[dict[str, str]]:
    with DATA.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("row", h200_rows(), ids=lambda r: f"{r['ctx']}-{r['cache']}")
def test_the_plan_matches_the_h200_table(row: dict[str, str]) -> None:
    settings = Choices(n_ctx=int(row["ctx"]), type_k=row["cache"], type_v=row["cache"], gpu_layers=99)
    planned = plan(h200_model(), settings)
    gpu, cpu = planned.devices["GPU"], planned.devices["CPU"]
    assert gpu["weights"] / MiB == pytest.approx(mib(row["model_buf_MiB"], "CUDA0"), rel=0.01)
    assert cpu["weights"] / MiB == pytest.approx(mib(row["model_buf_MiB"], "CPU_Mapped"), rel=0.01)
    assert gpu["kv"] / MiB == pytest.approx(mib(row["kv_buf_MiB"], "CUDA0"), rel=0.01)
    assert planned.total("GPU") / MiB == pytest.approx(float(row["smi_ready"]), rel=0.05)  # nvidia-smi's use


GEMMA_LINES = """\
0.01.0 I load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
0.01.0 I load_tensors:   CPU_REPACK model buffer size =    12.66 MiB
0.01.0 I llama_context: n_ctx                 = 4096
0.01.0 I llama_context:        CPU  output buffer size =     1.00 MiB
0.01.0 I llama_kv_cache:        CPU KV buffer size =    12.00 MiB
0.01.0 I llama_kv_cache:        CPU KV buffer size =    15.00 MiB
0.01.0 I sched_reserve:        CPU compute buffer size =    23.28 MiB
0.02.0 I sched_reserve:        CPU compute buffer size =     5.00 MiB
"""


def test_calibration_reads_the_servers_buffer_lines() -> None:
    measured = Measured()
    for line in GEMMA_LINES.splitlines():
        measured.feed(line)
    cpu = measured.devices["CPU"]
    assert measured.done and measured.n_ctx == 4096
    assert cpu["weights"] == round(247.82 * MiB) and cpu["kv"] == 27 * MiB and cpu["other"] == MiB
    assert cpu["compute"] == round(23.28 * MiB)  # a later compute line (a draft model's) is not this plan's
    assert device_of("CUDA_Host") == "CPU" and device_of("CUDA0") == "GPU" and device_of("Vulkan0") == "GPU"


def test_a_plan_takes_measured_figures_where_it_has_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shape = h200_model()
    at_4k = Choices(n_ctx=4096, gpu_layers=99)
    measured = Measured()
    for line in ("llama_context: n_ctx = 4096", "load_tensors: CUDA0 model buffer size = 2000.00 MiB",
                 "sched_reserve: CUDA0 compute buffer size = 70.00 MiB"):
        measured.feed(line)
    remember("model-a", measured, at_4k)
    runs = load("model-a")
    assert len(runs) == 1 and runs[0].settings["n_ctx"] == 4096

    def predict(s: Choices) -> Plan:
        return plan(shape, s)

    at_8k = Choices(n_ctx=8192, gpu_layers=99)
    adjusted = calibrated(predict(at_8k), at_8k, runs, predict)
    assert adjusted.devices["GPU"]["weights"] == 2000 * MiB and "GPU.weights" in adjusted.measured
    moved = predict(at_8k).devices["GPU"]["compute"] - predict(at_4k).devices["GPU"]["compute"]
    assert adjusted.devices["GPU"]["compute"] == 70 * MiB + moved  # measured, moved by the predicted slope
    other_types = Choices(n_ctx=8192, type_k="q8_0", type_v="q8_0", gpu_layers=99)
    assert "GPU.compute" not in calibrated(predict(other_types), other_types, runs, predict).measured


def test_the_largest_context_is_the_last_that_fits() -> None:
    shape = h200_model()
    settings = Choices(n_ctx=4096, gpu_layers=99)
    budget = plan(shape, Choices(n_ctx=32768, gpu_layers=99)).total("GPU")
    assert largest_ctx(shape, settings, budget, ceiling=131072) == 32768
    assert largest_ctx(shape, settings, budget - 1, ceiling=131072) == 32768 - 256
    assert largest_ctx(shape, settings, budget, ceiling=8192) == 8192
    assert largest_ctx(shape, settings, 1000, ceiling=8192) == 0


def test_tied_embeddings_are_copied_to_the_gpu_with_the_output_layer() -> None:
    """Without output.weight llama.cpp loads token_embd again as the output layer, in that layer's buffer: on
    the GPU once every layer is offloaded (on the CPU it is the same tensor, counted once)."""
    full = h200_model()
    tied = replace(full, tensors=tuple(t for t in full.tensors if t[0] != "output.weight"))
    embeddings = 2048 * 32000 * 2
    layers_only, with_output = (plan(tied, Choices(n_ctx=4096, gpu_layers=n)) for n in (24, 25))
    assert with_output.devices["GPU"]["weights"] - layers_only.devices["GPU"]["weights"] == embeddings + 2048 * 4
    assert with_output.devices["CPU"]["weights"] == embeddings  # token_embd stays on the CPU as well
    on_cpu = plan(tied, Choices(n_ctx=4096))
    assert on_cpu.devices["CPU"]["weights"] == tied.weights_bytes
    untied = plan(full, Choices(n_ctx=4096, gpu_layers=25))
    assert untied.devices["GPU"]["weights"] == with_output.devices["GPU"]["weights"]  # output.weight's place
