"""Runs every benchmark script, each in its own process, and writes their tables
to one Markdown file headed by a description of the machine.

Run with `python benchmarks/run_all.py [--output FILE] [--docs FILE] [--quick]`,
or through `nox -s bench`, which writes `benchmarks/results.md` and puts the same
tables into `docs/performance.md` (between its `results` markers).
"""

import argparse
import datetime
import importlib.metadata
import os
import pathlib
import platform
import re
import subprocess
import sys

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
]

TITLE = (
    "# Benchmark results\n\nWritten by `nox -s bench` (`benchmarks/run_all.py`).\n\n"
)
MARKERS = re.compile(r"(<!-- results -->).*?(<!-- /results -->)", re.S)

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", default=str(HERE / "results.md"), help="the Markdown file"
    )
    parser.add_argument(
        "--docs", help="a Markdown page whose `results` section gets the tables too"
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()

    output = pathlib.Path(args.output)
    output.write_text(f"{TITLE}{machine()}\n\n{HOW_TO_READ}\n", encoding="utf-8")
    for script in SCRIPTS:
        command = [sys.executable, str(HERE / script), "--append", str(output)]
        subprocess.run(command + ["--quick"] * args.quick, check=True)
    if args.docs:
        update_docs(pathlib.Path(args.docs), output.read_text(encoding="utf-8"))


def update_docs(page: pathlib.Path, results: str) -> None:
    """Replaces what lies between the page's `results` markers with `results`
    (without its title)."""
    body = results.removeprefix(TITLE).strip()
    text = page.read_text(encoding="utf-8")
    new, count = MARKERS.subn(lambda m: f"{m[1]}\n{body}\n{m[2]}", text)
    if count != 1:
        raise SystemExit(f"{page}: expected one pair of results markers, found {count}")
    page.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
