"""The demo's tries (README: Try it on the demo), run by the Makefile's demo-* targets with the venv's python:

    python -m tests.demo projector MODEL       make (once) and print a projector for MODEL: random weights
    python -m tests.demo image                 print a chat request that carries an image
    python -m tests.demo long                  print a chat request of ~2.2k tokens (the pool's long request)
    python -m tests.demo s3 [PORT]             run a local S3 server (SeaweedFS) until Ctrl-C, and say how to reach it
    python -m tests.demo pool SERVER MODEL HOST:PORT   two wrappers of MODEL on one pool (PORT and PORT+1)
    python -m tests.demo swap LLAMA_SWAP SERVER HOST:PORT  llama-swap on HOST:PORT with examples/llama-swap.yaml:
                                               chat (the demo model) and task (Gemma 3 270M) through the wrapper

The projector is tests/media.py's: its weights are random, so it shows the mechanism (held, loaded, every
conversation kept, dropped when idle), not vision: what the model says about the image is noise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tests import media, models, pooled, s3server, swap
from wrapper.launching.gguf_meta import read_metadata

S3_PORT = 8333
BUCKET = "wrapper"


def projector(model: Path) -> Path:
    """The demo's projector beside the model (made once; the same bytes every time: seed 0)."""
    path = model.parent / f"{model.stem}-mmproj-random.gguf"
    if not path.exists():
        made = media.make_projector(path.with_suffix(".part"), _width(model))
        made.rename(path)
    return path


def _width(model: Path) -> int:
    meta = read_metadata(str(model))
    width = meta.get(f"{meta.get('general.architecture')}.embedding_length")
    if not isinstance(width, int):
        raise SystemExit(f"{model}: no embedding_length in its header: is it a GGUF text model?")
    return width


def image_request() -> str:
    return json.dumps(media.chat_body("What is in this picture?", media.png(), max_tokens=16, temperature=0))


def long_request() -> str:
    return json.dumps({"messages": [{"role": "user", "content": pooled.LONG + "\nSum it up in one line."}],
                       "max_tokens": 16, "temperature": 0})


def run_s3(port: int) -> None:
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-wrapper" / "demo-s3"
    server = s3server.S3Server(folder, BUCKET, s3_port=port)
    server.start()
    print(f"a local S3 server (SeaweedFS) on {server.endpoint}, bucket {BUCKET!r}, its data in {server.data}\n"
          f"credentials: access key {server.access_key}, secret key {server.secret_key} (examples/store.yaml has "
          "them)\nCtrl-C stops it; what it holds stays for the next `make s3`", flush=True)
    _wait_for_a_signal()
    server.stop()


def run_pool(server: str, model: Path, listen: str) -> None:
    """Two wrappers of one model on one pool, sized as tests/pooled.py sizes the test's: the main (projector on
    demand, the model as its own draft) on PORT, the task (a small context) on PORT+1; the task's long request
    fits only once the main gives something up."""
    host, port = listen.rsplit(":", 1)
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-wrapper-demo-pool-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    mmproj = projector(model)
    total, _ = pooled.sized_total(server, str(model), mmproj)
    main_argv, task_argv = pooled.argvs(server, str(model), mmproj)
    wrappers = []
    for name, argv, context, at in (("main", main_argv, pooled.MAIN_CONTEXT, int(port)),
                                    ("task", task_argv, pooled.TASK_CONTEXT, int(port) + 1)):
        config = folder / f"{name}.yaml"
        config.write_text(pooled.config(folder / f"slots-{name}", folder / "pool", total, context, relax="1m",
                                        media=name == "main"))
        wrappers.append(subprocess.Popen([sys.executable, "-m", "wrapper.cli", "run", "--config", str(config),
                                          "--listen", f"{host}:{at}", "--", *argv, "--alias", name]))  # its pool name
        print(f"{name}: http://{host}:{at} ({config})", flush=True)
        if name == "main":
            time.sleep(2)  # the main makes the pool; the task joins it
    print(f"the pool: {folder / 'pool'}, {total / 2**20:.0f} MiB in all; Ctrl-C stops both", flush=True)
    try:
        _wait_for_a_signal(wrappers)
    finally:
        for wrapper in wrappers:
            if wrapper.poll() is None:
                wrapper.send_signal(signal.SIGTERM)
        for wrapper in wrappers:
            wrapper.wait()


def run_swap(llama_swap: str, server: str, listen: str) -> None:
    """The real llama-swap with the recipe's config (examples/llama-swap.yaml), its macros pointed at the clone's
    llama-wrapper, examples/chat.yaml, the pinned llama-server, the demo model (chat) and Gemma 3 270M (task);
    the models' wrappers on the next ports (startPort: PORT+1), their slots in ~/.cache/llama-wrapper/slots."""
    port = int(listen.rsplit(":", 1)[1])
    settings = {**swap.config(server, models.demo(), models.gemma()), "startPort": port + 1}
    folder = Path(tempfile.mkdtemp(prefix="llama-wrapper-demo-swap-"))
    config = folder / "llama-swap.yaml"
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    print(f"llama-swap on http://{listen} with {config} (examples/llama-swap.yaml, its macros set): models chat "
          f"and task, their wrappers on ports {port + 1} and {port + 2} once loaded; Ctrl-C stops it", flush=True)
    child = subprocess.Popen([llama_swap, "-config", str(config), "-listen", listen])
    try:
        _wait_for_a_signal([child])  # Ctrl-C reaches llama-swap too (the terminal's whole group): it stops its models
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        child.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # its config: nothing of the demo is left in the temp folder


def _wait_for_a_signal(children: list[subprocess.Popen[bytes]] | None = None) -> None:
    got: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: got.append(number))
    while not got and not any(child.poll() is not None for child in children or []):
        time.sleep(0.2)


def main(argv: list[str]) -> None:
    match argv:
        case ["projector", model]:
            print(projector(Path(model)))
        case ["image"]:
            print(image_request())
        case ["long"]:
            print(long_request())
        case ["s3", *port]:
            run_s3(int(port[0]) if port else S3_PORT)
        case ["pool", server, model, listen]:
            run_pool(server, Path(model), listen)
        case ["swap", llama_swap, server, listen]:
            run_swap(llama_swap, server, listen)
        case _:
            raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
