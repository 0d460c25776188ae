"""Planning a model under a budget: the planner (hooks/degrade/memory.py, calibrated by what was measured here),
the ladder's rungs, the budget `auto` resolves to, the device a plan is for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hooks.degrade import calibration
from hooks.degrade.ladder import Planner, RungPlan, build
from hooks.degrade.memory import CELL_PAD, Choices, ModelShape, Plan, PlanError, plan, read_shape
from hooks.degrade.settings import DEGRADE, DegradeSettings
from hooks.degrade.state import DegradeState
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config, ConfigError
from wrapper.configuration.units import format_size
from wrapper.launching.flags import devices, flag_arity
from wrapper.launching.launch import Launch
from wrapper.launching.sysinfo import gpu_free, mem_available

MIN_START_CTX = 1024  # the first rung whose context reaches this (or the ceiling) is where a start begins
GPU_BACKENDS = ("cuda", "vulkan", "metal")
BACKENDS = ("cpu", *GPU_BACKENDS)  # what `plan --backend` plans for instead of this build's devices


def offloads(binary: str, backend: str | None = None) -> bool:
    """Whether `-ngl` puts layers on a GPU: one of the GPU backends when a plan names one, else whether this
    llama-server build lists a GPU (`--list-devices`; a CPU-only build, or one that does not say, offloads
    nothing)."""
    return backend in GPU_BACKENDS if backend is not None else bool(devices(binary))


def planner_for(argv: Sequence[str], model_path: str, model_id: str, config: Config, state: DegradeState,
                budget: int, backend: str | None = None) -> Planner:
    """`backend`: plan for it instead of this build's devices; the figures measured here are then not used."""
    if state.shape is None:
        state.shape = read_shape(model_path)
    shape = state.shape
    gpu = offloads(argv[0], backend)
    runs = calibration.load(model_id) if backend is None else []
    user_ctx = _int(args.get(config.argv, args.CTX_SIZE))
    ceiling = min(shape.n_ctx_train or 1 << 20, user_ctx or 1 << 20)

    def predict(s: Choices) -> Plan:
        return plan(shape, s, _file_size(s.mmproj), _draft(s))

    def calibrate(predicted: Plan, s: Choices) -> Plan:
        return calibration.calibrated(predicted, s, runs, predict)

    return Planner(shape, gpu, budget, ceiling, lambda s: _file_size(s.mmproj), _draft, calibrate)


def resolve_budget(settings: DegradeSettings, argv: Sequence[str]) -> tuple[int, str]:
    """The configured budget, or `auto`: free memory of the first GPU (nvidia-smi) when layers are offloaded
    to one, else MemAvailable minus `degrade.reserve`."""
    if settings.budget is not None:
        return settings.budget, "degrade.budget"
    return auto_budget(settings.reserve, argv)


def auto_budget(reserve: int, argv: Sequence[str]) -> tuple[int, str]:
    if args.offloaded(argv) and (free := gpu_free()) is not None:
        return free, "auto: free GPU memory (nvidia-smi)"
    available = mem_available()
    if available is None:
        raise ConfigError("degrade.budget is auto, and neither nvidia-smi nor /proc/meminfo says how much memory "
                          "is free: give degrade.budget a size")
    return max(0, available - reserve), f"auto: MemAvailable minus {format_size(reserve)}"


def ladder_for(argv: Sequence[str], launch: Launch, config: Config, state: DegradeState,
               budget: int, backend: str | None = None) -> tuple[Planner, list[RungPlan]]:
    settings = DEGRADE.of(config)
    assert launch.model.path is not None
    planner = planner_for(argv, launch.model.path, launch.model.id, config, state, budget, backend)
    rungs = build(argv, settings.ladder, planner, flag_arity(argv[0]), config.argv,
                  planner.shape.swa_window is not None)
    return planner, rungs


def pool_device(argv: Sequence[str], backend: str | None = None) -> str:
    """The device a pool member's memory is on: the GPU when `-ngl` puts layers on one, else the host."""
    return "GPU" if offloads(argv[0], backend) and args.offloaded(argv) else "CPU"


def cells(tokens: int) -> int:
    return -(-tokens // CELL_PAD) * CELL_PAD


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None and int(text) > 0 else None
    except ValueError:
        return None


def _file_size(path: str | None) -> int:
    try:
        return Path(path).stat().st_size if path else 0
    except OSError:
        return 0


def _draft(s: Choices) -> ModelShape | None:
    if not s.draft:
        return None
    try:
        return read_shape(s.draft)
    except PlanError:
        return None
