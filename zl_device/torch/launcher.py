"""Starting a torch job's ranks on this host and restarting them after a failure (docs/design#torch-runtime).

`launch_ranks` is zl's launcher (`zl train --runtime torch`, tools/bench_pipelines.py): one process per stage
(torch.multiprocessing spawn, harness.spawned), every rank restarted after a failure as torch elastic restarts a
worker group. `torchrun_instructions` is what to run instead under torchrun. From the ranks' telemetry afterwards:
`training_span` (the run's time) and `recovery_events` (the failures and restarts as the coordinator reports them).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.formats.metrics_log import stage_lines
from zl_device.formats.run_layout import RunLayout
from zl_device.formats.windows import WindowPlan

@dataclass
class RankFailure:
    """A failure of the ranks' attempt: the stage, what happened, when it was seen and when the ranks restarted."""

    stage: int
    reason: str
    t_unix_ms: int
    restart_unix_ms: int | None = None  # None: no restart (the run failed)


def launch_ranks(job_path: Path, world: int, timeout_s: float, max_restarts: int, on_poll=None,
                 on_restart=None) -> tuple[float, float, list[RankFailure]]:
    """One process per stage on this host (torch.multiprocessing spawn, rendezvous on a free 127.0.0.1 port);
    returns the (start, end) Unix times of the run and its failures. `on_poll()` is called about once a second,
    `on_restart(failure)` before the ranks start again after one.

    Recovery is torch elastic's (docs/design#torch-runtime): a rank that dies (a signal, an exit, an exception other
    than a `ZLError`) ends the others at once, and all ranks start again, up to `max_restarts` times, resuming from the
    latest window every stage checkpointed (`job.for_attempt`). A `ZLError` in a rank (a bad job, a
    neighbour past --link-timeout) is not retried; a run past `timeout_s` is stopped.

    Raises:
        ZLError: naming the stage that failed and its last error line, or the timeout.
    """
    start = time.time()
    failures: list[RankFailure] = []
    while True:
        failure = _run_attempt(job_path, world, len(failures), start, timeout_s, on_poll)
        if failure is None:
            return start, time.time(), failures
        stage, reason, retry = failure
        failures.append(RankFailure(stage, reason, int(time.time() * 1000)))
        if not retry or len(failures) > max_restarts:
            after = f" (after {len(failures) - 1} restart(s) of every rank)" if len(failures) > 1 else ""
            hint = " Its output is above; out of memory?" if reason.startswith("died") else ""
            raise ZLError(f"--runtime torch: stage {stage} {reason}{after}; the other stages were stopped.{hint}")
        if on_restart is not None:
            on_restart(failures[-1])
        failures[-1].restart_unix_ms = int(time.time() * 1000)


def _run_attempt(job_path: Path, world: int, attempt: int, start: float, timeout_s: float,
                 on_poll) -> tuple[int, str, bool] | None:
    """The ranks' attempt `attempt` to the end: None when every rank finished, else (the failed stage, what
    happened, whether a restart may help). The ranks still alive are stopped on the way out."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    from zl_device.devices.network import free_port_base
    from zl_device.torch.harness import spawned

    init_method = f"tcp://127.0.0.1:{free_port_base(1)}"
    ctx = mp.start_processes(spawned, args=(str(job_path), world, init_method, attempt), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=1.0):
            if on_poll is not None:
                on_poll()
            if time.time() - start > timeout_s:
                raise ZLError(f"the run took longer than --timeout {timeout_s:g} s and was stopped; raise --timeout.")
        return None
    except ProcessRaisedException as e:
        # A neighbour of a rank that was killed can fail first (its connection reset): blame the killed one.
        killed = _killed_rank(ctx.processes)
        if killed is not None:
            return killed
        deliberate = "ZLError: " in _last_line_raw(e.msg)
        return e.error_index, f"failed: {_last_line(e.msg)}", not deliberate
    except ProcessExitedException as e:
        return e.error_index, _death(e.exit_code), True
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()


def _killed_rank(processes) -> tuple[int, str, bool] | None:
    """(stage, what happened, True) for the first rank that a signal ended, if any: not SIGTERM, which
    torch.multiprocessing's join sends the ranks still alive once one failed."""
    for k, p in enumerate(processes):
        if p.exitcode is not None and p.exitcode < 0 and p.exitcode != -signal.SIGTERM:
            return k, _death(p.exitcode), True
    return None


def _death(exit_code: int | None) -> str:
    return f"died ({f'signal {-exit_code}' if exit_code is not None and exit_code < 0 else f'exit code {exit_code}'})"


