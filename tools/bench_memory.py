"""Peak memory of one stage as a phone would see it: PSS per frozen-weight dtype and load mode, side by side.

Exports one stage (by default stage 0 of `tinyllama-random --stages 0-6,7-13,14-21`, micro-batch 1, LoRA r=8 on
every projection, as `zl train`; `--lora-targets q_proj,v_proj` for fewer) once per `--frozen-dtype` and sequence length, then trains each program alone for `--steps` steps with the
runner's StageProgram (build/runner/zl_stage_bench, one ExecuTorch thread) in each load mode, reading
/proc/<pid>/smaps_rollup every few milliseconds. It prints one table: peak PSS, its anonymous (heap, planned
memory) and file-backed (mapped program) parts at the peak, the fastest step after the first (a warm-up; the
fastest, because on a shared machine other processes only ever add time) and the program size. Step times of the
same run are comparable with each other, not with another machine's.

    nice -n 10 .venv/bin/python tools/bench_memory.py                                  # seq 128: fp32/bf16/int8 x mmap/file
    nice -n 10 .venv/bin/python tools/bench_memory.py --seq-len 128,256,512 --dtypes int8 --load-modes mmap
    .venv/bin/python tools/bench_memory.py --model tiny-random --stages 0-1,2-3 --steps 3   # smoke run

Exports are written to --work (default: a temporary folder, removed at the end unless --keep; TinyLlama programs
are 0.4-1.7 GB each, 3 GB for the three dtypes at one sequence length). Every program and mode runs --rounds
times, interleaved, so that a busy spell of a shared machine hits them alike; the table keeps each one's highest
peak PSS and fastest step. `--work DIR --keep` once, then `--work DIR --reuse`, times the same programs again
without exporting them (never deleting DIR).
"""

import argparse
import contextlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")
for _name in ("torchao", "torch.utils._pytree", "executorch"):
    logging.getLogger(_name).setLevel(logging.ERROR)

from zl_export.frozen_weights import chunk_elements  # noqa: E402 (after the path)
from zl_export.options import FROZEN_DTYPES  # noqa: E402
from zl_export.recompute import LOSS_CHUNK_ELEMENTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024.0
# --readout-pieces: log2 of the logits a readout piece holds, zl's own by default (zl_export/recompute.py);
# --widen-chunks: log2 of the elements a frozen weight is stored and widened in at once, zl's per dtype by default
# (zl_export/frozen_weights.py; records from before int4's own chunks: 2^24 for every dtype)
DEFAULT_PIECE = LOSS_CHUNK_ELEMENTS.bit_length() - 1
OLD_CHUNK = 24


def zl_chunk(dtype: str) -> int:
    """log2 of the elements zl stores a `dtype` weight's row chunks in."""
    return chunk_elements(dtype).bit_length() - 1


