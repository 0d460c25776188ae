"""Real models for integration tests: the demo SmolLM2, Gemma 3 270M (SWA), and a tiny random-weight LLaMA GGUF.

The tiny model copies the tokenizer of the vocab-only GGUF that ships in the pinned llama.cpp sdist
(kept next to the llama-server build by llama.cpp/build-server) and adds random weights: a few MB that
llama-server loads and generates from (nonsense text, real mechanics, and no sliding window).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def llama_server() -> str:
    path = os.environ.get("LLAMA_SERVER")
    if not path:
        raise RuntimeError("set LLAMA_SERVER to a llama-server binary (make test does: llama.cpp/build-server)")
    return path


def old_llama_server() -> str | None:
    """The older llama-server the upgrade tests save under (llama.cpp/OLD_VERSION): $LLAMA_SERVER_OLD, else the
    one `make old-server` left in the cache; None when there is none (it is not built here: 5-20 minutes)."""
    path = os.environ.get("LLAMA_SERVER_OLD")
    if path:
        return path
    version = (ROOT / "llama.cpp" / "OLD_VERSION").read_text().strip()
    key = hashlib.sha256(f"{version}\n{os.environ.get('CMAKE_ARGS', '')}\n".encode()).hexdigest()[:12]
    root = Path(os.environ.get("LLAMA_WRAPPER_CACHE")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-wrapper")
    found = root / "llama-server" / f"{version}-{key}" / "llama-server"
    return str(found) if os.access(found, os.X_OK) else None


def demo() -> str:
    """The demo model, SmolLM2 135M Instruct (a chat template), fetched by llama.cpp/get-model."""
    done = subprocess.run([sys.executable, str(ROOT / "llama.cpp" / "fetch-model"), "smollm2"], check=True,
                          capture_output=True, text=True)
    return done.stdout.strip()


def gemma() -> str:
    """Gemma 3 270M (sliding-window attention), assembled by llama.cpp/get-model gemma into the model folder."""
    done = subprocess.run([sys.executable, str(ROOT / "llama.cpp" / "fetch-model"), "gemma"], check=True,
                          capture_output=True, text=True)
    return done.stdout.strip()


def tiny_llama(out: Path, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_head_kv: int = 2) -> str:
    """Write (once) a LLaMA-architecture GGUF with random F16 weights and a real SentencePiece vocabulary.

    Heads of 32 values: quantized KV caches (q8_0, q4_0 blocks of 32) need at least that.
    """
    if out.exists():
        return str(out)
    vocab_path = Path(llama_server()).with_name("ggml-vocab-llama-spm.gguf")
    vocab = gguf.GGUFReader(str(vocab_path))
    temporary = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(temporary), "llama")
    head_dim = n_embd // n_head
    n_ff = 2 * n_embd
    writer.add_name("tiny-random-llama")
    writer.add_context_length(32768)  # room for reloads to larger contexts
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for field in vocab.fields.values():
        if field.name.startswith("tokenizer."):
            _copy_field(writer, field)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(1234)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float16))

    tensor("token_embd.weight", n_vocab, n_embd)
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    tensor("output.weight", n_vocab, n_embd)
    for layer in range(n_layer):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        tensor(f"blk.{layer}.attn_q.weight", n_embd, n_embd)
        tensor(f"blk.{layer}.attn_k.weight", n_head_kv * head_dim, n_embd)
        tensor(f"blk.{layer}.attn_v.weight", n_head_kv * head_dim, n_embd)
        tensor(f"blk.{layer}.attn_output.weight", n_embd, n_embd)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        tensor(f"blk.{layer}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{layer}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{layer}.ffn_down.weight", n_embd, n_ff)
    return _written(writer, temporary, out)


FIM_TOKENS = {"fim_pre": "<jupyter_start>", "fim_suf": "<jupyter_text>", "fim_mid": "<jupyter_code>"}


def demo_with_fim(demo_path: str, out: Path) -> str:
    """Write (once) the demo model with fill-in-the-middle tokens named, for /infill: the same weights and vocabulary,
    three of its special tokens (FIM_TOKENS, unused in chat) given as the prefix, suffix and middle tokens. SmolLM2
    names none, and llama-server refuses /infill without them (501); the editor plugins' models (Qwen2.5-Coder,
    StarCoder) are not on the package index."""
    if out.exists():
        return str(out)
    model = gguf.GGUFReader(demo_path)
    tokens = [bytes(model.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in model.fields["tokenizer.ggml.tokens"].data]
    architecture = bytes(model.fields["general.architecture"].parts[-1]).decode()
    temporary = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(temporary), architecture)
    for field in model.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            _copy_field(writer, field)
    for key, token in FIM_TOKENS.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(token))
    for tensor in model.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)  # quantized: its bytes' shape
    return _written(writer, temporary, out)


def _written(writer: gguf.GGUFWriter, temporary: Path, out: Path) -> str:
    """The model written whole under a temporary name, then renamed: a test stopped halfway leaves no model."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    temporary.replace(out)
    return str(out)


def _copy_field(writer: gguf.GGUFWriter, field: gguf.ReaderField) -> None:
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        item = field.types[1]
        values = [field.parts[i] for i in field.data]
        if item == gguf.GGUFValueType.STRING:
            writer.add_array(field.name, [bytes(v) for v in values])
        else:
            writer.add_array(field.name, [v.tolist()[0] for v in values])
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
    else:
        value = field.parts[field.data[0]].tolist()[0]
        writer.add_key_value(field.name, value, kind)


def template(server_bin: str, name: str) -> str:
    """One of llama.cpp's own chat templates (models/templates/NAME.jinja), kept next to the llama-server build."""
    path = Path(server_bin).parent / "templates" / f"{name}.jinja"
    if not path.is_file():
        raise RuntimeError(f"no {path}: llama.cpp/build-server keeps the pinned sdist's templates next to the build")
    return str(path)
