from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hooks.degrade.settings import DEGRADE
from hooks.slots.settings import SLOTS
from wrapper import built_ins
from wrapper.built_ins import load as load_config
from wrapper.built_ins import parse as parse_config
from wrapper.configuration.config import ConfigError, Listen, parse_listen
from wrapper.configuration.units import parse_duration, parse_size

FULL = """\
listen: 127.0.0.1:9000
server:
  argv: [llama-server, -m, /models/chat.gguf, -c, 32768]
  ready_timeout: 2m
  stop_timeout: 15s
  env: {LLAMA_ATTN_ROT_DISABLE: 1}
slots:
  dir: /var/lib/slots
  swa_full: always
proxy:
  allow_slot_actions: true
hooks:
  on_will_start:
    - shell: mkdir -p /var/lib/llm
  on_startup:
    - builtin: slots.restore
    - name: warm-up
      http: {method: POST, url: "{{ server.url }}/completion", json: {prompt: hi, n_predict: 1}}
      timeout: 30s
      retries: 2
  on_will_stop:
    - builtin: slots.save
  on_stopped:
    - exec: [notify-send, "{{ model.name }} stopped: {{ result }}"]
      ignore_errors: true
      when: result != "success"
"""


def test_full_config_reads_every_key() -> None:
    config = parse_config(FULL, "c.yaml")
    assert config.listen == Listen("127.0.0.1", 9000)
    assert config.argv == ("llama-server", "-m", "/models/chat.gguf", "-c", "32768")
    assert (config.ready_timeout, config.stop_timeout) == (120.0, 15.0)
    assert config.env == {"LLAMA_ATTN_ROT_DISABLE": "1"}
    assert str(SLOTS.of(config).dir) == "/var/lib/slots" and SLOTS.of(config).swa_full == "always"
    assert config.allow_slot_actions is True
    warm = config.hooks["on_startup"][1]
    assert (warm.kind, warm.name, warm.retries, warm.where) == ("http", "warm-up", 2, "c.yaml:17")
    assert warm.http is not None and warm.http.method == "POST" and warm.http.json == {"prompt": "hi", "n_predict": 1}
    stopped = config.hooks["on_stopped"][0]
    assert stopped.exec == ("notify-send", "{{ model.name }} stopped: {{ result }}")
    assert stopped.ignore_errors and stopped.when == 'result != "success"'
    assert config.uses("slots")


def test_empty_config_is_all_defaults() -> None:
    config = parse_config("", "empty.yaml")
    assert config.listen is None and config.ready_timeout == 300 and config.stop_timeout == 10
    assert not config.uses("slots") and all(not actions for actions in config.hooks.values())


@pytest.mark.parametrize(("text", "message"), [
    ("hooks:\n  on_startpu: []\n", "c.yaml:2: unknown key 'on_startpu' in hooks (did you mean 'on_startup'?)"),
    ("server:\n  argv: [x]\n  stop_timout: 3s\n", "c.yaml:3: unknown key 'stop_timout' in server (did you mean"),
    ("server:\n  ready_timeout: soon\n", "c.yaml:2: server.ready_timeout: not a duration: 'soon'"),
    ("listen: 8080\n", "c.yaml:1: listen: write HOST:PORT"),
    ("listen: localhost\n", "c.yaml:1: listen: write HOST:PORT with a port in 1-65535 (e.g. 127.0.0.1:8080), "
                            "not 'localhost'"),
    ("hooks:\n  on_startup:\n    - name: x\n", "c.yaml:3: hooks.on_startup[0] needs exactly one of http, shell"),
    ("hooks:\n  on_startup:\n    - shell: a\n      exec: [b]\n",
     "needs exactly one of http, shell, exec, builtin (found 2)"),
    ("hooks:\n  on_startup:\n    - http: {method: GET}\n", "c.yaml:3: hooks.on_startup[0].http needs a url"),
    ("hooks:\n  on_startup:\n    - shell: x\n      retries: 100\n", "c.yaml:4: hooks.on_startup[0].retries must be"),
    ("hooks:\n  on_startup:\n    - shell: x\n      ignore_errors: maybe\n",
     "ignore_errors must be true or false, not 'maybe'"),
    ("slots:\n  swa_full: sometimes\n", "c.yaml:2: slots.swa_full must be one of auto, always, never"),
    ("hooks: [1, 2]\n", "c.yaml:1: hooks must be a mapping"),
    ("watchdog:\n  stall: 0s\n", "c.yaml:2: watchdog.stall must be more than 0s"),
    ("watchdog:\n  window: 0\n", "c.yaml:2: watchdog.window must be more than 0s"),
    ("watchdog:\n  health_timeout: -1m\n", "c.yaml:2: watchdog.health_timeout: a duration cannot be negative"),
    ("watchdog:\n  restarts: 2.5\n", "c.yaml:2: watchdog.restarts must be an integer, not 2.5"),
    ("server:\n  argv: [a\n", "c.yaml:3: not valid YAML"),
])
def test_bad_configs_name_file_and_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.yaml")
    assert message in str(caught.value)


