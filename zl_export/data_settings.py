"""How a data file's rows become training samples: the options `zl data` and `zl train` share.

`DataSettings` is one node of the settings tree (zl_base/settings.py) that both commands nest, so --format, the column
options, --truncate and --seq-len are declared (default, flag, help, check) once, here. Torch-free: the CLI builds
its options from it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from zl_base.settings import check_fields, nested, setting
from zl_export.data_columns import DataColumns
from zl_export.options import MAX_SEQ_LEN, check_seq_len

#: The formats of a data file (zl_export/data.py reads each).
FORMATS = ("auto", "prompt_completion", "chat", "sharegpt", "alpaca", "text_label", "agnews")


@dataclass(frozen=True)
class DataSettings:
    """Which columns of which format are read, and how long a sample is."""

    format: str = setting("auto", "Format of a .csv/.jsonl/.parquet/.arrow file: auto (from the columns), "
                                  "prompt_completion (prompt,completion), chat (messages), sharegpt (conversations "
                                  "of from/value turns), alpaca (instruction, optional input, output), text_label "
                                  "(text,label) or agnews (label,title,description with labels 1-4).",
                          flag="--format -f")
    columns: DataColumns = nested(DataColumns)  # --prompt-column, --completion-column, --prompt-template
    truncate: bool = setting(False, "Rows longer than --seq-len: cut the prompt from the left and drop rows whose "
                                    "completion alone does not fit, with counts printed (default: fail, naming the "
                                    "row). A completion is never cut.", flag="--truncate/--no-truncate")
    seq_len: int | None = setting(None, f"Tokens per sample (2 to {MAX_SEQ_LEN}), padded on the right; `zl train`'s "
                                        "programs have this fixed length (default 128; the demo task: its longest "
                                        "sample, rounded up to 16).", check=check_seq_len)

    def validate(self) -> None:
        """--seq-len's range (before anything is allocated: rows x seq_len int64 tensors) and the column options."""
        check_fields(self)
        self.columns.validate()
