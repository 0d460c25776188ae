"""Images for tests: a tiny random-weight vision projector (mmproj) GGUF, PNGs and the request shapes that carry them.

The projector is llama.cpp's `gemma3` type (clip/mtmd in `tools/mtmd/`), chosen because it needs the fewest
tensors of any vision projector: a SigLIP-style ViT plus two projector tensors, a fixed-size resize, and no
special tokens of its own (the `<start_of_image>`/`<end_of_image>` markers it adds are plain text, so any text
model's vocabulary will do). Its graph is: patch embedding (a `PATCH_SIZE` convolution) plus learned position
embeddings, `BLOCKS` pre-norm transformer blocks (ln1, attn_q/k/v/out, ln2, ffn_up/down with GELU, all with
biases), post_ln, a `MERGE` x `MERGE` average pool over the patch grid, an RMS norm scaled by
`mm.soft_emb_norm.weight`, and `mm.input_projection.weight`, whose width is the text model's
`embedding_length` (llama.cpp refuses a projector whose output width differs from the text model's).

With the defaults (64x64 images, 8x8 patches so an 8x8 grid, 2x2 pooling, 2 blocks, hidden size 64, FFN 128)
an image becomes `IMAGE_TOKENS` = 16 embeddings and the file is about 0.46 MiB of F32: llama-server loads it next
to SmolLM2 (`--mmproj`) in well under a second and answers image requests with HTTP 200. The weights are random,
so what the model says about an image is noise; the mechanics (tokenizing, encoding, caching, slot files with
media) are real.

The PNGs are written with zlib and struct only (8-bit RGB, filter 0), so no imaging library is needed.
"""

from __future__ import annotations

import base64
import hashlib
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np

IMAGE_SIZE = 64  # the projector's input: every image is resized to IMAGE_SIZE x IMAGE_SIZE
PATCH_SIZE = 8
MERGE = 2  # the pooling kernel: (IMAGE_SIZE / PATCH_SIZE / MERGE) ** 2 image tokens
BLOCKS = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE // MERGE) ** 2  # 16