@pytest.mark.parametrize(("text", "message"), [
    ("    - builtin: slots.sav\n", "c.yaml:3: unknown built-in 'slots.sav' (did you mean 'slots.save'?)"),
    ("    - builtin: slots.save\n      with: {x: 1}\n", "c.yaml:3: slots.save: takes no options (got x)"),
    ("    - builtin: server.reload\n", "server.reload: says nothing to change"),
    ("    - builtin: server.reload\n      with: {n_ctx: 8192, ctx: 1}\n", "unknown option(s) ctx"),
    ("    - shell: x\n      with: {a: 1}\n", "c.yaml:4: hooks.on_startup[0].with: only a builtin action"),
    ("    - builtin: server.reload\n      with: {n_ctx: '{{ nope }}'}\n", "unknown name 'nope'"),
])
def test_builtins_and_their_options_are_checked_at_load(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "c.yaml").write_text("hooks:\n  on_startup:\n" + text)
    with pytest.raises(ConfigError) as caught:
        built_ins.load(tmp_path / "c.yaml")
    assert message in str(caught.value).replace(str(tmp_path) + "/", "")


def test_builtin_options_are_kept() -> None:
    config = parse_config("hooks:\n  on_will_start:\n    - builtin: server.reload\n      with: {url: "
                          "'http://127.0.0.1:8081', n_ctx: 4096}\n", "c.yaml")
    action = config.hooks["on_will_start"][0]
    assert action.options == {"url": "http://127.0.0.1:8081", "n_ctx": 4096}
    assert built_ins.problems(config) == []


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("listen: nope\nserver:\n  bogus: 1\n", "c.yaml")
    assert len(str(caught.value).splitlines()) == 2


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("2m", 120), ("250ms", 0.25), ("1.5h", 5400), (7, 7)])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_listen_forms() -> None:
    assert parse_listen(":8080") == Listen("127.0.0.1", 8080)
    assert parse_listen("[::1]:81").url == "http://[::1]:81"
    with pytest.raises(ValueError):
        parse_listen("localhost:99999")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path / "nope.yaml")


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wrapper.cli", "check", str(path)],
                          capture_output=True, text=True, check=False)


