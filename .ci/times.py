"""Prints how long each nox session of a CI run took, from nox's JSON reports
(`nox --report FILE`), and the whole run's time against CI's budget."""

import argparse
import json
import pathlib

BUDGET = 90 * 60  # CI's limit for one run of .ci/run, in seconds
TARGET = 40 * 60  # what a run is kept within, so that it has room to grow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("reports", nargs="*", type=pathlib.Path)
    parser.add_argument("--total", type=int, required=True)
    args = parser.parse_args()
    print("\nCI time per nox session (bash .ci/run)")
    print(f"{'session':<24} {'seconds':>8}  result")
    for report in sorted(args.reports):
        if not report.exists():  # (a nox run that stopped before its report)
            continue
        for s in json.loads(report.read_text())["sessions"]:
            name = s["signatures"][0] if s["signatures"] else s["name"]
            print(f"{name:<24} {s.get('duration', 0.0):>8.0f}  {s['result']}")
    print(
        f"{'whole run':<24} {args.total:>8d}  {args.total / BUDGET:.0%} of CI's "
        f"{BUDGET // 60} minutes (kept within {TARGET // 60})"
    )


if __name__ == "__main__":
    main()
