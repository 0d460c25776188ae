"""`llama-wrapper plan` without a server: a binary that is not on PATH, a backend other than this build's
(a Gemma 3 27B-shaped GGUF on a 24 GiB CUDA GPU), what -ngl offloads on a CPU-only build, and nothing written."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner, Result
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from hooks.degrade.memory import MiB
from hooks.degrade.pool.folder import Member, Pool
from wrapper.cli.main import main
from wrapper.configuration.config import ConfigError, parse_config
from wrapper.launching.flags import planning
from wrapper.launching.launch import prepare

GiB = 1 << 30
Q4_K, Q6_K, F32 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32


TensorRow = tuple[str, tuple[int, ...], GGMLQuantizationType]


def header_only_gguf(path: Path, arch: str, keys: dict[str, int], tensors: Sequence[TensorRow]) -> str:
    """A GGUF with this header and tensor table and no tensor data: what the planner reads, a few KB on disk.
    `tensors`: name, ggml shape (ne0 first), type."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name, shape, kind in tensors:
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shape)) // block * size
        writer.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return str(path)


def gemma3_27b(path: Path) -> str:
    """Gemma 3 27B's shape (its config.json): embedding 5376, 62 blocks, 32 heads, 16 KV heads of 128, a
    sliding window of 1024 (5 of every 6 layers), feed-forward 21504, trained context 131072; tensor types
    as llama.cpp's Q4_K_M mix picks them (Q6_K for attn_v and ffn_down on the layers `use_more_bits` names),
    about 16.5 GB of weights."""
    embd, n_layer, heads, kv_heads, head, ff, vocab = 5376, 62, 32, 16, 128, 21504, 262208

    def more_bits(il: int) -> bool:
        return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2

    tensors: list[TensorRow] = [
        ("token_embd.weight", (embd, vocab), Q6_K), ("output_norm.weight", (embd,), F32)]
    for il in range(n_layer):
        wide = Q6_K if more_bits(il) else Q4_K
        tensors += [(f"blk.{il}.attn_q.weight", (embd, heads * head), Q4_K),
                    (f"blk.{il}.attn_k.weight", (embd, kv_heads * head), Q4_K),
                    (f"blk.{il}.attn_v.weight", (embd, kv_heads * head), wide),
                    (f"blk.{il}.attn_output.weight", (heads * head, embd), Q4_K),
                    (f"blk.{il}.ffn_gate.weight", (embd, ff), Q4_K), (f"blk.{il}.ffn_up.weight", (embd, ff), Q4_K),
                    (f"blk.{il}.ffn_down.weight", (ff, embd), wide)]
        tensors += [(f"blk.{il}.{norm}.weight", (size,), F32) for norm, size in (
            ("attn_norm", embd), ("post_attention_norm", embd), ("ffn_norm", embd), ("post_ffw_norm", embd),
            ("attn_q_norm", head), ("attn_k_norm", head))]
    keys = {"context_length": 131072, "embedding_length": embd, "block_count": n_layer, "feed_forward_length": ff,
            "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": head,
            "attention.value_length": head, "attention.sliding_window": 1024}
    return header_only_gguf(path, "gemma3", keys, tensors)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME, the user cache and PATH in a tmp folder (no llama-server, no nvidia-smi on PATH)."""
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setenv("PATH", str(home / "bin"))
    monkeypatch.delenv("LLAMA_WRAPPER_CONFIG", raising=False)
    return home


def plan_cli(*argv: str) -> Result:
    return CliRunner().invoke(main, ["plan", *argv], catch_exceptions=False)


def fake_server(home: Path, devices: str) -> str:
    """A llama-server that answers --help (the flags the ladder and the slots use) and --list-devices."""
    script = home / "bin" / "llama-server"
    flags = ("-m", "-c", "-ngl", "-ctk", "-ctv", "-fa", "--swa-full", "--slot-save-path", "-kvu",
             "--no-cache-idle-slots", "--no-mmproj-offload", "-lv", "--metrics")
    help_text = "\n".join(f"{flag} N    a flag" for flag in flags)
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--list-devices" ]; then printf 'Available devices:\\n{devices}\\n'; exit 0; fi
cat <<'EOF'
{help_text}
EOF
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- another machine: a Gemma 3 27B-shaped file on a 24 GiB CUDA GPU ----------------------------------------

@pytest.mark.parametrize(("extra", "kv_gib"), [
    (("--swa-full",), 15.5), ((), 3.11), (("--swa-full", "-ctk", "q8_0", "-ctv", "q8_0"), 8.23),
    (("-ctk", "q8_0", "-ctv", "q8_0"), 1.65)], ids=["f16-swa-full", "f16", "q8_0-swa-full", "q8_0"])
def test_a_27b_gemma_on_a_24gib_cuda_gpu(home: Path, extra: tuple[str, ...], kv_gib: float) -> None:
    model = gemma3_27b(home / "gemma-3-27b-it-Q4_K_M.gguf")
    assert os.path.getsize(model) < MiB  # a header only
    result = plan_cli("--backend", "cuda", "--budget", "24GiB", "--json", "--", "llama-server", "-m", model,
                      "-ngl", "99", "-c", "32768", *extra)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    current = report["current"]
    assert current["n_ctx"] == 32768 and report["budget"]["device"] == "GPU"
    assert current["bytes"]["kv"] / GiB == pytest.approx(kv_gib, abs=0.01)
    gpu = current["devices"]["GPU"]
    assert gpu["kv"] == current["bytes"]["kv"]  # every layer's cache on the GPU
    assert gpu["other"] >= 600 * MiB  # the CUDA context
    embeddings = 5376 * 262208 * 210 // 256  # token_embd at Q6_K: on the CPU, and again as the (tied) output
    assert current["devices"]["CPU"]["weights"] == pytest.approx(embeddings, rel=0.001)
    assert gpu["weights"] / 1e9 == pytest.approx(16.5, abs=0.1)  # every layer and the output: the whole file
    assert report["device"] == {"backend": "cuda", "source": "--backend", "listed": None, "gpu_layers": 63}
    assert report["notes"][0].startswith("llama-server not found: planned as if it has every flag")


def test_the_27b_table_says_where_the_layers_go(home: Path) -> None:
    model = gemma3_27b(home / "gemma-3-27b-it-Q4_K_M.gguf")
    result = plan_cli("--backend", "cuda", "--budget", "24GiB", "--", "llama-server", "-m", model, "-ngl", "99",
                      "-c", "32768", "--swa-full")
    lines = result.output.splitlines()
    assert lines[0] == "model: gemma3, 62 layers, trained context 131072, sliding window 1024"
    assert lines[1] == "budget: 24.00 GiB on the GPU (--budget)"
    assert "device: cuda GPU (--backend): -ngl 99 offloads all 62 layers and the output layer" in lines
    assert ("as given: -c 32768 needs 31.76 GiB on the GPU (weights 15.40 GiB, KV 15.50 GiB, compute 274.0 MiB, "
            "other 600.0 MiB), and 1.18 GiB on the CPU") in lines
    assert lines[6].endswith("figures (bytes on the GPU)")
    as_given = next(line for line in lines if line.startswith("as-given"))
    assert as_given.split()[1:5] == ["16,384", "-", "15.40G", "8.57G"]  # the largest -c under 24 GiB
    swa = next(line for line in lines if line.startswith("swa-window"))
    assert "32,768" in swa  # dropping --swa-full fits the whole -c


def test_another_machine_needs_its_memory(home: Path) -> None:
    model = gemma3_27b(home / "g.gguf")
    for budget in ((), ("--budget", "auto")):
        result = CliRunner().invoke(main, ["plan", "--backend", "cuda", *budget, "--", "llama-server", "-m", model])
        assert result.exit_code == 2 and "give its memory with --budget SIZE" in result.output


# -- a CPU-only build, a missing binary -------------------------------------------------------------------

def test_a_cpu_only_build_says_ngl_offloads_nothing(home: Path) -> None:
    server = fake_server(home, "  (none)")
    model = gemma3_27b(home / "g.gguf")
    result = plan_cli("--budget", "40GiB", "--", server, "-m", model, "-ngl", "99", "-c", "8192")
    assert result.exit_code == 0, result.output
    assert ("device: CPU (this llama-server build has no GPU backend, so -ngl 99 offloads nothing; plan for a GPU "
            "with --backend cuda|vulkan|metal --budget SIZE)") in result.output.splitlines()
    assert "budget: 40.00 GiB on the CPU (--budget)" in result.output and "not found" not in result.output


def test_a_build_that_lists_a_gpu_offloads_to_it(home: Path) -> None:
    server = fake_server(home, "  CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free)")
    model = gemma3_27b(home / "g.gguf")
    result = plan_cli("--budget", "24GiB", "--json", "--", server, "-m", model, "-ngl", "31", "-c", "8192")
    report = json.loads(result.output)
    assert report["budget"]["device"] == "GPU" and report["device"]["gpu_layers"] == 31
    assert report["notes"] == ["device: CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free) (--list-devices): "
                               "-ngl 31 offloads 31 of 62 layers"]


def test_the_readme_example_plans_without_llama_server_on_path(home: Path) -> None:
    model = gemma3_27b(home / "g.gguf")
    result = plan_cli("--budget", "40GiB", "--", "llama-server", "-m", model, "-c", "4096")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[2] == "llama-server not found: planned as if it has every flag; give its path to check them"
    assert lines[3].startswith("device: CPU (llama-server's devices are unknown; plan for a GPU with --backend")


def test_only_a_plan_goes_without_the_binary(home: Path) -> None:
    model = gemma3_27b(home / "g.gguf")
    config = replace(parse_config("", "<test>"), argv=("llama-server", "-m", model))
    with pytest.raises(ConfigError, match="not an executable or not on PATH"):
        prepare(config)  # what `run` and `check` do
    with planning():
        assert prepare(config).argv[0] == "llama-server"


# -- nothing written --------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_server", [False, True], ids=["not-on-path", "fake-server"])
def test_plan_creates_nothing(home: Path, with_server: bool) -> None:
    server = fake_server(home, "  (none)") if with_server else "llama-server"
    model = gemma3_27b(home / "g.gguf")
    config = home / "hooks.yaml"
    config.write_text(f"""slots:
  dir: {home / "slots"}