def smaps_rollup_kib(pid: int) -> dict[str, int]:
    """The kB fields of /proc/<pid>/smaps_rollup ("Pss", "Pss_Anon", "Pss_File", "Rss", ...); {} once it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key.strip()] = int(parts[0])
    return fields


def run_measured(cmd: list[str], interval_s: float = 0.005) -> tuple[list[dict], dict[str, int]]:
    """Run `cmd`, sampling its smaps_rollup; returns (its stdout JSON lines, the sample with the highest Pss)."""
    env = {**os.environ, "ZL_LOG_LEVEL": os.environ.get("ZL_LOG_LEVEL", "warn")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak: dict[str, int] = {}
    done = threading.Event()

    def sample():
        while not done.is_set():
            fields = smaps_rollup_kib(proc.pid)
            if fields.get("Pss", 0) > peak.get("Pss", 0):
                peak.clear()
                peak.update(fields)
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")], peak


def export_one(loaded, split: str, stage: int, dtype: str, seq: int, recompute: bool, args, out: Path,
               piece: int = DEFAULT_PIECE, chunk: int | None = None):
    """Export stage `stage` of `split` with frozen weights as `dtype` (and `--recompute`, the program kind of
    --program, readout pieces of 2**`piece` logits where the readout goes in pieces, frozen weights in chunks of
    2**`chunk` elements) into `out`, with its `RECORD` for --reuse; returns the program's (file name, size in
    bytes)."""
    from unittest.mock import patch

    from zl_export import frozen_weights
    from zl_export import recompute as readout
    from zl_export.exporter import build_stage_modules, export_stage, write_program
    from zl_export.frozen_weights import restore_frozen_weights
    from zl_export.manifest import build_manifest, write_manifest
    from zl_export.options import ExportOptions, LoraSettings, LossConfig, ProgramSettings
    from zl_export.stages import parse_spec

    opts = ExportOptions(seq_len=seq, micro_batch=1, lora=LoraSettings(args.lora_rank, 2.0 * args.lora_rank,
                                                                       args.lora_targets).for_family(loaded.family),
                         loss=LossConfig(), max_targets=args.max_targets, frozen_dtype=dtype, recompute=recompute,
                         embedding_dtype=args.embedding_dtype)
    stages = parse_spec(split, loaded.config.num_hidden_layers)
    # read as the modules are built; zl's own chunks (None) per dtype, so int4 layers beside bf16 tables keep theirs
    elements = {} if chunk is None else {"CHUNK_ELEMENTS": 1 << chunk, "INT4_CHUNK_ELEMENTS": 1 << chunk}
    with patch.multiple(frozen_weights, **elements) if elements else contextlib.nullcontext():
        peft_model, modules = build_stage_modules(loaded.model, stages, opts,
                                                  program=ProgramSettings(kind=args.program))
    try:
        with patch.object(readout, "LOSS_CHUNK_ELEMENTS", 1 << piece):  # read as the pieces are traced
            entry = write_program(export_stage(modules[stage], peft_model, opts, loaded.config.vocab_size), out)
        # zl_stage_bench reads the PEFT names there
        write_manifest(build_manifest(loaded, opts, [entry], program=ProgramSettings(kind=args.program)), out)
    finally:
        restore_frozen_weights(peft_model)
        peft_model.unload()
    record = {**wanted(args, dtype, seq, recompute, piece, chunk), "lora_targets": list(opts.lora.targets), "file": entry.file,
              "size_bytes": entry.size_bytes}
    (out / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return entry.file, entry.size_bytes


# What an export left in its folder, for --reuse: the options it was made with, the program's file and size (the
# manifest beside it holds one stage, which `read_manifest` refuses for any stage but 0).
RECORD = "bench_program.json"


def wanted(args, dtype: str, seq: int, recompute: bool, piece: int = DEFAULT_PIECE,
           chunk: int | None = None) -> dict:
    """The options that make a program, as its RECORD holds them (`chunk` None: each dtype's own, zl's)."""
    return {"model": args.model, "stages": args.stages, "stage": args.stage, "program": args.program,
            "frozen_dtype": dtype, "seq_len": seq, "recompute": recompute, "max_targets": args.max_targets,
            "lora_rank": args.lora_rank, "readout_piece": piece,
            "widen_chunk": zl_chunk(dtype) if chunk is None else chunk,
            "own_chunks": chunk is None, "embedding_dtype": args.embedding_dtype}


def reusable(out: Path, args, dtype: str, seq: int, recompute: bool, piece: int = DEFAULT_PIECE,
             chunk: int | None = None):
    """(file name, size in bytes) of the program an earlier run left in `out`, if it was made with these options."""
    try:
        # older records: zl's own sizes
        record = {"readout_piece": DEFAULT_PIECE, "widen_chunk": OLD_CHUNK, "own_chunks": True, "embedding_dtype": None,
                  **json.loads((out / RECORD).read_text())}
        want = wanted(args, dtype, seq, recompute, piece, chunk)
        same = {k: record[k] for k in want} == want
        same = same and (args.lora_targets is None or tuple(record["lora_targets"]) == args.lora_targets)
        path = out / record["file"]
        return (record["file"], record["size_bytes"]) if same and path.is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tinyllama-random")
    ap.add_argument("--stages", default="0-6,7-13,14-21", help="the split the stage comes from")
    ap.add_argument("--stage", type=int, default=0, help="which stage of the split to measure")
    ap.add_argument("--seq-len", default="128", help="comma-separated sequence lengths")
    ap.add_argument("--dtypes", default="fp32,bf16,int8", help="comma-separated --frozen-dtype values")
    ap.add_argument("--embedding-dtype", default=None, choices=FROZEN_DTYPES,
                    help="the embedding's and LM head's storage, for every --dtypes (default: as each)")
    ap.add_argument("--recompute", default="off", help="comma-separated: off, on (--recompute) or both ways")
    ap.add_argument("--readout-pieces", default=str(DEFAULT_PIECE),
                    help="comma-separated log2 of the logits a readout piece holds where the readout goes in pieces "
                         f"(zl's: {DEFAULT_PIECE}); smaller pieces, less memory, more pieces to export and run")
    ap.add_argument("--widen-chunks", default="",
                    help="comma-separated log2 of the elements a frozen weight is stored and widened in at once "
                         f"(zl's: {zl_chunk('int4')} for int4, {zl_chunk('bf16')} for the others); smaller chunks, "
                         "smaller float32 transients, more matmuls")
    ap.add_argument("--program", default="zerolock", choices=("zerolock", "backprop"),
                    help="the stage program's kind (backprop: what --schedule async/gpipe/1f1b trains)")
    ap.add_argument("--load-modes", default="mmap,file", help="comma-separated runner load modes")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (the first is a warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every program and mode, interleaved")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-targets", type=lambda v: tuple(t.strip() for t in v.split(",") if t.strip()),
                    help="projections with adapters (default: every one of the model family's, as zl train)")
    ap.add_argument("--max-targets", type=int, default=16)
    ap.add_argument("--work", type=Path, default=None, help="export folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the exported programs in --work")
    ap.add_argument("--reuse", action="store_true",
                    help="time the programs an earlier --keep run left in --work instead of exporting them again "
                         "(a program whose manifest does not match these options is exported again)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.reuse and args.work is None:
        raise SystemExit("--reuse needs --work: the folder an earlier `--work DIR --keep` run exported into.")

    bench = Path(os.environ.get("ZL_STAGE_BENCH_BIN", ROOT / "build/runner/zl_stage_bench"))
    if not bench.is_file():
        raise SystemExit(f"{bench}: no such binary; build it (cmake --build build --target zl_stage_bench) or set "
                         "ZL_STAGE_BENCH_BIN.")
    from custom_ops import load_library
    from zl_export.model_source import load_model

    load_library()
    seqs = [int(v) for v in args.seq_len.split(",")]
    dtypes = [v for v in args.dtypes.split(",") if v]
    recomputes = [{"off": False, "on": True}[v] for v in args.recompute.split(",") if v]
    pieces = [int(v) for v in args.readout_pieces.split(",") if v]
    chunks = [int(v) for v in args.widen_chunks.split(",") if v] or [None]  # None: zl's, per dtype
    modes = [v for v in args.load_modes.split(",") if v]
    work = args.work or Path(tempfile.mkdtemp(prefix="zl_bench_memory_"))
    loaded = None
    programs = {}  # (seq, dtype, recompute, piece, chunk) -> (path, .pte MiB)
    rows: dict[tuple, dict] = {}
    try:
        for seq, dtype, recompute, piece, given in itertools.product(seqs, dtypes, recomputes, pieces, chunks):
            chunk = zl_chunk(dtype) if given is None else given  # the table's "widen chunk": the dtype's own
            out = work / (f"{dtype}_s{seq}{'_recompute' if recompute else ''}"
                          f"{'' if piece == DEFAULT_PIECE else f'_p{piece}'}"
                          f"{'' if given is None else f'_c{given}'}"
                          f"{'' if args.embedding_dtype is None else f'_e{args.embedding_dtype}'}")
            out.mkdir(parents=True, exist_ok=True)
            found = reusable(out, args, dtype, seq, recompute, piece, given) if args.reuse else None
            if found is not None:
                programs[(seq, dtype, recompute, piece, chunk)] = (out / found[0], found[1] / MIB / MIB)
                print(f"reusing {out / found[0]}", file=sys.stderr)
                continue
            if loaded is None:
                print(f"loading {args.model} ...", file=sys.stderr)
                loaded = load_model(args.model, seed=0)
            t0 = time.perf_counter()
            name, size = export_one(loaded, args.stages, args.stage, dtype, seq, recompute, args, out, piece, given)
            programs[(seq, dtype, recompute, piece, chunk)] = (out / name, size / MIB / MIB)
            print(f"export {dtype} seq {seq}{' recompute' if recompute else ''} pieces 2^{piece} chunks 2^{chunk}: "
                  f"{size / MIB / MIB:,.0f} MiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        del loaded
        # Rounds over every (program, mode), so that a busy spell of the machine hits all of them alike; the
        # table keeps each one's highest PSS and fastest step.
        for r in range(args.rounds):
            for (seq, dtype, recompute, piece, chunk), (path, pte_mib) in programs.items():
                for mode in modes:
                    lines, peak = run_measured([str(bench), "--program", str(path), "--load-mode", mode,
                                                "--steps", str(args.steps), "--threads", str(args.threads)])
                    steps = [ln["ms"] for ln in lines if ln.get("event") == "step"]
                    row = rows.setdefault((seq, dtype, recompute, piece, chunk, mode), {
                        "seq": seq, "dtype": dtype, "recompute": recompute, "readout_piece": piece,
                        "widen_chunk": chunk,
                        "load_mode": mode, "peak_pss_mib": 0.0,
                        "step_ms": float("inf"),
                        "pte_mib": pte_mib,
                        "first_loss": next(ln["loss"] for ln in lines if ln.get("event") == "step")})
                    if peak.get("Pss", 0) / MIB > row["peak_pss_mib"]:
                        row.update(peak_pss_mib=peak.get("Pss", 0) / MIB, anon_mib=peak.get("Pss_Anon", 0) / MIB,
                                   file_mib=peak.get("Pss_File", 0) / MIB)
                    row["step_ms"] = min(row["step_ms"], min(steps[1:] or steps))
                    print(f"round {r + 1}: {dtype} seq {seq}{' recompute' if recompute else ''} 2^{piece}/2^{chunk} {mode}: peak PSS {peak.get('Pss', 0) / MIB:,.0f} MiB, "
                          f"fastest step {min(steps[1:] or steps):,.0f} ms", file=sys.stderr)
    finally:
        if not (args.keep or args.reuse):  # --reuse: the folder holds programs of earlier runs
            shutil.rmtree(work, ignore_errors=True)
    rows = list(rows.values())

    base = {(r["seq"], r["load_mode"], r["recompute"], r["readout_piece"], r["widen_chunk"]): r["step_ms"]
            for r in rows if r["dtype"] == "fp32"}
    kept = {(r["seq"], r["dtype"], r["load_mode"], r["readout_piece"], r["widen_chunk"]): r["step_ms"] for r in rows
            if not r["recompute"]}
    targets = ",".join(args.lora_targets) if args.lora_targets else "every projection"
    print(f"\n{args.model} stage {args.stage} of {args.stages}, micro-batch 1, r={args.lora_rank} on {targets}, "
          f"{args.threads} thread(s), {args.steps} steps x {args.rounds} rounds, {args.program} program, "
          f"{args.max_targets or 'every position'} read out"
          + (f", embedding and head {args.embedding_dtype}" if args.embedding_dtype else "") + "\n")
    print("| seq | frozen dtype | recompute | readout piece | widen chunk | load mode | peak PSS (MiB) | anonymous "
          "| file-backed | step (ms) | vs fp32 | vs kept | .pte (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        grain = (r["readout_piece"], r["widen_chunk"])
        ref = base.get((r["seq"], r["load_mode"], r["recompute"], *grain))
        ratio = f"{r['step_ms'] / ref:.2f}x" if ref else "-"
        ref = kept.get((r["seq"], r["dtype"], r["load_mode"], *grain)) if r["recompute"] else None
        vs_kept = f"{r['step_ms'] / ref:.2f}x" if ref else "-"
        print(f"| {r['seq']} | {r['dtype']} | {'on' if r['recompute'] else 'off'} | 2^{r['readout_piece']} | "
              f"2^{r['widen_chunk']} | "
              f"{r['load_mode']} | "
              f"{r['peak_pss_mib']:,.0f} | {r['anon_mib']:,.0f} | {r['file_mib']:,.0f} | {r['step_ms']:,.0f} | "
              f"{ratio} | {vs_kept} | {r['pte_mib']:,.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