def make_projector(path: Path, text_embedding_length: int, hidden: int = 64, seed: int = 0) -> Path:
    """Write a `gemma3` vision projector GGUF with random F32 weights to `path` and return `path`.

    `text_embedding_length` must be the text model's `embedding_length` (576 for SmolLM2 135M). `hidden` is
    the ViT width (heads of 16 values, FFN 2 x hidden). Written to a temporary name first, then renamed, so a
    reader never sees half a file.
    """
    if hidden % 16:
        raise ValueError(f"hidden size {hidden} is not a multiple of 16 (the head size)")
    n_ff = 2 * hidden
    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    rng = np.random.default_rng(seed)
    temporary = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(temporary), "clip")
    writer.add_name("tiny-random-gemma3-mmproj")
    writer.add_file_type(0)  # all F32
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", hidden)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.block_count", BLOCKS)
    writer.add_uint32("clip.vision.projection_dim", text_embedding_length)
    writer.add_uint32("clip.vision.attention.head_count", hidden // 16)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_uint32("clip.vision.projector.scale_factor", MERGE)  # gemma3's pooling kernel (4 when absent)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def random(name: str, *shape: int) -> None:  # numpy shapes: ggml's ne reversed
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    def ones(name: str, n: int) -> None:
        writer.add_tensor(name, np.ones(n, dtype=np.float32))

    def zeros(name: str, n: int) -> None:
        writer.add_tensor(name, np.zeros(n, dtype=np.float32))

    random("v.patch_embd.weight", hidden, 3, PATCH_SIZE, PATCH_SIZE)
    zeros("v.patch_embd.bias", hidden)
    random("v.position_embd.weight", n_patches, hidden)
    for block in range(BLOCKS):
        prefix = f"v.blk.{block}"
        ones(f"{prefix}.ln1.weight", hidden)
        zeros(f"{prefix}.ln1.bias", hidden)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            random(f"{prefix}.{name}.weight", hidden, hidden)
            zeros(f"{prefix}.{name}.bias", hidden)
        ones(f"{prefix}.ln2.weight", hidden)
        zeros(f"{prefix}.ln2.bias", hidden)
        random(f"{prefix}.ffn_up.weight", n_ff, hidden)
        zeros(f"{prefix}.ffn_up.bias", n_ff)
        random(f"{prefix}.ffn_down.weight", hidden, n_ff)
        zeros(f"{prefix}.ffn_down.bias", hidden)
    ones("v.post_ln.weight", hidden)
    zeros("v.post_ln.bias", hidden)
    ones("mm.soft_emb_norm.weight", hidden)
    random("mm.input_projection.weight", hidden, text_embedding_length)  # ggml ne [text width, hidden]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    temporary.replace(path)
    return path


def png(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    """A valid 8-bit RGB PNG of random pixels: the same seed gives the same bytes (and so the same media hash)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"a PNG needs a positive size, not {width}x{height}")
    pixels = random.Random(seed).randbytes(width * height * 3)
    row = width * 3
    raw = b"".join(b"\0" + pixels[y * row:(y + 1) * row] for y in range(height))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, deflate, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def data_url(png_bytes: bytes) -> str:
    """`data:image/png;base64,...`, the form an OpenAI `image_url` part carries inline."""
    return "data:image/png;base64," + base64.b64encode(png_bytes).decode("ascii")


def image_part(image: bytes) -> dict[str, Any]:
    """An OpenAI content part carrying a PNG inline."""
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def image_message(text: str, image: bytes) -> dict[str, Any]:
    """A user chat message whose content is a text part and then an `image_url` part."""
    return {"role": "user", "content": [{"type": "text", "text": text}, image_part(image)]}


def chat_body(text: str, image: bytes, **extra: Any) -> dict[str, Any]:
    """A deterministic /v1/chat/completions body with one image message (`extra` adds or overrides fields)."""
    body: dict[str, Any] = {"messages": [image_message(text, image)], "max_tokens": 4, "temperature": 0.0,
                            "cache_prompt": True}
    body.update(extra)
    return body


def completion_prompt(text: str, images: list[bytes], marker: str) -> dict[str, Any]:
    """The /completion `prompt` object for images: `text` holds one `marker` per image, in order (one is
    appended when it has none and there is one image). `marker` must be the server's `/props` `media_marker`:
    the pinned llama-server draws a random one at every start (`<__media_<32 random chars>__>`), and mtmd's
    documented default `<__media__>` is refused with 400 "Failed to tokenize prompt"."""
    if marker not in text and len(images) == 1:
        text = f"{text}{marker}"
    if text.count(marker) != len(images):
        raise ValueError(f"{text.count(marker)} markers for {len(images)} images")
    return {"prompt_string": text, "multimodal_data": [base64.b64encode(image).decode("ascii") for image in images]}


def media_id(image: bytes) -> str:
    """The id llama-server gives an image: the SHA-256 hex of the bytes sent. Two requests with the same bytes
    share the cached image tokens, and a saved slot records this id for each image it holds."""
    return hashlib.sha256(image).hexdigest()


def slot_media(path: Path) -> list[tuple[int, bytes]]:
    """The media a saved slot file holds: (index of the image's first token, saved chunk) per image.

    The token payload after the 12-byte file header is i32 -1, u32 1, u32 n_tokens, n_tokens i32 (an image's
    positions are -1), u32 n_media, n_media u32 start indices, then per image u32 size and that many bytes
    (mtmd_input_chunk_save: metadata only, the media id among it, no pixels or embeddings).
    """
    data = path.read_bytes()
    _magic, _version, n_words = struct.unpack_from("<III", data, 0)
    words_end = 12 + 4 * n_words
    marker, _state, n_tokens = struct.unpack_from("<iII", data, 12)
    if marker != -1:
        return []  # plain tokens (older servers): no media
    at = 24 + 4 * n_tokens
    (n_media,) = struct.unpack_from("<I", data, at)
    starts = struct.unpack_from(f"<{n_media}I", data, at + 4)
    at += 4 + 4 * n_media
    chunks = []
    for start in starts:
        (size,) = struct.unpack_from("<I", data, at)
        if at + 4 + size > words_end:
            raise ValueError(f"{path}: media chunk of {size} bytes runs past the token payload")
        chunks.append((start, data[at + 4:at + 4 + size]))
        at += 4 + size
    return chunks

