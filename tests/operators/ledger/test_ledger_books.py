"""The ledger's arithmetic: attempts summed, the books closed, figures, energy and prices chosen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainforge.ledger import names as n
from trainforge.ledger.attempts import AttemptRecordError, attempt_records, sum_attempts
from trainforge.ledger.books import BooksError, close_books
from trainforge.ledger.build import build_ledger
from trainforge.ledger.catalog import CatalogError, Price, choose_price, load_catalog
from trainforge.ledger.devices import mfu_pct, peak_tflops
from trainforge.ledger.energy import energy_kwh
from trainforge.pipeline import load_spec, validate_overrides

DEMO = Path(__file__).resolve().parents[3] / "dags" / "pipelines" / "shakespeare_llm.yaml"


def record(started, first_step, recorded, *, productive, wasted=0.0, resumed=0, step=10,
           productive_steps=10, energy=None, **seconds):
    rec = {"v": 1, "started_at": started, "first_step_at": first_step, "recorded_at": recorded,
           "resumed_step": resumed, "step": step, "productive_steps": productive_steps,
           "tokens_per_step": 100, "world_size": 2, "device": "cpu", "flops_per_token": 1e6,
           "seconds": {"startup": 2.0, "restore": 0.5, "data_wait": 1.0, "save": 1.5, "eval": 0.0,
                       "wasted": wasted, "productive": productive, **seconds}}
    if energy is not None:
        rec["energy_j"], rec["energy_source"] = energy, {k: "measured-rapl" for k in energy}
    return rec


def tags_of(*records):
    return {f"trainforge.ledger.attempt.{int(r['started_at'] * 1000)}": json.dumps(r)
            for r in records} | {"unrelated": "x"}


def test_books_close_with_other_as_the_remainder_and_unknown_buckets_left_out():
    books = close_books(100.0, 60.0, {"program_startup": 5.0, "checkpoint_save": 10.0,
                                      "image_pull": "not applicable: no image"})
    assert books.buckets["other"] == pytest.approx(25.0)
    assert books.productive_s + sum(books.buckets.values()) == pytest.approx(books.wall_s)
    assert books.unknown == {"image_pull": "not applicable: no image"}
    assert books.goodput_pct == pytest.approx(60.0)
    with pytest.raises(BooksError, match="'warmup'"):
        close_books(1.0, 0.0, {"warmup": 1.0})
    with pytest.raises(BooksError, match="negative"):
        close_books(1.0, 0.0, {"checkpoint_save": -1.0})


def test_two_attempts_give_one_disruption_its_recovery_and_the_wasted_steps():
    first = record(1000.0, 1002.5, 1030.0, productive=20.0)
    second = record(1040.0, 1043.0, 1070.0, productive=15.0, wasted=4.0, resumed=10, step=30)
    books = sum_attempts(attempt_records(tags_of(second, first)))  # any tag order
    assert books.buckets["recovery"] == pytest.approx(10.0)  # last record -> next process start
    assert books.recoveries_s == [pytest.approx(13.0)]  # last record -> restarted first step
    assert books.buckets["wasted_progress"] == pytest.approx(4.0)
    assert books.buckets["checkpoint_save"] == pytest.approx(3.0)
    assert books.productive_s == pytest.approx(35.0) and books.productive_tokens == 2000


def test_a_record_that_is_not_the_trainers_json_is_named():
    with pytest.raises(AttemptRecordError, match="trainforge.ledger.attempt.1: not JSON"):
        attempt_records({"trainforge.ledger.attempt.1": "{oops"})
    with pytest.raises(AttemptRecordError, match="started_at and seconds"):
        attempt_records({"trainforge.ledger.attempt.1": "[1]"})


def test_the_ledger_sums_to_the_wall_time_and_tags_what_it_cannot_know():
    spec = load_spec(DEMO)
    first = record(1000.0, 1002.5, 1030.0, productive=20.0)
    second = record(1040.0, 1043.0, 1070.0, productive=15.0, wasted=4.0, resumed=10)
    event = {"handle": {"submitted_at_epoch_s": 999.0, "identity": {"try_number": 1}},
             "wall_s": 72.0, "ended_at_epoch_s": 1072.0,
             "phases": {"queue_wait": 0.5, "image_pull": "not applicable: no image"}}
    ledger = build_ledger(spec, event, tags_of(first, second), choose_price(spec),
                          task_started_s=998.0, now_s=1075.0, submitted_by_this_try=True)
    m = ledger.metrics
    assert m[n.WALL_S] == pytest.approx(77.0)
    assert m[n.badput("orchestration")] == pytest.approx(1.0 + 3.0)  # 998->999, 1072->1075
    parts = m[n.PRODUCTIVE_S] + sum(m[n.badput(b)] for b in n.BUCKETS if n.badput(b) in m)
    assert parts == pytest.approx(m[n.WALL_S], rel=0.01)
    assert m[n.badput("other")] >= 0
    assert n.badput("image_pull") not in m
    assert ledger.tags[n.unknown_tag("image_pull")] == "not applicable: no image"
    assert m[n.GOODPUT] == pytest.approx(100 * 35.0 / 77.0)
    assert m[n.DISRUPTIONS] == 1 and m[n.RECOVERY_MAX_S] == pytest.approx(13.0)
    assert m[n.TPS] == pytest.approx(2000 / 35.0 / 2)
    assert m[n.TFLOPS] == pytest.approx(1e6 * m[n.TPS] / 1e12)
    assert n.MFU_PCT not in m and "'cpu'" in ledger.tags[n.unknown_tag(n.MFU_PCT)]
    assert ledger.tags[n.energy_source_tag("cpu")] == "estimated"
    assert m[n.COST_ALLOCATED] == 0.0 and ledger.tags["cost/price_source"].startswith("catalog v1:")
    assert json.loads(json.dumps(ledger.to_json()))["schema"] == n.SCHEMA


def test_a_retry_counts_its_own_start_and_queue_once_not_also_as_recovery():
    spec = load_spec(DEMO)
    first = record(1000.0, 1002.5, 1030.0, productive=20.0)  # try 1's job, which failed
    second = record(1060.0, 1063.0, 1090.0, productive=15.0)  # try 2 starts at 1050
    event = {"handle": {"submitted_at_epoch_s": 1055.0, "identity": {"try_number": 2}},
             "phases": {"queue_wait": 2.0}, "ended_at_epoch_s": 1091.0}
    ledger = build_ledger(spec, event, tags_of(first, second), choose_price(spec),
                          task_started_s=1050.0, now_s=1092.0, submitted_by_this_try=True)
    m = ledger.metrics
    assert m[n.badput("recovery")] == pytest.approx(30.0 - 5.0 - 2.0)
    assert m[n.badput("other")] >= 0


def test_background_checkpoint_writes_are_a_figure_beside_the_buckets():
    spec = load_spec(DEMO)
    first = record(1000.0, 1002.5, 1030.0, productive=20.0) | {"background_save_s": 4.0}
    second = record(1040.0, 1043.0, 1070.0, productive=15.0) | {"background_save_s": 2.5}
    event = {"handle": {}, "ended_at_epoch_s": 1072.0, "phases": {"queue_wait": 0.5}}
    ledger = build_ledger(spec, event, tags_of(first, second), choose_price(spec), task_started_s=998.0,
                          now_s=1075.0, submitted_by_this_try=True)
    m = ledger.metrics
    assert m[n.CHECKPOINT_BACKGROUND_S] == pytest.approx(6.5)
    assert m[n.badput("checkpoint_save")] == pytest.approx(3.0)  # the blocking part only
    parts = m[n.PRODUCTIVE_S] + sum(m[n.badput(b)] for b in n.BUCKETS if n.badput(b) in m)
    assert parts == pytest.approx(m[n.WALL_S])  # the background seconds are in no bucket
    older = build_ledger(spec, event, tags_of(record(1000.0, 1002.5, 1030.0, productive=20.0)),
                         choose_price(spec), task_started_s=998.0, now_s=1075.0, submitted_by_this_try=True)
    assert n.CHECKPOINT_BACKGROUND_S not in older.metrics  # a trainer that recorded none: no figure, not 0


def test_compile_seconds_are_badput_and_the_throughput_says_whether_it_was_compiled():
    spec = load_spec(DEMO)
    event = {"handle": {}, "ended_at_epoch_s": 1072.0, "phases": {"queue_wait": 0.5}}

    def ledger(*modes):
        records = [record(1000.0 + 40 * i, 1002.5 + 40 * i, 1030.0 + 40 * i, productive=15.0, compile=3.0)
                   | ({"compiled": mode} if mode else {}) for i, mode in enumerate(modes)]
        return build_ledger(spec, event, tags_of(*records), choose_price(spec), task_started_s=998.0,
                            now_s=1075.0, submitted_by_this_try=True)

    compiled = ledger("compiled", "compiled")
    m = compiled.metrics
    assert m[n.badput("compile")] == pytest.approx(6.0) and m[n.PRODUCTIVE_S] == pytest.approx(30.0)
    parts = m[n.PRODUCTIVE_S] + sum(m[n.badput(b)] for b in n.BUCKETS if n.badput(b) in m)
    assert parts == pytest.approx(m[n.WALL_S])
    assert m[n.TPS] == pytest.approx(2000 / 30.0 / 2)  # over productive time: compiling left out
    assert compiled.tags[n.COMPILE_MODE] == "compiled" == compiled.to_json()["tags"]["compile/mode"]
    assert ledger("eager").tags[n.COMPILE_MODE] == "eager"
    assert ledger("compiled", "partly_eager").tags[n.COMPILE_MODE] == "partly_eager"
    assert ledger("compiled", "eager").tags[n.COMPILE_MODE] == "partly_eager"  # attempts that differ
    assert n.COMPILE_MODE not in ledger(None, "compiled").tags  # a trainer from before did not say


def test_no_attempt_record_makes_the_trainer_buckets_unknown_not_zero():
    spec = load_spec(DEMO)
    ledger = build_ledger(spec, {"handle": {}}, {}, choose_price(spec), task_started_s=0.0,
                          now_s=10.0, submitted_by_this_try=True)
    assert n.badput("program_startup") not in ledger.metrics
    assert ledger.tags[n.unknown_tag("program_startup")].startswith("unknown:")
    assert ledger.metrics[n.badput("other")] == pytest.approx(10.0)


def test_mfu_uses_the_device_table_and_is_absent_without_a_peak():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.5)
    assert peak_tflops("NVIDIA H100 PCIe") == pytest.approx(756.0)
    assert mfu_pct(6e9, 50_000, "NVIDIA A100-SXM4-80GB") == pytest.approx(100 * 3e14 / 312e12)
    assert mfu_pct(6e9, 50_000, "cpu") is None


def test_energy_is_measured_only_when_every_attempt_measured_it():
    spec = validate_overrides(load_spec(DEMO), {"training.engine": "slurm", "training.resources.nodes": 2})
    both = [record(0, 1, 2, productive=1, energy={"cpu": 3.6e6}),
            record(3, 4, 5, productive=1, energy={"cpu": 1.8e6})]
    kwh, sources = energy_kwh(spec, both, 0.0, 10.0)
    assert sources == {"cpu": "measured-rapl"} and kwh["cpu"] == pytest.approx(3.0)  # x 2 nodes
    kwh, sources = energy_kwh(spec, [both[0], record(3, 4, 5, productive=1)], 0.0, 10.0)
    assert sources == {"cpu": "estimated"} and kwh["cpu"] == pytest.approx(0.1)  # 10 core-h x 10 W
    gpu = validate_overrides(spec, {"training.resources.gpus_per_node": 2,
                                    "training.resources.processes_per_node": 2})
    assert energy_kwh(gpu, both, 4.0, 10.0)[1] == {"cpu": "measured-rapl", "gpu": "estimated"}


def test_the_price_comes_from_the_catalog_unless_the_spec_sets_one():
    spec = load_spec(DEMO)  # local engine: the catalog's local row
    price = choose_price(spec)
    assert price.per_machine_hour == 0.0 and price.date == "2026-12-01"
    aws = validate_overrides(spec, {"cost.cloud": "aws", "cost.instance_type": "p4d.24xlarge"})
    price = choose_price(aws)
    assert price.per_machine_hour == pytest.approx(32.7726) and "aws/p4d.24xlarge" in price.source
    assert price.cost(2.0, 16.0, 0.0) == pytest.approx(65.5452)
    own = validate_overrides(aws, {"cost.price_per_hour": 12.5})
    assert choose_price(own) == Price("USD", "spec: cost.price_per_hour", "spec", per_machine_hour=12.5)
    per_device = validate_overrides(spec, {"cost.cpu_hour_price": 0.05})
    assert choose_price(per_device).per_cpu_core_hour == 0.05
    with pytest.raises(CatalogError, match="'p9.huge'.*expected one of: local/localhost"):
        choose_price(validate_overrides(spec, {"cost.cloud": "aws", "cost.instance_type": "p9.huge"}))
    cluster = validate_overrides(spec, {"training.engine": "slurm"})
    assert choose_price(cluster).startswith("unknown: the slurm engine")


def test_a_bad_catalog_row_names_file_line_column_and_value(tmp_path):
    bad = tmp_path / "prices.csv"
    bad.write_text(Path(load_catalog.__globals__["CATALOG"]).read_text().splitlines()[0]
                   + "\naws,x,,0,4,cheap,USD,,2026-01-01,me\n")
    with pytest.raises(CatalogError, match=r"prices.csv, line 2, column price_per_hour: 'cheap'"):
        load_catalog(bad)
    (tmp_path / "short.csv").write_text("cloud,instance_type\n")
    with pytest.raises(CatalogError, match="missing column"):
        load_catalog(tmp_path / "short.csv")


def test_the_checkpoint_staging_of_each_attempt_is_a_tag():
    spec = load_spec(DEMO)
    event = {"handle": {}, "ended_at_epoch_s": 1072.0, "phases": {"queue_wait": 0.5}}
    staged = {"mode": "pageable", "state_bytes": 10, "pinned_bytes": 16, "budget_bytes": 12,
              "source": "cgroup v2 memory.max"}
    records = [record(1000.0, 1002.5, 1030.0, productive=15.0) | {"checkpoint_staging": staged},
               record(1040.0, 1043.0, 1070.0, productive=15.0) | {"checkpoint_staging": {**staged, "mode": "synchronous"}},
               record(1071.0, 1072.0, 1074.0, productive=1.0)]  # no save in it
    ledger = build_ledger(spec, event, tags_of(*records), choose_price(spec), task_started_s=998.0,
                          now_s=1075.0, submitted_by_this_try=True)
    assert ledger.tags[n.CHECKPOINT_STAGING] == "pageable,synchronous" == ledger.to_json()["tags"]["checkpoint/staging"]
    assert n.CHECKPOINT_STAGING not in build_ledger(spec, event, tags_of(records[2]), choose_price(spec),
                                                    task_started_s=998.0, now_s=1075.0,
                                                    submitted_by_this_try=True).tags
