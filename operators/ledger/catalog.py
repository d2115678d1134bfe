"""Prices from the catalog, never from code: ``prices.csv`` next to this module (package data).

Columns, modelled on SkyPilot's catalogs: ``cloud, instance_type, accelerator_name,
accelerator_count, vcpus, price_per_hour, currency, region, date, source``; one row is one
instance (machine) type's on-demand price per hour, ``date`` when it was read off ``source``.
`CATALOG_VERSION` changes whenever a row does, and is part of every cost's source tag.

Which price a job pays (:func:`choose_price`), first match wins:

1. ``cost.price_per_hour``: the spec's own price of one machine-hour;
2. ``cost.gpu_hour_price`` / ``cost.cpu_hour_price`` (non-zero): the spec's per-GPU-hour and
   per-CPU-core-hour prices, as before the catalog;
3. the catalog row of ``cost.cloud`` (default: the engine's, `ENGINE_CLOUD`) and
   ``cost.instance_type`` (default: the cloud's only row, e.g. ``local/localhost``).

Without any of these (a cluster engine and no ``cost.instance_type``) the cost is unknown.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from trainforge.pipeline.spec import PipelineSpec

CATALOG = Path(__file__).with_name("prices.csv")
CATALOG_VERSION = "v1"
COLUMNS = ("cloud", "instance_type", "accelerator_name", "accelerator_count", "vcpus",
           "price_per_hour", "currency", "region", "date", "source")
ENGINE_CLOUD = {"local": "local"}
"""The catalog cloud of an engine whose machine is known; cluster engines need ``cost.cloud``."""


class CatalogError(ValueError):
    """A catalog file that cannot be read, or a spec naming a row it does not have."""


@dataclass(frozen=True)
class CatalogRow:
    cloud: str
    instance_type: str
    accelerator_name: str
    accelerator_count: int
    vcpus: int
    price_per_hour: float
    currency: str
    region: str
    date: str
    source: str


@dataclass(frozen=True)
class Price:
    """What a job pays: per machine-hour (``per_machine_hour``) or per GPU- and CPU-core-hour."""

    currency: str
    source: str
    date: str
    per_machine_hour: float | None = None
    per_gpu_hour: float = 0.0
    per_cpu_core_hour: float = 0.0

    def cost(self, machine_hours: float, gpu_hours: float, cpu_core_hours: float) -> float:
        if self.per_machine_hour is not None:
            return machine_hours * self.per_machine_hour
        return gpu_hours * self.per_gpu_hour + cpu_core_hours * self.per_cpu_core_hour


def load_catalog(path: Path = CATALOG) -> list[CatalogRow]:
    """The rows of the catalog at ``path``.

    Raises:
        CatalogError: missing columns, or a field that is not the number it must be (names the
            file, line, column and value).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise CatalogError(f"price catalog {path}: cannot be read ({err})") from err
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise CatalogError(f"price catalog {path}, line 1: missing column(s) {', '.join(missing)} "
                           f"(expected {', '.join(COLUMNS)})")
    rows = []
    for line, raw in enumerate(reader, start=2):
        values: dict[str, object] = {c: (raw.get(c) or "").strip() for c in COLUMNS}
        for column, kind in (("accelerator_count", int), ("vcpus", int), ("price_per_hour", float)):
            try:
                values[column] = kind(values[column])
            except ValueError:
                raise CatalogError(f"price catalog {path}, line {line}, column {column}: "
                                   f"{values[column]!r} is not a{'n integer' if kind is int else ' number'}"
                                   ) from None
        if values["price_per_hour"] < 0:  # type: ignore[operator]
            raise CatalogError(f"price catalog {path}, line {line}, column price_per_hour: "
                               f"{values['price_per_hour']} is negative (expected >= 0)")
        rows.append(CatalogRow(**values))  # type: ignore[arg-type]
    return rows


def choose_price(spec: PipelineSpec, rows: list[CatalogRow] | None = None) -> Price | str:
    """The price the spec's job pays (module docstring), or why none is known ("unknown: ...").

    Raises:
        CatalogError: ``cost.cloud`` / ``cost.instance_type`` name no catalog row.
    """
    cost = spec.cost
    if cost.price_per_hour is not None:
        return Price(cost.currency, "spec: cost.price_per_hour", "spec",
                     per_machine_hour=cost.price_per_hour)
    if cost.gpu_hour_price or cost.cpu_hour_price:
        return Price(cost.currency, "spec: cost.gpu_hour_price, cost.cpu_hour_price", "spec",
                     per_gpu_hour=cost.gpu_hour_price, per_cpu_core_hour=cost.cpu_hour_price)
    cloud = cost.cloud or ENGINE_CLOUD.get(spec.training.engine)
    if cloud is None:
        return (f"unknown: the {spec.training.engine} engine's machines have no catalog price; set "
                f"cost.cloud and cost.instance_type (a row of prices.csv) or cost.price_per_hour")
    rows = load_catalog() if rows is None else rows
    found = [r for r in rows if r.cloud == cloud
             and (cost.instance_type is None or r.instance_type == cost.instance_type)]
    if len(found) != 1:
        known = ", ".join(f"{r.cloud}/{r.instance_type}" for r in rows)
        wanted = f"cost.cloud {cloud!r}" + (f", cost.instance_type {cost.instance_type!r}"
                                             if cost.instance_type else " (no cost.instance_type)")
        raise CatalogError(f"{wanted}: {'no' if not found else len(found)} rows of the price "
                           f"catalog {CATALOG_VERSION} match (expected one of: {known})")
    row = found[0]
    return Price(row.currency, f"catalog {CATALOG_VERSION}: {row.cloud}/{row.instance_type} "
                 f"({row.source})", row.date, per_machine_hour=row.price_per_hour)
