"""Runs every benchmark script, each in its own process, and writes their tables
to one Markdown file headed by a description of the machine.

Run with `python benchmarks/run_all.py [--output FILE] [--docs FILE] [--quick]`,
or through `nox -s bench`, which writes `benchmarks/results.md` and fills
`docs/performance.md` from it: the "What it costs you" table between its
`summary` markers (figures taken from the groups' tables), the tables between
its `results` markers, and the machine and the method between its `method`
markers. `--from-results` runs nothing and rebuilds the page from the results
file as it is (a group measured on its own, appended to it with its script's
`--append`, shows there as it was measured).

`python benchmarks/run_all.py --smoke` checks that the benchmarks still run:
each script runs its smallest case once with its `--smoke` and checks its
values (handled against hand-written results, and the targets that are not
times), its times meaning nothing. It writes no file, goes on past a script
that fails, and exits non-zero if any did.
"""

import argparse
import datetime
import importlib.metadata
import os
import pathlib
import platform
import re
import runpy
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).parent
SCRIPTS = [
    "bench_unhandled.py",
    "bench_mlp.py",
    "bench_scan.py",
    "bench_repeated.py",
    "bench_flax.py",
    "bench_perturb.py",
    "bench_custom_vjp.py",
    "bench_modules.py",
    "bench_stats.py",
    "bench_handlers.py",
    "bench_first_result.py",
    "bench_gpt.py",
    "bench_derivatives.py",
    "bench_sites.py",
    "bench_taps.py",
]

TITLE = (
    "# Benchmark results\n\nWritten by `nox -s bench` (`benchmarks/run_all.py`).\n\n"
)

# The "What it costs you" table: per row, per column (run time, first call,
# memory), the group and the start of the row's label in that group's tables
# whose ratio is the figure. Every reference returns what the handled program
# returns, written by hand (or is the untagged program, for tags unhandled).
SUMMARY = [
    (
        "no handler (tags unhandled)",
        [
            ("1", "run time, 200-layer MLP"),
            ("11", "first result, tags unhandled"),
            ("11", "memory, tags unhandled"),
        ],
    ),
    (
        "`fx.Tag()`",
        [
            ("2", "run time, 200 layers"),
            ("11", "first result, `Tag()`"),
            ("11", "memory, `Tag()`"),
        ],
    ),
    (
        "`fx.Stats()`",
        [
            ("12a", "list: `Stats()`, steady"),
            ("12a", "list: `Stats()`, first call"),
            ("11", "memory, `Stats()`"),
        ],
    ),
    (
        "a handler matching nothing",
        [
            ("11", "run time, a handler matching nothing"),
            ("11", "first result, a handler matching nothing"),
            ("11", "memory, a handler matching nothing"),
        ],
    ),
]

HOW_TO_READ = """\
Each row measures A and B side by side in one process: A and B alternate
within every round, times are medians over the rounds, and the ratio is the
median over the rounds of A / B. The spread is the interquartile range of the
per-round ratios. A target is met ("yes") when the whole spread is within it,
missed ("no") when none of it is, and "within noise" when the spread straddles
it. Cold trace+lower builds new function objects every round, so no cache keyed
on the function helps. Targets marked † are carried over from the closest
stated one to a comparison that has none of its own.
"""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=HERE, capture_output=True, text=True, check=True
    ).stdout.strip()


def revision() -> str:
    """The commit benchmarked, and whether the package differs from it."""
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "../effects")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" with local changes to effects/" if dirty else "")


def machine() -> str:
    import jax  # here, so `--help` stays fast

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    date = datetime.datetime.now(datetime.UTC)
    return "\n".join(
        [
            f"- CPU: {cpu_model()}, {cores or os.cpu_count()} cores available",
            f"- JAX backend: {jax.default_backend()} ({devices})",
            f"- Python {platform.python_version()}, jax {version('jax')}, "
            f"jaxlib {version('jaxlib')}, equinox {version('equinox')}, "
            f"flax {version('flax')}, effects {version('effects')} "
            f"(commit {revision()})",
            f"- Date: {date:%Y-%m-%d %H:%M} UTC",
        ]
    )


