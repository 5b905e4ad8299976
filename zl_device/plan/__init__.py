"""Planning the split of layers over unequal devices (`zl plan`, `zl train --stages auto`; docs/design#planning).

calibrate.py measures each device's stage at two layer counts through the run's own code (run/), costs.py fits
fixed + per-layer costs, zl_device/run/split.py chooses the split, planner.py ties them together, plan_file.py is the plan on disk.
The top layer of zl_device: it runs calibration rounds through run/, which never imports it.
"""
