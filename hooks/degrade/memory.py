"""The memory planner: bytes per device and component for a llama-server command line, from the GGUF header.

Weights are the tensor table's exact sizes (the layers `-ngl` offloads on the GPU, `token_embd` always on
the CPU, the output layer on the GPU once every layer is: a model without `output.weight` (tied embeddings,
e.g. Gemma) then gets a copy of `token_embd` there), plus the CPU's repacked copy of Q4_0/Q4_K/IQ4_NL
layer tensors. KV follows llama.cpp's allocation exactly: per layer KV heads * head size * bytes per value *
cells, cells = n_ctx padded to 256, sliding-window layers `min(n_ctx, window * n_seq + n_ubatch)` unless
`--swa-full`. The compute buffer is an estimate (the ubatch's feed-forward activations, the attention mask
per cell, and on a GPU the dequantized K/V of a quantized cache); `hooks/degrade/calibration.py` replaces it with
what the server reported once it has seen a start. `other`: the logits buffer and a GPU's context (~600 MiB
with CUDA, measured on an H200).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from wrapper.configuration import argv as args
from wrapper.launching.gguf_meta import GGUFError, read_header

MiB = 1 << 20
CELL_PAD = 256
GPU_CONTEXT = 600 * MiB  # nvidia-smi's use beyond the server's buffers, H200 (../shared/data)
COMPONENTS = ("weights", "kv", "compute", "other")
VALUE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
               "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
_REPACKED = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.IQ4_NL}
# Which layers use the sliding window, per architecture (llama.cpp's set_swa_pattern): every n-th is global.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "gpt-oss": 2, "exaone4": 4}
DEVICE = ("-dev", "--device")  # `none`: offload nothing, whatever -ngl says


class PlanError(Exception):
    """The model cannot be planned for (no GGUF header, an unknown tensor type)."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a GGUF: sizes and the tensor table."""

    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    head_dim_k: int
    head_dim_v: int
    kv_heads: tuple[int, ...]  # per layer
    swa_window: int | None
    swa_layers: tuple[bool, ...]  # per layer
    tensors: tuple[tuple[str, int, int], ...]  # name, bytes, ggml type
    recurrent: bool = False
    file_bytes: int = 0

    @property
    def weights_bytes(self) -> int:
        return sum(size for _, size, _ in self.tensors)


