"""Reconfigure for the traffic, measured side by side in one run (SmolLM2 135M, the tests' 0.46 MiB projector):

  projector   the first image to a wrapper with `media.projector: on_demand` against the same image to one
              with the projector loaded from the start: the held request's extra wait for the load
  draft       tokens/s alone and with 3 clients streaming at once, with SmolLM2 as its own draft
              (`-md`, `--spec-type draft-simple`) and without (llama-server behind the wrapper, spec as given)

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_traffic.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import media, models
from tests.helpers import Wrapper, http

WIDTH = 576  # SmolLM2's embedding_length
TOKENS = 96


def timed_image(url: str, seed: int) -> float:
    began = time.monotonic()
    status, _, raw = http("POST", f"{url}/v1/chat/completions", media.chat_body("What is this?", media.png(seed=seed)),
                          timeout=300)
    assert status == 200, raw[:300]
    return time.monotonic() - began


def projector(server: str, model: str, tmp: Path, rounds: int) -> None:
    mmproj = media.make_projector(tmp / "mmproj.gguf", WIDTH)
    extra: list[float] = []
    for round_ in range(rounds):
        argv = [server, "-m", model, "--mmproj", str(mmproj), "-c", "4096", "-np", "1"]
        folder = tmp / f"p{round_}"
        folder.mkdir()
        with Wrapper(folder, argv) as loaded, \
                Wrapper(folder, argv, "media: {projector: on_demand}\n") as on_demand:
            loaded.wait_ready()
            on_demand.wait_ready()
            always_s = timed_image(loaded.url, round_)
            first_s = timed_image(on_demand.url, round_)
            extra.append(first_s - always_s)
            print(f"  round {round_ + 1}: loaded from the start {always_s:.2f}s, on demand {first_s:.2f}s")
    print(f"projector load: +{statistics.median(extra):.2f} s for the first image (median of {rounds})")


def aggregate(url: str, clients: int) -> float:
    """Tokens/s of `clients` streams at once (all tokens over the wall time)."""
    counts = [0] * clients

    def one(index: int) -> None:
        status, _, raw = http("POST", f"{url}/completion", {"prompt": f"Story {index}:", "n_predict": TOKENS,
                                                           "ignore_eos": True, "stream": True}, timeout=600)
        assert status == 200, raw[:300]
        counts[index] = sum(1 for line in raw.decode().splitlines() if line.startswith("data: {")
                            and json.loads(line[6:]).get("content"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.monotonic() - began)


def draft(server: str, model: str, tmp: Path) -> None:
    base = [server, "-m", model, "-c", "4096", "-np", "3"]
    rows = []
    for name, argv in (("without the draft", base), ("with the draft", [*base, "-md", model, "--spec-type",
                                                                          "draft-simple"])):
        with Wrapper(tmp, argv) as wrapper:
            wrapper.wait_ready()
            aggregate(wrapper.url, 1)  # warm
            rows.append((name, aggregate(wrapper.url, 1), aggregate(wrapper.url, 3)))
    print(f"{'':24}{'alone':>12}{'3 clients':>14}")
    for name, alone, crowd in rows:
        print(f"{name:24}{alone:>8.1f} t/s{crowd:>10.1f} t/s")
    (_, alone_without, crowd_without), (_, alone_with, crowd_with) = rows
    print(f"draft speedup: alone {alone_with / alone_without:.2f}, 3 clients {crowd_with / crowd_without:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    server, model = models.llama_server(), models.demo()
    with tempfile.TemporaryDirectory() as tmp:
        projector(server, model, Path(tmp), options.rounds)
        draft(server, model, Path(tmp))


if __name__ == "__main__":
    main()
