"""Fusion and combiner lifting, measured: records/s of one pipeline, optimized and not.

A 6-stage element-wise chain (map, map, filter, map, flat_map, key_by) and a keyed sum over
N generated records, run on local Spark with every optimizer rule on and with every rule off,
alternating, in one process. Prints records/s per run and the median of each.

    python bench/fusion.py [--records 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from onceflow import Pipeline, sinks, sources
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session


def build(records: int, sink: sinks.Collect) -> Pipeline:
    p = Pipeline("bench-fusion")
    (
        p.read("gen", sources.Generate(records))
        .map("add", lambda x: x + 1)
        .map("triple", lambda x: x * 3)
        .filter("not-7", lambda x: x % 7 != 0)
        .map("shift", lambda x: x - 2)
        .flat_map("one", lambda x: (x,))
        .key_by("key", lambda x: x % 1000)
        .combine_per_key("sum", "sum")
        .write("out", sink)
    )
    return p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--master", default=DEFAULT_MASTER)
    args = parser.parse_args()

    spark = spark_session(args.master, app_name="bench-fusion")
    sink = sinks.Collect()
    pipeline = build(args.records, sink)
    configs = {"fused + lifted (all rules)": None, "unoptimized (no rules)": ()}
    for label, rules in configs.items():
        plan = pipeline.plan(rules)
        print(
            f"{label}: {len(plan.stages)} stage(s): "
            + " | ".join("+".join(s.nodes) for s in plan.ordered)
        )
    pipeline.run(session=spark, progress=False, rules=(), output_dir="/tmp/onceflow-bench")
    results: dict[str, list[float]] = {label: [] for label in configs}
    expected = None
    for i in range(args.repeat):
        for label, rules in configs.items():
            started = time.perf_counter()
            pipeline.run(
                session=spark, progress=False, rules=rules, output_dir="/tmp/onceflow-bench"
            )
            seconds = time.perf_counter() - started
            total = sum(v for _, v in sink.results)
            expected = total if expected is None else expected
            assert total == expected, "optimized and unoptimized results differ"
            rate = args.records / seconds
            results[label].append(rate)
            print(f"  run {i + 1} {label:<28} {seconds:6.2f} s  {rate:>12,.0f} records/s")
    print()
    print(f"{'plan':<28} {'median records/s':>18}")
    medians = {label: statistics.median(rates) for label, rates in results.items()}
    for label, rate in medians.items():
        print(f"{label:<28} {rate:>18,.0f}")
    fused, plain = medians.values()
    print(f"speed-up of optimization: {fused / plain:.2f}x over {args.records:,} records")


if __name__ == "__main__":
    main()