def read_shape(path: str) -> ModelShape:
    try:
        meta, tensors = read_header(path)
    except GGUFError as exc:
        raise PlanError(str(exc)) from exc
    arch = str(meta.get("general.architecture", ""))

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    table = []
    for tensor in tensors:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type_id)]
        except (ValueError, KeyError) as exc:
            raise PlanError(f"{path}: tensor {tensor.name} has a type this planner does not know") from exc
        table.append((tensor.name, math.prod(tensor.shape) // block * size, tensor.type_id))
    n_layer = int(key("block_count") or 0)
    n_embd = int(key("embedding_length") or 0)
    heads = key("attention.head_count") or 1
    heads = max(heads) if isinstance(heads, list) else int(heads)
    kv = key("attention.head_count_kv", heads)
    kv_heads = tuple(int(h) for h in kv) if isinstance(kv, list) else (int(kv),) * n_layer
    plain = n_embd // heads if heads else 0
    ff = key("feed_forward_length") or 0
    vocab = key("vocab_size") or next((shape[-1] for name, shape in ((t.name, t.shape) for t in tensors)
                                       if name == "token_embd.weight"), 0)
    window = key("attention.sliding_window")
    window = int(window) if isinstance(window, int) and window > 0 else None
    return ModelShape(
        architecture=arch, n_layer=n_layer, n_embd=n_embd, n_ff=int(max(ff) if isinstance(ff, list) else ff),
        n_vocab=int(vocab), n_ctx_train=int(key("context_length") or 0),
        head_dim_k=int(key("attention.key_length") or plain), head_dim_v=int(key("attention.value_length") or plain),
        kv_heads=kv_heads, swa_window=window, swa_layers=_swa_layers(arch, n_layer, window, key),
        tensors=tuple(table), recurrent=any(k.startswith(f"{arch}.ssm.") for k in meta),
        file_bytes=os.path.getsize(path),
    )


def _swa_layers(arch: str, n_layer: int, window: int | None, key: Any) -> tuple[bool, ...]:
    if window is None:
        return (False,) * n_layer
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(bool(p) for p in pattern[:n_layer])
    every = int(pattern) if isinstance(pattern, int) and pattern > 0 else _SWA_PATTERN.get(arch, 0)
    if not every:
        return (True,) * n_layer  # a window and no pattern: every layer slides
    return tuple((il + 1) % every != 0 for il in range(n_layer))


@dataclass(frozen=True)
class Choices:
    """What of a llama-server command line changes memory."""

    n_ctx: int
    type_k: str = "f16"
    type_v: str = "f16"
    swa_full: bool = False
    n_parallel: int = 1
    n_ubatch: int = 512
    gpu_layers: int = 0  # layers on the GPU (0: none, or a CPU-only build)
    kv_offload: bool = True
    mmproj: str | None = None
    mmproj_offload: bool = True
    draft: str | None = None
    draft_ctx: int | None = None
    draft_gpu_layers: int = 0


def choices_of(argv: Sequence[str], shape: ModelShape, gpu: bool) -> Choices:
    """`gpu`: whether this llama-server build has a GPU device, or the plan is for one (`plan --backend`);
    without one, or with `-dev none`, -ngl offloads nothing."""
    def number(names: tuple[str, ...], default: int) -> int:
        value = args.get(argv, names)
        try:
            return int(value) if value is not None else default
        except ValueError:
            return default

    n_ctx = number(args.CTX_SIZE, 0) or shape.n_ctx_train or 4096
    ngl_text = args.get(argv, args.GPU_LAYERS)
    gpu = gpu and (args.get(argv, DEVICE) or "").lower() != "none"
    if not gpu:
        layers = 0
    elif ngl_text is None or ngl_text in ("auto", "all", "-1"):
        layers = shape.n_layer + 1
    else:
        layers = number(args.GPU_LAYERS, 0)
    draft_ngl = number(("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"), layers)
    return Choices(
        n_ctx=n_ctx, type_k=(args.get(argv, args.CACHE_TYPE_K) or "f16").lower(),
        type_v=(args.get(argv, args.CACHE_TYPE_V) or "f16").lower(), swa_full=args.has(argv, args.SWA_FULL),
        n_parallel=max(1, number(args.PARALLEL, 1)), n_ubatch=number(("-ub", "--ubatch-size"), 512),
        gpu_layers=layers, kv_offload=not args.has(argv, ("-nkvo", "--no-kv-offload")),
        mmproj=args.get(argv, ("-mm", "--mmproj")), mmproj_offload=not args.has(argv, ("--no-mmproj-offload",)),
        draft=args.get(argv, ("-md", "--model-draft")), draft_ctx=number(("-cd", "--ctx-size-draft"), 0) or None,
        draft_gpu_layers=draft_ngl if gpu else 0,
    )


@dataclass
class Plan:
    """Bytes per device ("CPU", "GPU") and component, and which figures were measured."""

    n_ctx: int
    devices: dict[str, dict[str, int]] = field(default_factory=dict)
    measured: set[str] = field(default_factory=set)  # "CPU.weights", ...
    notes: list[str] = field(default_factory=list)

    def add(self, device: str, component: str, nbytes: float) -> None:
        if nbytes:
            parts = self.devices.setdefault(device, dict.fromkeys(COMPONENTS, 0))
            parts[component] += round(nbytes)

    def component(self, name: str) -> int:
        return sum(parts.get(name, 0) for parts in self.devices.values())

    def total(self, device: str | None = None) -> int:
        chosen = [self.devices.get(device, {})] if device else list(self.devices.values())
        return sum(sum(parts.values()) for parts in chosen)

    @property
    def budget_device(self) -> str:
        """What a budget limits: the GPU when anything is offloaded to one, else the host."""
        return "GPU" if "GPU" in self.devices else "CPU"

    def as_dict(self) -> dict[str, Any]:
        return {"n_ctx": self.n_ctx, "bytes": {**{c: self.component(c) for c in COMPONENTS}, "total": self.total()},
                "devices": {d: {**parts, "total": sum(parts.values())} for d, parts in self.devices.items()},
                "budget_device": self.budget_device, "measured": sorted(self.measured), "notes": self.notes}


def kv_cells(shape: ModelShape, s: Choices) -> tuple[int, int]:
    """Cells of the full-attention cache and of the sliding-window one."""
    full = _pad(s.n_ctx)
    if shape.swa_window is None or s.swa_full:
        return full, full
    return full, min(full, _pad(shape.swa_window * s.n_parallel + s.n_ubatch))


def kv_bytes_per_layer(shape: ModelShape, s: Choices) -> list[float]:
    full, swa = kv_cells(shape, s)
    per_value = VALUE_BYTES.get(s.type_k, 2.0), VALUE_BYTES.get(s.type_v, 2.0)
    return [heads * (shape.head_dim_k * per_value[0] + shape.head_dim_v * per_value[1]) * (swa if sliding else full)
            for heads, sliding in zip(shape.kv_heads, shape.swa_layers, strict=False)]


def plan(shape: ModelShape, s: Choices, mmproj_bytes: int = 0, draft: ModelShape | None = None) -> Plan:
    result = Plan(n_ctx=s.n_ctx)
    _weights(result, shape, s.gpu_layers)
    on_gpu = _gpu_layer_mask(shape.n_layer, s.gpu_layers)
    for il, nbytes in enumerate(kv_bytes_per_layer(shape, s)):
        result.add("GPU" if on_gpu[il] and s.kv_offload else "CPU", "kv", nbytes)
    _compute(result, shape, s, any(on_gpu))
    result.add("CPU", "other", shape.n_vocab * 4 * s.n_parallel)  # the logits of one output per sequence
    if mmproj_bytes:
        result.add("GPU" if s.mmproj_offload and s.gpu_layers else "CPU", "weights", mmproj_bytes)
    if draft is not None:
        draft_settings = replace(s, n_ctx=s.draft_ctx or s.n_ctx, type_k="f16", type_v="f16",
                                 gpu_layers=s.draft_gpu_layers, draft=None)
        _weights(result, draft, draft_settings.gpu_layers)
        draft_gpu = _gpu_layer_mask(draft.n_layer, draft_settings.gpu_layers)
        for il, nbytes in enumerate(kv_bytes_per_layer(draft, draft_settings)):
            result.add("GPU" if draft_gpu[il] else "CPU", "kv", nbytes)
    if "GPU" in result.devices:
        result.add("GPU", "other", GPU_CONTEXT)
    if shape.recurrent:
        result.notes.append("recurrent (SSM) state is not modelled: count it from a measured start")
    return result


def _pad(n: int) -> int:
    return max(CELL_PAD, -(-n // CELL_PAD) * CELL_PAD)


def _gpu_layer_mask(n_layer: int, gpu_layers: int) -> list[bool]:
    first = n_layer - min(gpu_layers, n_layer)
    return [il >= first for il in range(n_layer)]


def _weights(result: Plan, shape: ModelShape, gpu_layers: int) -> None:
    on_gpu = _gpu_layer_mask(shape.n_layer, gpu_layers)
    output_on_gpu = gpu_layers > shape.n_layer
    for name, nbytes, type_id in shape.tensors:
        if name.startswith("blk."):
            layer = int(name.split(".")[1])
            gpu = layer < len(on_gpu) and on_gpu[layer]
        else:
            gpu = output_on_gpu and not name.startswith("token_embd")
        result.add("GPU" if gpu else "CPU", "weights", nbytes)
        if not gpu and name.startswith("blk.") and type_id in _REPACKED and name.endswith(".weight"):
            result.add("CPU", "weights", nbytes)  # the CPU backend's repacked copy (CPU_REPACK)
    if output_on_gpu and not any(name == "output.weight" for name, _, _ in shape.tensors):
        # tied embeddings: llama.cpp loads token_embd again as the output layer, in that layer's GPU buffer
        result.add("GPU", "weights", sum(nbytes for name, nbytes, _ in shape.tensors if name == "token_embd.weight"))


def _compute(result: Plan, shape: ModelShape, s: Choices, gpu: bool) -> None:
    full, swa = kv_cells(shape, s)
    mask = s.n_ubatch * 2 * (full + (swa if any(shape.swa_layers) else 0))  # an f16 mask row per ubatch token
    activations = s.n_ubatch * 4 * 5 * shape.n_ff
    if not gpu:
        result.add("CPU", "compute", activations + mask)
        return
    quantized = s.type_k not in ("f16", "f32", "bf16") or s.type_v not in ("f16", "f32", "bf16")
    widest = max(shape.kv_heads, default=0) * max(shape.head_dim_k, shape.head_dim_v)
    dequantized = full * widest * 2 * 2 if quantized else 0  # K and V as f16 for the attention kernels
    result.add("GPU", "compute", activations + mask + dequantized)
    result.add("CPU", "compute", s.n_ubatch * shape.n_embd * 16 + mask)  # the host's staging buffer


def largest_ctx(shape: ModelShape, s: Choices, budget: int, ceiling: int, mmproj_bytes: int = 0,
                draft: ModelShape | None = None, adjust: Any = None) -> int:
    """The largest context (a multiple of 256, at most `ceiling`) whose plan fits `budget` on its device; 0 if
    none does. `adjust(plan)` may correct a plan with measured figures first."""
    def fits(n_ctx: int) -> bool:
        candidate = plan(shape, replace(s, n_ctx=n_ctx), mmproj_bytes, draft)
        if adjust is not None:
            candidate = adjust(candidate, replace(s, n_ctx=n_ctx))
        return candidate.total(candidate.budget_device) <= budget

    low, high = 0, max(0, ceiling // CELL_PAD)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle * CELL_PAD):
            low = middle
        else:
            high = middle - 1
    return low * CELL_PAD
