"""ZeroLock on torch ranks: every stage trains on its own local loss; hidden states go forward, nothing comes back.

Rank k trains stage k with `StageStep`, the step `train_zerolock` runs, so the
result equals the single-process eager reference (docs/design#torch-runtime), in
the order of its list from the schedule table's zerolock row (as the runner). Per
micro-batch: input (stage 0: its shard rows; else the entry from rank k-1,
link.py) -> phase 1 -> `isend` to rank k+1 -> phase 2 (local loss, backward)
while the send goes on (early forwarding). Per window: AdamW step, flush (rank
k+1 holds every entry of the window, as the runner commits only what
downstream holds), commit.

A stage held still (lr 0, not the last; `Rank.forward_only`) runs phase 1 and
the send only, as the runner does (docs/design#windows-and-adamw): its lines say
`forward_only: true`, with phase2_ms 0 and null losses.
"""

from __future__ import annotations

import time

from zl_device.formats.schedule_table import FORWARD, STEP, stage_actions
from zl_device.torch.eager_training import StageStep, micro_batch
from zl_device.torch.link import StageLink
from zl_device.torch.schedules.base import Schedule
from zl_device.torch.stage_io import Rank


class ZeroLock(Schedule):
    """ZeroLock's pipeline: local losses, early forwarding, a flush per window; resumes after a restart."""

    name = "zerolock"
    resumable = True

    def __init__(self, rank: Rank):
        super().__init__(rank)
        job, plan = rank.job, rank.plan
        self.shard = rank.shard() if rank.first else None
        self.forward_only = rank.forward_only
        self.step = StageStep(rank.module, rank.lr, rank.optimizer_settings, plan.num_windows,
                              forward_only=self.forward_only)
        self.optimizer, self.scheduler = self.step.optimizer, self.step.scheduler
        # Built now, receiving only in `train`: on NCCL a p2p op queued ahead of the harness's barrier can deadlock it.
        self.link = StageLink(rank.index, rank.world, rank.batch, rank.manifest.model.hidden_size, rank.device,
                              job.in_flight, job.link_timeout_s, receive_ahead=rank.backend == "gloo")

    def train(self, first_window: int) -> dict:
        """Run this stage's list from the schedule table's zerolock row: per micro-batch F (input, phase 1, send)
        then B (phase 2 on the local loss; none when held still), and S (the step, flush, commit) per window."""
        rank, plan, step, link = self.rank, self.rank.plan, self.step, self.link
        first_mb = plan.start(first_window)
        if not rank.first:
            link.start_receiving(first_mb, plan.num_micro_batches)
        forward: tuple = ()  # the last forward's (labels, send_ms, t0..t3), for its B and its line
        for action in stage_actions("zerolock", rank.index, rank.world, plan, first_mb, self.forward_only):
            mb, w = action.micro_batch, plan.window_of(action.micro_batch)
            if action.kind == STEP:
                lr, means = step.end_window()
                flush_ms = link.flush()  # as the runner: commit only what downstream holds
                rank.commit(w, self.optimizer, step.optimizer_step, lr, mean_loss=means[0],
                            mean_task_loss=means[1], mean_consistency_loss=means[2], flush_ms=flush_ms,
                            forward_only=self.forward_only)
                continue
            if action.kind == FORWARD:
                if mb == plan.start(w):
                    step.start_window()
                rank.fail_if_injected(mb)
                t0 = time.perf_counter()
                if rank.first:
                    x, mask, labels = (t.to(rank.device)
                                       for t in micro_batch(self.shard, mb, rank.batch, rank.job.trim_padding))
                else:
                    x, mask, labels = link.receive(mb, more=mb + 1 < plan.num_micro_batches)
                t1 = time.perf_counter()
                h = step.begin(x, mask)  # (B, L, D)
                t2 = time.perf_counter()
                send_ms = link.send(mb, h, mask, labels) if not rank.last else 0.0  # early forwarding: before phase 2
                forward = (labels, send_ms, t0, t1, t2, time.perf_counter())
                if not self.forward_only:
                    continue
                loss = task = consistency = None  # held still: no B follows
            else:
                loss, task, consistency = step.finish(forward[0])
            _, send_ms, t0, t1, t2, t3 = forward
            t4 = time.perf_counter()
            rank.write("micro_batch", window=w, micro_batch=mb, phase1_ms=(t2 - t1) * 1e3,
                       phase2_ms=0.0 if self.forward_only else (t4 - t3) * 1e3, queue_ms=(t1 - t0) * 1e3,
                       send_ms=send_ms, total_ms=(t4 - t0) * 1e3, loss=loss, task_loss=task,
                       consistency_loss=consistency,
                       # PSS only on window lines: reading smaps_rollup costs ~10 ms, a tiny stage's whole step.
                       pss_mib=None, temperature_c=None, early_forwarding=True, forward_only=self.forward_only)
        link.flush()
        return {"link": link.stats()}
