"""The shipped examples a newcomer copies: each wrapper config passes `check` without a warning, each llama-swap
config parses and runs the wrapper as llama-swap would, the README shows them as they are, and the recipe's
numbers are what `plan` says."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import docs
from tests.swap import expand, recipe_block
from tests.unit.degrade.test_plan_cli import gemma3_27b
from wrapper.configuration.units import parse_duration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
README = docs.text()  # the README, then docs/: a block is looked for in all of them


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    return subprocess.run([sys.executable, "-m", "wrapper.cli", *args], capture_output=True, text=True,
                          check=False, env=env, cwd=ROOT)


def _readme_block(first_line: str) -> Any:
    """The YAML block of the README or docs/ that starts with `first_line`, parsed."""
    for block in re.findall(r"```yaml\n(.*?)```", README, re.S):
        if block.startswith(first_line):
            return yaml.safe_load(block)
    raise AssertionError(f"no README block starts with {first_line!r}")


def _wrapper_argv(cmd: str) -> tuple[list[str], list[str]]:
    """A llama-swap cmd split as llama-swap splits it (shell-style, `#` lines dropped): the wrapper's words, and
    the llama-server command after `--`."""
    words = shlex.split("\n".join(line for line in cmd.splitlines() if not line.lstrip().startswith("#")))
    cut = words.index("--")
    return words[:cut], words[cut + 1:]


@pytest.mark.parametrize("name", ["chat.yaml", "gemma-27b.yaml", "hooks.yaml", "media.yaml", "spec.yaml", "store.yaml",
                                  "team.yaml"])
def test_each_wrapper_config_passes_check_without_a_warning(name: str, tmp_path: Path) -> None:
    done = _cli("check", str(EXAMPLES / name), home=tmp_path)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr


def _cmd(swap: dict[str, Any], model: str) -> str:
    """A model's cmd with the config's macros replaced, as llama-swap replaces them."""
    return expand(swap["models"][model]["cmd"], swap.get("macros") or {})


@pytest.mark.parametrize(("name", "config", "model_id"), [("llama-swap.yaml", "chat.yaml", "chat"),
                                                       ("llama-swap.yaml", "chat.yaml", "task"),
                                                       ("llama-swap-27b.yaml", "gemma-27b.yaml", "gemma-27b")])
def test_each_llama_swap_config_runs_the_wrapper_with_budgets_that_cover_it(name: str, config: str,
                                                                            model_id: str) -> None:
    swap = yaml.safe_load((EXAMPLES / name).read_text())
    model = swap["models"][model_id]
    wrapper, server = _wrapper_argv(_cmd(swap, model_id))
    assert wrapper[0].endswith("llama-wrapper") and wrapper[1] == "run"
    assert wrapper[wrapper.index("--listen") + 1] == "127.0.0.1:${PORT}"
    assert Path(wrapper[wrapper.index("--config") + 1]).name == config
    assert server[0].endswith("llama-server") and "-m" in server
    assert model["proxy"] == "http://127.0.0.1:${PORT}"
    settings = yaml.safe_load((EXAMPLES / config).read_text())
    save = next(a for a in settings["hooks"]["on_will_stop"] if a.get("builtin") == "slots.save")
    stop_s = parse_duration(settings.get("server", {}).get("stop_timeout", "10s"))
    assert model["unloadTimeout"] > parse_duration(save["timeout"]) + stop_s  # the save fits the unload
    restore = next(a for a in settings["hooks"]["on_startup"] if a.get("builtin") == "slots.restore")
    drain_s = parse_duration(settings.get("server", {}).get("drain_timeout", "5s"))
    assert model["unloadTimeout"] > drain_s + parse_duration(save["timeout"]) + stop_s
    assert parse_duration(settings["server"]["stop_budget"]) == model["unloadTimeout"]  # its warning knows the grace
    ready_s = parse_duration(settings.get("server", {}).get("ready_timeout", "300s"))
    assert swap["healthCheckTimeout"] >= ready_s + parse_duration(restore.get("timeout", "30s"))


def test_the_readme_shows_the_examples_as_they_are() -> None:
    assert _readme_block("# examples/chat.yaml") == yaml.safe_load((EXAMPLES / "chat.yaml").read_text())
    assert _readme_block("# examples/llama-swap-27b.yaml") == yaml.safe_load(
        (EXAMPLES / "llama-swap-27b.yaml").read_text())
    assert _readme_block("# examples/gemma-27b.yaml") == yaml.safe_load((EXAMPLES / "gemma-27b.yaml").read_text())
    assert _readme_block("# examples/store.yaml") == yaml.safe_load((EXAMPLES / "store.yaml").read_text())
    assert _readme_block("# A model a team shares") == yaml.safe_load((EXAMPLES / "team.yaml").read_text())
    quick = _readme_block("# llama-swap's config.yaml")  # the quick start's: the same budgets as the example's
    example = yaml.safe_load((EXAMPLES / "llama-swap.yaml").read_text())
    assert quick["healthCheckTimeout"] == example["healthCheckTimeout"]
    assert quick["models"]["chat"]["unloadTimeout"] == example["models"]["chat"]["unloadTimeout"]
    assert _wrapper_argv(quick["models"]["chat"]["cmd"])[0] == _wrapper_argv(_cmd(example, "chat"))[0]


def test_the_recipe_shows_the_config_the_tests_run_and_its_additions_fit_it(tmp_path: Path) -> None:
    """docs/recipes/llama-swap.md shows examples/llama-swap.yaml as it is (the integration tests under llama-swap
    run that file); its group names the example's models, and its pool block makes a wrapper config that passes
    `check` once added to examples/chat.yaml, as the test under llama-swap adds it."""
    example = yaml.safe_load((EXAMPLES / "llama-swap.yaml").read_text())
    assert _readme_block("# examples/llama-swap.yaml") == example
    together = recipe_block("# both at once")
    (group,) = together["groups"].values()
    assert group["swap"] is False and set(group["members"]) == set(example["models"])
    pooled = tmp_path / "chat-pool.yaml"
    pooled.write_text(yaml.safe_dump({**yaml.safe_load((EXAMPLES / "chat.yaml").read_text()),
                                      **recipe_block("# one pool for both")}))
    done = _cli("check", str(pooled), home=tmp_path)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    assert "pool" in done.stdout, done.stdout


def test_the_recipe_fits_the_card_as_the_readme_says(tmp_path: Path) -> None:
    """The llama-swap command of the recipe, planned for its 24 GiB CUDA card with the wrapper's config, on a
    file of Gemma 3 27B's shape: the rungs and contexts the README quotes, and nothing written."""
    swap = yaml.safe_load((EXAMPLES / "llama-swap-27b.yaml").read_text())
    _, server = _wrapper_argv(swap["models"]["gemma-27b"]["cmd"])
    server[server.index("-m") + 1] = gemma3_27b(tmp_path / "gemma-3-27b-it-Q4_K_M.gguf")
    home = tmp_path / "home"
    done = _cli("plan", "--backend", "cuda", "--config", str(EXAMPLES / "gemma-27b.yaml"), "--", *server, home=home)
    assert done.returncode == 0, done.stderr
    rungs = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()
             if line.startswith(("as-given", "quantize-kv"))}
    assert rungs == {"as-given": "14,080", "quantize-kv-q8": "25,856", "quantize-kv-q4": "32,768"}
    for figure in rungs.values():
        assert figure in README
    assert "KV 15.50 GiB" in done.stdout and "| 15.50 GiB | 31.76 GiB |" in README
    assert not home.exists() or not any(home.rglob("*"))
    assert not Path("/var/lib/llama-wrapper").exists()  # the recipe's slots.dir: plan makes no folder