hooks:
  on_startup:
    - builtin: slots.restore
  on_will_stop:
    - builtin: slots.save
""")
    before = tree(home)
    result = plan_cli("--budget", "40GiB", "--config", str(config), "--", server, "-m", model)
    assert result.exit_code == 0, result.output
    assert "sliding window 1024" in result.output
    swa = next(line for line in result.output.splitlines() if line.startswith("swa-window"))
    assert "skipped" not in swa  # the slots' --swa-full was added, so the ladder can drop it
    assert tree(home) == before  # no slot folder, no cached --help or --list-devices


# -- a new member of a pool -------------------------------------------------------------------------------

def test_plan_for_a_pool_plans_a_new_member_under_what_is_free_and_writes_nothing(home: Path) -> None:
    model = gemma3_27b(home / "g.gguf")
    pool = home / "pool"
    empty = plan_cli("--budget", "40GiB", "--pool", str(pool), "--", "llama-server", "-m", model, "-c", "4096")
    assert empty.exit_code == 0, empty.output
    assert "no pool there yet: the first member to start makes it" in empty.output
    assert not pool.exists()  # nothing made
    with Pool(pool).locked() as held:
        held.join(40 * GiB, "degrade.budget", "CPU", True)
        held.put(Member(os.getpid(), "chat", 10 * GiB, 8 * GiB, rung="as-given", n_ctx=8192, serving=True))
    before = tree(pool)
    shown = plan_cli("--json", "--pool", str(pool), "--", "llama-server", "-m", model, "-c", "4096")
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    assert report["budget"]["bytes"] == 30 * GiB  # what the pool has free
    assert report["pool"]["free"] == 30 * GiB and [m["name"] for m in report["pool"]["members"]] == [
        f"chat[{os.getpid()}]"]
    new = report["pool"]["new_member"]
    assert new["n_ctx"] == 4096 and 0 < new["share"] <= 30 * GiB
    table = plan_cli("--pool", str(pool), "--", "llama-server", "-m", model, "-c", "4096").output
    assert f"pool {pool}: 40.00 GiB on the CPU, 10.00 GiB used by 1 member(s), 30.00 GiB free" in table
    assert "a new member takes" in table
    assert tree(pool) == before


def test_a_flag_the_binary_does_not_know_is_refused_as_run_would_be(home: Path) -> None:
    server = str(home / "bin" / "llama-server")  # its --help by the shell alone: PATH has nothing else
    Path(server).write_text("#!/bin/sh\nprintf -- '-m FNAME  the model\\n-c N  the context\\n-ngl N  layers\\n'\n")
    Path(server).chmod(0o755)
    model = gemma3_27b(home / "g.gguf")
    result = plan_cli("--budget", "40GiB", "--", server, "-m", model, "-c", "8192", "--no-such", "-ngl", "-1")
    assert result.exit_code != 0
    assert f"{server} does not know --no-such (its --help does not list it)" in result.output
    assert plan_cli("--budget", "40GiB", "--", server, "-m", model, "-c=8192", "-ngl", "-1").exit_code == 0