def _last_line_raw(message: str) -> str:
    """The exception line of a child's traceback text."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else message


def _last_line(message: str) -> str:
    """The exception line of a child's traceback text, its ZLError class name cut ("zl_base.errors.ZLError: ..." ->
    "...")."""
    last = _last_line_raw(message)
    return last.split("ZLError: ", 1)[1] if "ZLError: " in last else last


def torchrun_instructions(run_dir: Path, job_path: Path, num_stages: int, max_restarts: int) -> list[str]:
    """What to run after `--launcher torchrun`: the ranks under torchrun, then merge and report."""
    layout = RunLayout(run_dir)
    return [f"prepared {run_dir}; start its {num_stages} ranks (one per stage) with torchrun:",
            f"  torchrun --standalone --nproc-per-node {num_stages} --max-restarts {max_restarts} "
            f"-m zl_device.torch {job_path}",
            "  (after a failure torchrun restarts every rank; they resume from the latest window all stages "
            "checkpointed)",
            "  (on several nodes: --nnodes N --nproc-per-node <stages per node> --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:PORT on each, with {run_dir} on a filesystem all nodes share)",
            "then:",
            f"  zl merge --checkpoints {layout.checkpoints} --manifest {layout.manifest} --out {layout.adapter}",
            f"  zl report {run_dir}"]


def training_span(run_dir: Path, num_stages: int, since_ms: int = 0) -> tuple[int, int]:
    """(earliest `start`, latest `done`) t_unix_ms of the ranks since `since_ms` (this launch: not the attempts of
    a run that `--resume` continues): from the barrier after every rank built its stage to the last stage's end,
    restarts after failures included."""
    begin, end = [], []
    for lines in stage_lines(RunLayout(run_dir), num_stages):
        begin.append(min(r["t_unix_ms"] for r in lines if r["type"] == "start" and r["t_unix_ms"] >= since_ms))
        end.append([r["t_unix_ms"] for r in lines if r["type"] == "done"][-1])
    return min(begin), max(end)


def recovery_events(run_dir: Path, num_stages: int, windows: WindowPlan, failures: list[RankFailure]) -> list[dict]:
    """The coordinator's `failure`, `restart` and `recovered` events (docs/design#telemetry) of the ranks' restarts,
    from their telemetry, so that `zl report` shows the recoveries as it does the runners'. A global recovery:
    the restart is every rank's; recovered is when the stage downstream of the failed one (itself, if last)
    commits the window that was in flight at the failure."""
    lines = stage_lines(RunLayout(run_dir), num_stages)
    events: list[dict] = []
    for f in failures:
        held = [_done_at(ls, f.t_unix_ms) for ls in lines]
        in_flight = windows.window_of(min(held[f.stage], windows.num_micro_batches - 1))
        events.append({"type": "failure", "stage": f.stage, "t_unix_ms": f.t_unix_ms, "detected_after_ms": None,
                       "window": in_flight, "micro_batch": held[f.stage], "reason": f.reason})
        if f.restart_unix_ms is None:
            continue
        restarted = [min((r for r in ls if r["type"] == "start" and r["t_unix_ms"] >= f.restart_unix_ms),
                         key=lambda r: r["t_unix_ms"], default=None) for ls in lines]
        replayed = sum(max(h - r["first_micro_batch"], 0) for h, r in zip(held, restarted) if r is not None)
        events.append({"type": "restart", "stage": f.stage, "t_unix_ms": f.restart_unix_ms, "scope": "global",
                       "replayed_micro_batches": replayed, "replay_bytes": None, "device": f"rank-{f.stage}",
                       "rolled_back_to_window": next((r["resumed_from_window"] for r in restarted if r), None),
                       "standby": False})
        downstream = min(f.stage + 1, num_stages - 1)
        commit = min((r["t_unix_ms"] for r in lines[downstream] if r["type"] == "window"
                      and r["window"] == in_flight and r["t_unix_ms"] >= f.restart_unix_ms), default=None)
        if commit is not None:
            events.append({"type": "recovered", "stage": f.stage, "t_unix_ms": commit,
                           "recovery_ms": float(commit - f.restart_unix_ms),
                           "since_failure_ms": float(commit - f.t_unix_ms), "downstream_stage": downstream,
                           "window": in_flight})
    return events


def _done_at(lines: list[dict], t_unix_ms: int) -> int:
    """The micro-batches a stage had done at `t_unix_ms` in its attempt then running (from its last `start` line
    before; 0 if it had not started), from its telemetry lines."""
    starts = [r for r in lines if r["type"] == "start" and r["t_unix_ms"] <= t_unix_ms]
    if not starts:
        return 0
    since, first = starts[-1]["t_unix_ms"], starts[-1]["first_micro_batch"]
    return max((r["micro_batch"] + 1 for r in lines if r["type"] == "micro_batch"
                and since <= r["t_unix_ms"] <= t_unix_ms), default=first)