def test_check_prints_the_resolved_hooks(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text(FULL)
    done = _check(path)
    assert done.returncode == 0, done.stderr
    assert "warm-up" in done.stdout and f"where: {path}:17" in done.stdout
    assert "built-ins:\n- media\n- slots\n- conversations\n" in done.stdout


def test_check_a_misspelt_key_exits_2_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text("hooks:\n  on_startup:\n    - shell: echo hi\n      timout: 3s\n")
    done = _check(path)
    assert done.returncode == 2
    assert f"{path}:4: unknown key 'timout'" in done.stderr and "did you mean 'timeout'" in done.stderr


def test_check_finds_template_syntax_errors(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text("hooks:\n  on_startup:\n    - shell: echo {{ server.url\n")
    done = _check(path)
    assert done.returncode == 2 and f"{path}:3: hooks.on_startup[0]: template syntax error" in done.stderr


def test_run_with_a_bad_config_exits_2_before_spawning(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text("listen: nowhere\n")
    marker = tmp_path / "spawned"
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "run", "--config", str(path), "--",
                           "touch", str(marker)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "hooks.yaml:1: listen: write HOST:PORT" in done.stderr
    assert not marker.exists()


def test_run_with_a_missing_binary_exits_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "run", "--", "no-such-llama-server"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "not an executable or not on PATH" in done.stderr


def test_options_come_from_the_environment(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "run", "--", "true"], capture_output=True,
                          text=True, check=False, env={"LLAMA_WRAPPER_LISTEN": "bad", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "--listen: write HOST:PORT" in done.stderr


@pytest.mark.parametrize("name", ["hooks.yaml", "degrade.yaml"])
def test_the_shipped_examples_are_valid(name: str) -> None:
    done = _check(Path(__file__).resolve().parents[4] / "examples" / name)
    assert done.returncode == 0, done.stderr
    if name == "degrade.yaml":
        assert "budget: 3.00 GiB" in done.stdout and "smaller-batch" in done.stdout


@pytest.mark.parametrize(("hook", "message"), [
    ("    - shell: echo {{ modle.name }}\n", "unknown name 'modle' in 'echo {{ modle.name }}' (did you mean 'model'?)"),
    ("    - http: {url: '{{ server.ulr }}/props'}\n", "server has no 'ulr'"),
    ("    - shell: echo hi\n      when: result ==\n", "template syntax error in 'result =='"),
    ("    - exec: [echo, '{{ evnt }}']\n", "unknown name 'evnt'"),
    ("    - http: {url: 'http://x', json: {a: '{{ listen.prot }}'}}\n", "listen has no 'prot'"),
])
def test_template_mistakes_are_config_errors_at_load(hook: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"hooks:\n  on_will_stop:\n{hook}", "t.yaml")
    assert "t.yaml:3: hooks.on_will_stop[0]: " in str(caught.value) and message in str(caught.value)


def test_run_with_a_template_typo_exits_2_before_spawning(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text("hooks:\n  on_will_stop:\n    - shell: echo {{ modle.name }}\n")
    marker = tmp_path / "spawned"
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "run", "--config", str(path), "--",
                           "touch", str(marker)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and f"{path}:3:" in done.stderr and "'modle'" in done.stderr
    assert not marker.exists()


@pytest.mark.parametrize("value", [".nan", ".inf", "-3", "-2s", "nan", "inf"])
def test_durations_must_be_finite_and_not_negative(value: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.stop_timeout"):
        parse_config(f"server:\n  stop_timeout: {value}\n", "t.yaml")


def test_check_warns_about_templates_inside_quotes(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text("hooks:\n  on_stopped:\n    - shell: echo \"{{ model.path }}\" {{ model.name }} 'x {{ result }}'\n")
    done = _check(path)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and all(f"{path}:3: hooks.on_stopped[0]: " in w for w in warnings)
    assert "{{ model.path }} stands inside quotes" in warnings[0] and "{{ result }}" in warnings[1]
    assert "{{ model.name }}" not in done.stderr


def test_a_port_out_of_range_in_the_server_argv_is_a_config_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "run", "--", "true", "--port", "70000"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "--port '70000' is not a port" in done.stderr
    assert "Traceback" not in done.stderr


def test_degrade_settings() -> None:
    config = parse_config("""\
degrade:
  budget: 3GiB
  ladder: [quantize-kv-q8, {name: small-batch, set: {-ub: 256}, remove: [--mlock]}, quantize-kv-q4]
  headroom: 512
  continue: false
  relax_after: 2m
""", "c.yaml")
    degrade = DEGRADE.on(config)
    assert degrade is not None
    assert degrade.budget == 3 << 30 and degrade.headroom == 512 and degrade.relax_after == 120
    assert not degrade.continue_truncated
    assert [r.name for r in degrade.ladder] == ["quantize-kv-q8", "small-batch", "quantize-kv-q4"]
    assert degrade.ladder[1].set == {"-ub": "256"} and degrade.ladder[1].remove == ("--mlock",)
    assert DEGRADE.of(parse_config("degrade: {budget: auto}\n", "c.yaml")).budget is None
    assert DEGRADE.on(parse_config("degrade:\n", "c.yaml")) is not None
    assert DEGRADE.on(parse_config("", "c.yaml")) is None


@pytest.mark.parametrize(("text", "message"), [
    ("degrade: {budget: lots}\n", "degrade.budget: not a size: 'lots'"),
    ("degrade: {budget: 0}\n", "a size must be more than 0"),
    ("degrade: {ladder: [quantize-kv-q3]}\n", "unknown rung 'quantize-kv-q3' (did you mean 'quantize-kv-q8'?)"),
    ("degrade: {ladder: [{name: x}]}\n", "degrade.ladder[0] changes nothing"),
    ("degrade: {ladder: [{name: x, set: {ub: 1}}]}\n", "degrade.ladder[0].set must map llama-server flags"),
    ("degrade: {ladder: [quantize-kv-q8, quantize-kv-q8]}\n", "names 'quantize-kv-q8' twice"),
    ("degrade: {headroom: -1}\n", "degrade.headroom must be 0 or more"),
    ("degrade: {budgte: 1GiB}\n", "unknown key 'budgte' in degrade (did you mean 'budget'?)"),
])
def test_bad_degrade_settings(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.yaml")
    assert message in str(caught.value)


@pytest.mark.parametrize(("text", "size"), [("3GiB", 3 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                            ("800M", 800_000_000), (4096, 4096), ("2 gib", 2 << 30)])
def test_sizes(text: object, size: int) -> None:
    assert parse_size(text) == size


def test_help_names_the_slot_files_as_they_are() -> None:
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "conv-<key>-<fingerprint>.bin" in done.stdout and "slot0" not in done.stdout


def test_check_reads_the_config_named_in_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "hooks.yaml"
    path.write_text(FULL)
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "check"], capture_output=True, text=True,
                          check=False, env={**os.environ, "LLAMA_WRAPPER_CONFIG": str(path)})
    assert done.returncode == 0 and "warm-up" in done.stdout, done.stderr
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_WRAPPER_CONFIG"}
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "check"], capture_output=True, text=True,
                          check=False, env=env)
    assert done.returncode == 2 and "set LLAMA_WRAPPER_CONFIG" in done.stderr


def test_a_missing_model_is_one_sentence_before_anything_starts(tmp_path: Path) -> None:
    marker = tmp_path / "spawned"
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "run", "--", "touch", str(marker), "-m",
                           "/nonexistent.gguf"], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and not marker.exists()
    assert done.stderr.strip().splitlines() == ["llama-wrapper: the model file '/nonexistent.gguf' (-m) does not "
                                                "exist: give the path of a .gguf file (in a clone of llama-wrapper, "
                                                "`make model` prints the demo model's)"]


def test_reload_takes_the_address_as_listen_does() -> None:
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "reload", "--url", "127.0.0.1:9", "--ctx", "2048"],
                          capture_output=True, text=True, check=False, env={**os.environ,
                                                                            "LLAMA_WRAPPER_ADMIN_TOKEN": "t"})
    assert done.returncode == 1 and "cannot reach http://127.0.0.1:9" in done.stderr
    assert "unknown url type" not in done.stderr


def test_the_kubernetes_example_drains_within_its_grace_period() -> None:
    """Documented, not run (no cluster here): at least well-formed, and its numbers agree with each other."""
    example = Path(__file__).resolve().parents[4] / "examples" / "kubernetes.yaml"
    docs = list(yaml.safe_load_all(example.read_text()))
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    drain = container["lifecycle"]["preStop"]["httpGet"]
    assert drain["path"].startswith("/wrapper/drain?timeout=")
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    timeout = parse_duration(drain["path"].split("=")[1])
    assert pod["terminationGracePeriodSeconds"] >= timeout + 10 + 10  # + the save + stop_timeout
