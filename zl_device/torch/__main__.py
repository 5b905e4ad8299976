"""`python -m zl_device.torch RUN_DIR/torch_job.json`: one rank under torchrun (harness.main)."""

import sys

from zl_device.torch.harness import main

sys.exit(main())
