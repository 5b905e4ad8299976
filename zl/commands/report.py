"""`zl report`: summarize a run's telemetry into report.json, report.md and plots."""

from dataclasses import dataclass
from pathlib import Path

import typer

from zl_base.errors import ZLError
from zl.options import settings_command
from zl_base.settings import REQUIRED, setting


@dataclass(frozen=True)
class ReportArgs:
    """`zl report`'s argument and options."""

    run_dir: Path = setting(REQUIRED, "The run directory: metrics.jsonl (merged) and/or "
                                      "stages/stage_<k>/metrics.jsonl, and manifest.json.", argument="RUN_DIR")
    manifest: Path | None = setting(None, "The export's manifest.json, for the stages' layer ranges (default "
                                          "RUN_DIR/manifest.json when present).")
    plots: bool = setting(True, "Also draw plots/latency.png and plots/loss.png.")


REPORT_DOC = """Write RUN_DIR/report.json, report.md and plots/ from the run's telemetry.

Per stage: median and p95 of phase-1, phase-2, queue, send and total time per micro-batch, peak PSS and temperature; for the run: wall time and records/s; after failures: detection, replay and recovery times. A replayed micro-batch counts once (its last run).

Examples:

  zl report runs/demo

  zl report runs/phones --manifest runs/export/manifest.json --no-plots
"""


def run_report(args: ReportArgs) -> None:
    from zl_device.results.report import write_report

    run_dir = args.run_dir
    if not run_dir.is_dir():
        raise ZLError(f"{run_dir}: not a directory; pass the run directory that holds metrics.jsonl.")
    report = write_report(run_dir, args.manifest, plots=args.plots)
    run = report["run"]
    rate = "n/a" if run["records_per_s"] is None else f"{run['records_per_s']:.4f}"
    wall = "n/a" if run["wall_s"] is None else f"{run['wall_s']:.1f} s"
    typer.echo(f"run: {wall}, {run['samples'] if run['samples'] is not None else 'n/a'} samples, {rate} records/s")
    for s in report["stages"]:
        total = s["total_ms"]
        median = "n/a" if total["median"] is None else f"{total['median']:.1f}"
        p95 = "n/a" if total["p95"] is None else f"{total['p95']:.1f}"
        pss = "n/a" if s["peak_pss_mib"] is None else f"{s['peak_pss_mib']:.0f} MiB"
        typer.echo(f"stage {s['index']}: {s['micro_batches']} micro-batches, total {median} ms median / {p95} ms p95, "
                   f"peak PSS {pss}")
    if report["recovery"]:
        typer.echo(f"recovery: {len(report['recovery'])} failure(s), see report.md")
    for name in report["files"].values():
        typer.echo(f"wrote {run_dir / name}")


report_command = settings_command(ReportArgs, run_report, REPORT_DOC)
COMMANDS = {"report": report_command}
