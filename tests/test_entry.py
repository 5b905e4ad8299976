"""How a zl command line ends when a signal stops it (zl_base/entry.py `stopped_by_signals`): Ctrl-C and SIGTERM
raise `Stopped` where the command was, so its cleanup runs; `zl train`'s end to end case is in test_train.py."""

import os
import signal

import pytest

from zl_base.entry import Stopped, stopped_by_signals


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_raises_stopped_once_and_the_cleanup_runs_to_its_end(sig, code):
    before = signal.getsignal(sig)
    cleaned = []
    with pytest.raises(Stopped) as stopped:
        with stopped_by_signals():
            try:
                os.kill(os.getpid(), sig)  # the handler runs as the call returns
                pytest.fail("the signal did not stop the command")
            finally:
                os.kill(os.getpid(), sig)  # a second Ctrl-C while stopping: ignored, the cleanup goes on
                cleaned.append(True)
    assert (stopped.value.name, stopped.value.exit_code) == (signal.Signals(sig).name, code)
    assert isinstance(stopped.value, KeyboardInterrupt)  # what does not catch Ctrl-C does not catch this
    assert cleaned == [True]
    assert signal.getsignal(sig) is before  # the previous handler is back
