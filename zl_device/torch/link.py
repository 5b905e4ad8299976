"""The data-plane link of `--runtime torch`: stage k's hidden states to stage k+1 over torch.distributed p2p.

One DATA entry per micro-batch, as three point-to-point messages (the runner's
DATA frame, docs/design#data-plane-link, without MAC or input log):

    header  (2,) int64         [micro-batch id, L]   L = the micro-batch's length after cutting the padding
    ints    (2, B, L) int64    attention mask, labels
    hidden  (B, L, D) float32  the stage's output hidden state

`send` posts the three with `isend` and returns at once, so the sender's phase 2
(local loss, backward) overlaps the transfer, as the runner's early forwarding
does; at most `depth` entries are un-received, beyond that `send` waits:
back-pressure. Gloo moves a message only once the receiver has posted its
receive, so on gloo (`receive_ahead`) a thread of the receiver takes the
entries as they come, up to `depth` ahead of the stage, as the runner's peer
link does: the transfer of micro-batch i+1 overlaps the receiver's compute
of micro-batch i, and the sender's flush before a commit returns once the
entries have landed, not once the receiver gets round to them. On NCCL (p2p
ops from two threads can deadlock there) the stage posts each entry's receives
itself when it needs the entry; only the next header's `irecv` is posted ahead.

Every wait is bounded by `timeout_s`: a neighbour that died or hangs makes this
rank fail with a `ZLError` that names the stage, the micro-batch and the fix,
instead of waiting forever (a dead neighbour usually shows sooner, as a closed
connection).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from zl_base.errors import ZLError

HEADER_TAG, INTS_TAG, HIDDEN_TAG = 0, 1, 2


class StageLink:
    """Stage `rank`'s ends of the links to `rank - 1` (receive) and `rank + 1` (send)."""

    def __init__(self, rank: int, world: int, batch: int, hidden: int, device: torch.device, depth: int,
                 timeout_s: float, receive_ahead: bool = False):
        self.rank, self.world = rank, world
        self.receive_ahead = receive_ahead
        self._arrived: queue.Queue | None = None  # entries (or the error) the receiving thread took
        self.batch, self.hidden, self.device = batch, hidden, device
        self.depth = max(1, depth)
        self.timeout = timedelta(seconds=timeout_s)
        self._pending: deque[tuple[int, list, tuple]] = deque()  # (micro-batch, works, tensors kept alive)
        self._header: tuple[torch.Tensor, object] | None = None  # the posted receive of the next header
        self.sent = 0
        self.received = 0
        self.max_in_flight = 0

    # --- sending (every stage but the last) ---------------------------------------------------------------

    def send(self, mb: int, hidden: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> float:
        """Post micro-batch `mb`'s entry to stage rank+1; returns the ms spent waiting for a free slot.

        Args:
            hidden: (B, L, D) float32; mask, labels: (B, L) int64. Kept alive until the receiver has them.
        """
        start = time.perf_counter()
        while len(self._pending) >= self.depth:
            self._wait_oldest()
        blocked_ms = (time.perf_counter() - start) * 1e3
        header = torch.tensor([mb, hidden.shape[1]], dtype=torch.int64, device=self.device)
        ints = torch.stack([mask, labels]).contiguous()  # (2, B, L)
        hidden = hidden.contiguous()
        dst = self.rank + 1
        works = [dist.isend(header, dst, tag=HEADER_TAG), dist.isend(ints, dst, tag=INTS_TAG),
                 dist.isend(hidden, dst, tag=HIDDEN_TAG)]
        self._pending.append((mb, works, (header, ints, hidden)))
        self.sent += 1
        self.max_in_flight = max(self.max_in_flight, len(self._pending))
        return blocked_ms

    def flush(self) -> float:
        """Wait until stage rank+1 has received every entry sent so far (the runner's flush before a commit);
        returns the ms it took."""
        start = time.perf_counter()
        while self._pending:
            self._wait_oldest()
        return (time.perf_counter() - start) * 1e3

    def _wait_oldest(self) -> None:
        mb, works, _ = self._pending[0]
        for work in works:
            self._wait(work, f"stage {self.rank + 1} to receive micro-batch {mb}")
        self._pending.popleft()

    # --- receiving (every stage but the first) -------------------------------------------------------------

    def post_receive(self) -> None:
        """Post the receive of the next entry's header (no-op when one is posted)."""
        if self._header is None:
            header = torch.empty(2, dtype=torch.int64, device=self.device)
            self._header = (header, dist.irecv(header, self.rank - 1, tag=HEADER_TAG))

    def start_receiving(self, first: int, end: int) -> None:
        """With `receive_ahead`: a thread takes micro-batches first .. end-1's entries as they come, at most
        `depth` ahead of `receive` (no-op otherwise). Call it once, after the set-up barrier."""
        if not self.receive_ahead or first >= end:
            return
        self._arrived = queue.Queue(maxsize=self.depth)

        def take_all() -> None:
            try:
                for mb in range(first, end):
                    self._arrived.put(self._receive_now(mb, more=mb + 1 < end))
            except BaseException as e:  # the stage raises it at its next receive
                self._arrived.put(e)

        threading.Thread(target=take_all, name=f"stage-{self.rank}-receive", daemon=True).start()

    def receive(self, mb: int, more: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Micro-batch `mb`'s entry from stage rank-1: (hidden (B, L, D) f32, mask (B, L), labels (B, L)).

        Args:
            more: another entry follows; its header's receive is posted before returning.

        Raises:
            ZLError: the wait timed out or the neighbour went away, or an entry of another micro-batch came.
        """
        if self._arrived is None:
            return self._receive_now(mb, more)
        try:
            got = self._arrived.get(timeout=self.timeout.total_seconds() + 5)  # the thread's own waits time out first
        except queue.Empty:
            raise ZLError(f"stage {self.rank}: no entry from stage {self.rank - 1} for micro-batch {mb} within "
                          f"{self.timeout.total_seconds():g} s; did that stage fail? If it is only slow, raise "
                          "--link-timeout.") from None
        if isinstance(got, BaseException):
            raise got
        return got

    def _receive_now(self, mb: int, more: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.post_receive()
        header, work = self._header
        what = f"micro-batch {mb} from stage {self.rank - 1}"
        self._wait(work, what)
        self._header = None
        got, length = (int(v) for v in header.tolist())
        if got != mb:
            raise ZLError(f"stage {self.rank}: received micro-batch {got} from stage {self.rank - 1}, expected {mb}; "
                          "the stages disagree on the run's plan (--samples, --window, --micro-batch).")
        ints = torch.empty(2, self.batch, length, dtype=torch.int64, device=self.device)
        hidden = torch.empty(self.batch, length, self.hidden, dtype=torch.float32, device=self.device)
        works = [dist.irecv(ints, self.rank - 1, tag=INTS_TAG), dist.irecv(hidden, self.rank - 1, tag=HIDDEN_TAG)]
        for w in works:
            self._wait(w, what)
        self.received += 1
        if more:
            self.post_receive()
        return hidden, ints[0], ints[1]

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:  # gloo: "Timed out waiting ...", "Connection closed by peer", ...
            seconds = self.timeout.total_seconds()
            raise ZLError(f"stage {self.rank}: waiting for {what} failed after at most {seconds:g} s ({e}); "
                          "did that stage fail (see its error above)? If it is only slow, raise --link-timeout.") from e

    def stats(self) -> dict:
        return {"sent": self.sent, "received": self.received, "max_in_flight_seen": self.max_in_flight,
                "in_flight_depth": self.depth}