def sections(results: str) -> dict[str, str]:
    """The results' sections by group number ("1", "11", "12a", ...)."""
    parts = re.split(r"^### (?=\d+[a-z]?\.)", results, flags=re.M)
    return {part.split(".", 1)[0]: part for part in parts[1:]}


def figure(results: dict[str, str], group: str, label: str) -> str:
    """The ratio of the first row of `group` whose label starts with `label`."""
    for line in results.get(group, "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4 and cells[0].startswith(label):
            ratio = cells[3]
            return f"{float(ratio):.2f}" if re.fullmatch(r"[\d.]+", ratio) else ratio
    return "not measured"


def summary(results: str) -> str:
    """The "What it costs you" table, from the groups' tables."""
    found = sections(results)
    lines = [
        "| | run time | first call (trace+compile) | memory | from groups |",
        "|---|---|---|---|---|",
    ]
    for what, cells in SUMMARY:
        figures = [figure(found, group, label) for group, label in cells]
        groups = ", ".join(dict.fromkeys(group for group, _ in cells))
        lines.append(f"| {what} | " + " | ".join(figures) + f" | {groups} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", default=str(HERE / "results.md"), help="the Markdown file"
    )
    parser.add_argument(
        "--docs", help="a Markdown page whose `results` section gets the tables too"
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument(
        "--from-results",
        action="store_true",
        help="run nothing: rebuild the `--docs` page from the results file",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="each script's smallest case once, checking its values: write "
        "nothing, exit non-zero if a script fails",
    )
    args = parser.parse_args()
    if args.smoke:
        if args.docs or args.from_results:
            parser.error("--smoke writes nothing: leave out --docs and --from-results")
        raise SystemExit(smoke())

    output = pathlib.Path(args.output)
    if not args.from_results:
        text = f"{TITLE}{machine()}\n\n{HOW_TO_READ}\n"
        output.write_text(text, encoding="utf-8")
        for script in SCRIPTS:
            command = [sys.executable, str(HERE / script), "--append", str(output)]
            subprocess.run(command + ["--quick"] * args.quick, check=True)
    if args.docs:
        update_docs(pathlib.Path(args.docs), output.read_text(encoding="utf-8"))


def smoke() -> int:
    """Runs every script with `--smoke`, all of them whatever fails; returns
    the exit status: 1 if any failed. They run in this process, one after
    the other, as `python SCRIPT --smoke` would: importing JAX and the
    libraries once instead of once per script saves a good part of the run,
    and no time is measured that another script's caches could spoil."""
    failed, took = [], {}
    for script in SCRIPTS:
        print(f"## {script} --smoke", flush=True)
        sys.argv = [str(HERE / script), "--smoke"]
        start = time.perf_counter()
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:  # how a script's checks fail
            if e.code not in (None, 0):
                traceback.print_exc()
                failed.append(script)
        except Exception:
            traceback.print_exc()
            failed.append(script)
        took[script] = time.perf_counter() - start
    print("\nsmoke run, wall time per script (not a measurement of effects):")
    for script, seconds in took.items():
        status = "FAILED" if script in failed else "ok"
        print(f"  {script:24} {seconds:6.1f} s  {status}")
    print(f"  {'total':24} {sum(took.values()):6.1f} s")
    if failed:
        print(f"smoke run: {len(failed)} failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def update_docs(page: pathlib.Path, results: str) -> None:
    """Fills the page's `summary`, `method` and `results` markers from the
    results file: the cost table, the machine and how to read the tables,
    and the tables themselves."""
    body = results.removeprefix(TITLE).strip()
    method, _, tables = body.partition("\n### ")
    parts = {
        "summary": summary(results),
        "method": method.strip(),
        "results": "### " + tables.strip(),
    }
    text = page.read_text(encoding="utf-8")
    for name, part in parts.items():
        markers = re.compile(rf"(<!-- {name} -->).*?(<!-- /{name} -->)", re.S)
        text, count = markers.subn(lambda m, part=part: f"{m[1]}\n{part}\n{m[2]}", text)
        if count != 1:
            raise SystemExit(
                f"{page}: expected one pair of {name} markers, found {count}"
            )
    page.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
