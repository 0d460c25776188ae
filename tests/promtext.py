"""A strict reader of the Prometheus text format (0.0.4), stricter than scrapers that drop one bad family: any
malformed line, a family whose samples are split, a TYPE or HELP given twice, a sample that belongs to no
family or appears twice fails the whole text, as a strict parser loses the whole scrape."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\["\\n])*)"')
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",)}


class Malformed(ValueError):
    pass


@dataclass
class Family:
    name: str
    kind: str = "untyped"
    help: str | None = None
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


def parse(text: str) -> dict[str, Family]:
    families: dict[str, Family] = {}
    current: Family | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"line {number}: {line!r}"
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # a comment
            name = parts[2]
            if not NAME.fullmatch(name):
                raise Malformed(f"{where}: bad metric name")
            family = families.get(name)
            if family is None:
                family = families[name] = Family(name)
            elif family is not current:
                raise Malformed(f"{where}: family {name} appears twice")
            if parts[1] == "TYPE":
                if family.samples or family.kind != "untyped" or len(parts) != 4 or parts[3] not in SUFFIXES:
                    raise Malformed(f"{where}: TYPE twice, late, or unknown")
                family.kind = parts[3]
            else:
                if family.help is not None:
                    raise Malformed(f"{where}: HELP twice")
                family.help = parts[3] if len(parts) == 4 else ""
            current = family
            continue
        match = NAME.match(line)
        if match is None:
            raise Malformed(f"{where}: no metric name")
        name, rest = match.group(0), line[match.end():]
        labels: list[tuple[str, str]] = []
        if rest.startswith("{"):
            end = rest.find("}")
            if end < 0:
                raise Malformed(f"{where}: unclosed labels")
            body, rest = rest[1:end], rest[end + 1:]
            position = 0
            while position < len(body):
                label = LABEL.match(body, position)
                if label is None:
                    raise Malformed(f"{where}: bad label at {body[position:]!r}")
                labels.append((label.group(1), label.group(2)))
                position = label.end()
                if position < len(body):
                    if body[position] != ",":
                        raise Malformed(f"{where}: labels not separated by commas")
                    position += 1
        fields = rest.split()
        if not rest.startswith(" ") or len(fields) not in (1, 2):
            raise Malformed(f"{where}: expected a value (and a timestamp)")
        try:
            value = float(fields[0])
        except ValueError as exc:
            raise Malformed(f"{where}: bad value") from exc
        if math.isnan(value) and fields[0] != "NaN":
            raise Malformed(f"{where}: bad NaN")
        owner = current if current is not None and any(
            name == current.name + suffix for suffix in SUFFIXES[current.kind]) else None
        if owner is None:
            if any(name == f.name + suffix for f in families.values() for suffix in SUFFIXES[f.kind]):
                raise Malformed(f"{where}: the samples of a family are split")
            owner = current = families[name] = Family(name)
        key = (name, tuple(sorted(labels)))
        if key in owner.samples:
            raise Malformed(f"{where}: sample given twice")
        owner.samples[key] = value
    list(text_string_to_metric_families(text))  # and the reference parser takes it too
    return families


def value(families: dict[str, Family], sample: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    key = (sample, tuple(sorted(labels.items())))
    return next((f.samples[key] for f in families.values() if key in f.samples), 0.0)


def counters(families: dict[str, Family]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of every counter (and histogram counts), to check that they only grow."""
    return {key: v for f in families.values() if f.kind in ("counter", "histogram") for key, v in f.samples.items()
            if not key[0].endswith("_created")}
