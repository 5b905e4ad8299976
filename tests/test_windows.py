"""The window plan (zl_device/formats/windows.py) and the checkpoint layout (zl_device/formats/checkpoints.py)."""

from zl_device.formats.checkpoints import CheckpointLayout
from zl_device.formats.windows import WindowPlan


def test_window_plan_of_a_run_with_a_short_last_window():
    plan = WindowPlan.for_samples(samples=19, micro_batch=2, window_size=4)  # 10 micro-batches: 4 + 4 + 2
    assert (plan.num_micro_batches, plan.num_windows) == (10, 3)
    assert [plan.window_of(mb) for mb in range(10)] == [0] * 4 + [1] * 4 + [2] * 2
    assert [plan.start(w) for w in range(3)] == [0, 4, 8]
    assert [plan.micro_batches(w) for w in range(3)] == [range(0, 4), range(4, 8), range(8, 10)]
    assert [plan.done_after(w) for w in (-1, 0, 1)] == [0, 4, 8]
    assert [plan.middle(w) for w in range(3)] == [1, 5, 9]
    assert [plan.exists(w) for w in (-1, 0, 2, 3)] == [False, True, True, False]
    assert WindowPlan(8, 1).middle(3) == 3 and WindowPlan(8, 1).num_windows == 8


def test_checkpoint_layout_names_on_devices_and_the_host(tmp_path):
    layout = CheckpointLayout()
    assert layout.window_name(12) == "window_000012"
    assert layout.device_progress("checkpoints", 3) == "checkpoints/window_000003/progress.json"
    assert layout.window_numbers(["window_000010", ".tmp-window_000011", "input_log", "window_000002"]) == [2, 10]
    root = layout.stage_root(tmp_path, 1)
    (root / "window_000004").mkdir(parents=True)
    (root / "window_000007").write_text("a file, not a window")
    assert root == tmp_path / "stage_1" and layout.windows(root) == [4]
